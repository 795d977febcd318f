"""Expert offload: an MoE mHC checkpoint loads with a ``device_map`` that sends the experts of half its MoE layers to
disk (Accelerate's hooks read them from the safetensors file at each forward) and gives the same logits and greedy
tokens as the model loaded whole; ``device_map="auto"`` with a ``max_memory`` too small for the model sends whole
layers to disk, with the same logits; and the memory such a split saves, from the parameter counts of a config."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from accelerate.utils.offload import OffloadedWeightsLoader
from conftest import MOE_FAMILIES, assert_logits_close, tiny_backbone_config, token_ids
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

import hf_mhc
from hf_mhc import MHCConfig, MHCForCausalLM
from hf_mhc.modeling_mhc import HC_MODULE_NAMES
from hf_mhc.offload import expert_modules, offload_device_map

BACKBONES_PAGE = Path(__file__).resolve().parents[1] / "docs" / "backbones.md"
LAYERS = 5  # 4 MoE layers after the dense layer 0 of qwen3_moe and deepseek_v3, 5 in the other families


pytestmark = pytest.mark.usefixtures("one_thread")


def saved_mhc_model(family: str, folder: Path, *, fused: bool = False) -> Path:
    """A tiny upcycled MoE mHC model with perturbed norms and biases (routing that depends on the token) and random,
    token-dependent HC maps, saved to ``folder``: in the published layout (one tensor per expert), or with
    ``fused`` in the in-memory one (``mlp.experts.gate_up_proj``) as older mHC checkpoints hold it."""
    source = AutoModelForCausalLM.from_config(tiny_backbone_config(family, initializer_range=0.2,
                                                                   num_hidden_layers=LAYERS))
    with torch.no_grad():
        for name, tensor in (*source.named_parameters(), *source.named_buffers()):
            if "norm" in name or name.endswith(".bias") or name.endswith("e_score_correction_bias"):
                tensor.add_(0.5 * torch.randn_like(tensor))
    model = hf_mhc.upcycle(source.eval(), hc_mult=4)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(f".{module}." in f".{name}" for module in HC_MODULE_NAMES):
                param.add_(0.3 * torch.randn_like(param))
    model.save_pretrained(folder)
    if fused:
        tensors = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def parameters_under(model: torch.nn.Module, modules: list[str]) -> dict[str, torch.nn.Parameter]:
    return {name: param for name, param in model.named_parameters()
            if any(name.startswith(module + ".") for module in modules)}


def disk_index(model: torch.nn.Module, modules: list[str]) -> dict[str, dict]:
    """The offload index of the Accelerate hooks on ``modules``: parameter name -> safetensors file and tensor name
    it is read from at each forward. Each module must carry an offloading hook whose loader holds nothing in RAM."""
    index = {}
    for name in modules:
        hook = getattr(model.get_submodule(name), "_hf_hook", None)
        assert hook is not None and hook.offload, f"{name} has no offloading Accelerate hook"
        loader = hook.weights_map.dataset
        assert isinstance(loader, OffloadedWeightsLoader) and not loader.state_dict, f"{name} is not read from disk"
        index.update({key: entry for key, entry in loader.index.items() if key.startswith(name + ".")})
    return index


def assert_experts_on_disk(model: torch.nn.Module, reference: torch.nn.Module, offloaded: list[str]) -> set[Path]:
    """The parameters of ``offloaded`` live on disk only (``meta`` in the model, every one in the hooks' index,
    whose file holds ``reference``'s values exactly); every other parameter is an ordinary CPU tensor. Returns the
    folders of the files the offloaded parameters are read from."""
    on_disk = parameters_under(model, offloaded)
    assert on_disk, "no parameters under the offloaded modules"
    assert {name: param.device.type for name, param in on_disk.items()} == dict.fromkeys(on_disk, "meta")
    others = {name: param.device.type for name, param in model.named_parameters() if name not in on_disk}
    assert others == dict.fromkeys(others, "cpu")
    index = disk_index(model, offloaded)
    assert set(index) == set(on_disk)
    expected = dict(reference.named_parameters())
    loaders = {name: model.get_submodule(name)._hf_hook.weights_map.dataset for name in offloaded}
    for name in on_disk:
        assert Path(index[name]["safetensors_file"]).is_file()
        loader = next(loaders[module] for module in offloaded if name.startswith(module + "."))
        assert torch.equal(loader[name], expected[name].detach()), name
    return {Path(entry["safetensors_file"]).parent for entry in index.values()}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_experts_of_half_the_layers_on_disk_give_the_same_logits_and_tokens(family, tmp_path):
    """The experts of every other MoE layer go to ``"disk"``, the rest to ``"cpu"``. The model holds them on
    ``meta`` and Accelerate reads them from disk at each forward: the checkpoint stores one tensor per expert, so
    transformers writes the fused tensors it builds at load into ``offload_folder`` and reads them from there. The
    arithmetic is that of the whole model: logits equal the model loaded without a device map up to float32 rounding
    (the offloaded weights lie at other addresses, which BLAS may block otherwise), and so do cached greedy tokens."""
    folder = saved_mhc_model(family, tmp_path / "model")
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    moe_layers = expert_modules(reference)
    assert len(moe_layers) >= 4
    offloaded = moe_layers[1::2]  # half of the MoE layers (rounded down)
    device_map = offload_device_map(reference, set(offloaded))
    model = AutoModelForCausalLM.from_pretrained(folder, device_map=device_map,
                                                 offload_folder=tmp_path / "offload").eval()
    assert {name: model.hf_device_map[name] for name in offloaded} == dict.fromkeys(offloaded, "disk")
    assert assert_experts_on_disk(model, reference, offloaded) == {tmp_path / "offload"}

    ids = token_ids()
    with torch.no_grad():
        expected = reference(ids, output_router_logits=True)
        got = model(ids).logits
    assert all(logits.argmax(-1).unique().numel() > 1 for logits in expected.router_logits)  # routing per token
    assert_logits_close(got, expected.logits)
    assert all(param.device.type == "meta" for param in parameters_under(model, offloaded).values())  # still on disk
    greedy = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(model.generate(ids, **greedy), reference.generate(ids, **greedy))


def test_a_checkpoint_with_fused_experts_is_offloaded_in_place(tmp_path):
    """An mHC checkpoint that stores the experts fused, as the model holds them, is read where it lies: the hooks'
    index points into its ``model.safetensors`` and nothing is written to ``offload_folder``."""
    folder = saved_mhc_model("qwen3_moe", tmp_path / "model", fused=True)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    offloaded = expert_modules(reference)[1::2]
    model = AutoModelForCausalLM.from_pretrained(folder, device_map=offload_device_map(reference, set(offloaded)),
                                                 offload_folder=tmp_path / "offload").eval()
    assert assert_experts_on_disk(model, reference, offloaded) == {folder}
    assert not any((tmp_path / "offload").iterdir())
    ids = token_ids()
    with torch.no_grad():
        assert_logits_close(model(ids).logits, reference(ids).logits)


def test_the_offload_check_fails_when_nothing_was_offloaded(tmp_path):
    """The assertion above is not vacuous: a model loaded with every module on ``"cpu"`` fails it."""
    folder = saved_mhc_model("qwen3_moe", tmp_path / "model")
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    offloaded = expert_modules(reference)[1::2]
    model = AutoModelForCausalLM.from_pretrained(folder, device_map=offload_device_map(reference, set(offloaded),
                                                                                       offload_to="cpu"))
    with pytest.raises(AssertionError):
        assert_experts_on_disk(model, reference, offloaded)


def test_a_device_map_that_places_an_ancestor_of_the_offloaded_experts_fails_in_accelerate(tmp_path):
    """Why ``offload_device_map`` names siblings: with ``""`` itself an entry, Accelerate tries to place the
    offloaded experts with everything else."""
    folder = saved_mhc_model("mixtral", tmp_path / "model")
    with pytest.raises(ValueError, match="meta device"):
        AutoModelForCausalLM.from_pretrained(folder, device_map={"": "cpu", "model.layers.1.mlp.experts": "disk"},
                                             offload_folder=tmp_path / "offload")


def test_auto_device_map_with_max_memory_sends_layers_to_disk(tmp_path):
    """``device_map="auto"`` with a CPU budget of half the model's bytes: the first modules stay on CPU, the rest
    go to disk whole (``MHCDecoderLayer`` is in ``_no_split_modules``, as the source's decoder layer is in its
    own), and the logits are the same up to float32 rounding."""
    folder = saved_mhc_model("qwen3_moe", tmp_path / "model")
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    total = sum(param.numel() * param.element_size() for param in reference.parameters())
    model = AutoModelForCausalLM.from_pretrained(folder, device_map="auto", max_memory={"cpu": total // 2},
                                                 offload_folder=tmp_path / "offload").eval()
    placement = model.hf_device_map
    on_disk = [name for name, device in placement.items() if device == "disk"]
    assert "cpu" in placement.values() and any(re.fullmatch(r"model\.layers\.\d+", name) for name in on_disk)
    assert all(param.device.type == "meta" for param in parameters_under(model, on_disk).values())
    ids = token_ids()
    with torch.no_grad():
        assert_logits_close(model(ids).logits, reference(ids).logits)


def expert_parameter_bytes(backbone_config: PretrainedConfig, hc_mult: int = 4,
                           dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Bytes of the mHC model of ``backbone_config`` (built on ``meta``, nothing allocated) by part: ``experts``
    (the routed experts), ``hc`` (the HC tensors, float32 as mHC keeps them) and ``other`` (the rest of the
    backbone); backbone tensors in ``dtype``."""
    with torch.device("meta"):
        model = MHCForCausalLM(MHCConfig(backbone_config=backbone_config, hc_mult=hc_mult))
    experts = set(expert_modules(model))
    counts = {"experts": 0, "hc": 0, "other": 0}
    for name, param in model.named_parameters():
        if any(f".{module}." in f".{name}" for module in HC_MODULE_NAMES):
            counts["hc"] += param.numel() * 4
        else:
            part = "experts" if name.rsplit(".", 1)[0] in experts else "other"
            counts[part] += param.numel() * torch.empty((), dtype=dtype).element_size()
    return counts


def qwen3_30b_a3b() -> PretrainedConfig:
    """Qwen3-30B-A3B's published sizes (its config.json): 48 layers, all MoE, 128 experts of width 768."""
    return AutoConfig.for_model("qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                tie_word_embeddings=False)


def deepseek_v3() -> PretrainedConfig:
    """DeepSeek-V3's published sizes (its config.json, without the multi-token-prediction layer): 61 layers, the
    first 3 dense, 256 routed experts of width 2048 and one shared expert."""
    return AutoConfig.for_model("deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                                moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                                num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
                                num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
                                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_group=8, topk_group=4,
                                tie_word_embeddings=False)


def test_expert_parameter_bytes_match_the_closed_form_and_a_real_model():
    """Experts: ``moe_layers · experts · 3 · hidden · moe_width`` parameters (gate, up and down projections); the
    parts sum to the real tiny model's bytes; the published configs give their published totals (30.5B, 671B)."""
    config = tiny_backbone_config("qwen3_moe", num_hidden_layers=LAYERS)
    counts = expert_parameter_bytes(config, dtype=torch.float32)
    assert counts["experts"] == (LAYERS - 1) * 4 * 3 * 32 * 16 * 4
    model = MHCForCausalLM(MHCConfig(backbone_config=config, hc_mult=4))
    assert sum(counts.values()) == sum(param.numel() * param.element_size() for param in model.parameters())

    qwen = expert_parameter_bytes(qwen3_30b_a3b())
    assert qwen["experts"] == 48 * 128 * 3 * 2048 * 768 * 2
    assert round((qwen["experts"] + qwen["other"]) / 2 / 1e9, 1) == 30.5
    deepseek = expert_parameter_bytes(deepseek_v3(), dtype=torch.float8_e4m3fn)
    assert deepseek["experts"] == 58 * 256 * 3 * 7168 * 2048
    assert round((deepseek["experts"] + deepseek["other"]) / 1e9) == 671


def test_the_docs_quote_the_computed_split():
    """The docs' memory figures (Qwen3-30B-A3B in bfloat16, DeepSeek-V3 at one byte per parameter) are
    ``expert_parameter_bytes``'s."""
    counts = expert_parameter_bytes(qwen3_30b_a3b())
    gib = 2**30
    rest = counts["other"] + counts["hc"]
    figures = [f"{(counts['experts'] + rest) / gib:.1f} GiB", f"{counts['experts'] / gib:.1f} GiB",
               f"{rest / gib:.1f} GiB", f"{counts['experts'] / 2 / gib:.1f} GiB",
               f"{(rest + counts['experts'] / 2) / gib:.1f} GiB"]
    deepseek = expert_parameter_bytes(deepseek_v3(), dtype=torch.float8_e4m3fn)
    figures += [f"{deepseek['experts'] / gib:.1f} GiB", f"{sum(deepseek.values()) / gib:.1f} GiB"]
    section = BACKBONES_PAGE.read_text(encoding="utf-8").split("## Expert offload", 1)[-1].split("\n## ", 1)[0]
    missing = [figure for figure in figures if figure not in section]
    assert not missing, f"the docs' Expert offload section lacks {missing}"

