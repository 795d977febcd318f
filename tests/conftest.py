"""Shared fixtures: tiny backbone configs for every supported family, the optional real assets."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# The op tests run on TEST_DEVICE: "cpu" (default) runs the Triton kernels in the interpreter, which must be switched
# on before any @triton.jit is evaluated; HF_MHC_TEST_DEVICE=cuda runs them compiled, on a GPU.
TEST_DEVICE = os.environ.get("HF_MHC_TEST_DEVICE", "cpu")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from hf_mhc.conversion.verify import logit_tolerance  # noqa: E402

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
STORIES260K = ASSETS / "stories260K"
JANEAUSTEN = ASSETS / "janeausten"

VOCAB = 101

# What each family's tiny config sets beyond the common shape, so that its own features are exercised: Qwen2's q/k/v
# biases come with the family, Qwen3 and OLMo 2 have q/k norms, Mistral and Gemma 3 sliding-window layers (Gemma 3
# alternates sliding and full layers, each with its own rotary frequencies), SmolLM3 NoPE layers, Granite its four
# multipliers with biases, Gemma 3 soft-capped logits and attention scores.
FAMILY_SETTINGS: dict[str, dict] = {
    "llama": {},
    "mistral": dict(sliding_window=6),
    "qwen2": {},
    "qwen3": dict(head_dim=8),
    "gemma3_text": dict(head_dim=8, sliding_window=4, sliding_window_pattern=2, query_pre_attn_scalar=6,
                        final_logit_softcapping=4.0, attn_logit_softcapping=3.0, rope_local_base_freq=100.0),
    "olmo2": {},
    "phi3": {},
    "granite": dict(embedding_multiplier=3.0, residual_multiplier=0.4, logits_scaling=2.5, attention_multiplier=0.3,
                    attention_bias=True, mlp_bias=True),
    "smollm3": dict(no_rope_layer_interval=2, attention_bias=True),
    # MoE: 4-8 experts, 2 per token, a load-balancing coefficient large enough to show in the loss; Qwen3-MoE and
    # DeepSeek-V3 with a dense first layer; Qwen2-MoE with its gated shared expert; DeepSeek-V3 with latent attention
    # (q and kv LoRA ranks), grouped top-k routing over 2 groups and a shared expert.
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, router_aux_loss_coef=0.1),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8, mlp_only_layers=[0],
                      router_aux_loss_coef=0.1, norm_topk_prob=True),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1),
    "deepseek_v3": dict(num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                        moe_intermediate_size=16, first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=16,
                        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8),
}


def tiny_backbone_config(family: str, *, tie_word_embeddings: bool = False, **overrides):
    """A 2-layer GQA config of ``family`` small enough for CPU tests, with the family's settings above."""
    if family not in FAMILY_SETTINGS:
        raise ValueError(family)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(FAMILY_SETTINGS[family])
    common.update(overrides)
    return AutoConfig.for_model(family, **common)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # the families the older, family-parametrised tests run on
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
DENSE_FAMILIES = tuple(family for family in FAMILY_SETTINGS if family not in MOE_FAMILIES)

# Changes to a tiny Llama's config.json, and the reason the examples give in their one-line error: two configs that
# transformers' validation or attention rejects, and one whose weights no longer fit it.
REJECTED_CONFIGS = [
    ({"hidden_size": 100, "num_attention_heads": 3},
     "The hidden size (100) is not a multiple of the number of attention heads (3)."),
    ({"num_key_value_heads": 3},
     "num_attention_heads (4) is not a multiple of num_key_value_heads (3): each key/value head serves the same "
     "number of query heads."),
    ({"intermediate_size": 40}, "its weights do not fit its config.json (model.layers.0.mlp.down_proj.weight is "),
]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny models gain nothing from threads, and OpenMP threads spin against each other on a busy shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def import_script(path: Path):
    """A script (``examples/*.py``, ``benchmarks/*.py``) imported as a module: its functions, without running it."""
    spec = importlib.util.spec_from_file_location(f"script_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def loss_gradients(model, input_ids) -> dict:
    """Every parameter's gradient of ``model``'s next-token loss on ``input_ids`` (``labels=input_ids``), cloned."""
    model.zero_grad()
    model(input_ids, labels=input_ids).loss.backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def assert_logits_close(got: torch.Tensor, expected: torch.Tensor, rtol: float | None = None) -> None:
    """``max|Δ| <= rtol · max(1, max|expected|)``, by default the converter's float32 rule (``logit_tolerance``):
    float32 rounding grows with the logits' size. For two computations of the same function that may round
    differently: other code, or the same code on weights in other memory (a reloaded model's weights are read from
    the checkpoint file, at other addresses and alignments, which BLAS kernels may block differently on another CPU).
    """
    scale = expected.abs().max().item()
    bound = logit_tolerance(scale) if rtol is None else rtol * max(1.0, scale)
    difference = (got - expected).abs().max().item()
    assert difference <= bound, f"max |Δ| = {difference:.3g} > {bound:.3g} (logit scale {scale:.3g})"


def assert_same_weights(got: torch.nn.Module, expected: torch.nn.Module) -> None:
    """Every state-dict tensor of ``got`` bit-equal to ``expected``'s, same names, shapes and dtypes: what a reload
    must restore exactly (its logits then differ by rounding alone, see ``assert_logits_close``)."""
    got_state, expected_state = got.state_dict(), expected.state_dict()
    assert set(got_state) == set(expected_state), set(got_state) ^ set(expected_state)
    for name, tensor in expected_state.items():
        assert got_state[name].dtype == tensor.dtype and torch.equal(got_state[name], tensor), name


def assert_same_greedy_decoding(got, expected) -> None:
    """Two greedy ``generate(..., output_logits=True, return_dict_in_generate=True)`` runs of one model by different
    code: at every step the logits agree (``assert_logits_close``) and so do the chosen tokens, up to the first step at
    which ``expected``'s two best logits are within that tolerance of each other (a tie that rounding may break either
    way; the runs may part there, so nothing after it is compared)."""
    new = len(expected.logits)
    assert got.sequences.shape == expected.sequences.shape
    torch.testing.assert_close(got.sequences[:, :-new], expected.sequences[:, :-new], rtol=0, atol=0)  # the prompt
    for step, (got_logits, expected_logits) in enumerate(zip(got.logits, expected.logits, strict=True)):
        assert_logits_close(got_logits, expected_logits)
        top2 = expected_logits.float().topk(2, dim=-1).values
        tie = (top2[:, 0] - top2[:, 1] <= logit_tolerance(expected_logits.abs().max().item())).any()
        if tie:
            return
        chosen = got.sequences[:, step - new], expected.sequences[:, step - new]
        assert torch.equal(*chosen), f"greedy step {step}: tokens {chosen[0].tolist()} != {chosen[1].tolist()}"
