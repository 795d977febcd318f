"""`hf-mhc convert` of a fine-grained FP8 checkpoint, the format DeepSeek-V3 is published in.

Such a checkpoint stores each Linear weight ``W [out, in]`` as float8_e4m3fn ``Q`` with a float32
``weight_scale_inv S [out / b0, in / b1]`` beside it, ``W ≈ Q · S`` block by block, and its config.json has
``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size":
[b0, b1]}``. Without a GPU transformers dequantizes it on load (``W = Q · S`` in the model's dtype). The tests build
such a checkpoint from a tiny random DeepSeek-V3 (MLA attention; every layer dense; a separate test has routed experts,
published one tensor per expert), check that transformers reads it as the
dequantized model, then convert it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, tiny_backbone_config
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import hf_mhc  # noqa: F401  (registers the mHC classes)
from hf_mhc.cli import main
from hf_mhc.conversion import convert_checkpoint, is_hc_parameter

BLOCK = (8, 8)  # weight_block_size: every Linear dimension of the tiny config is a multiple of 8
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}


def quantize_blockwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` -> float8_e4m3fn ``q [out, in]`` and float32 ``scale_inv [out/b0, in/b1]``, each block
    scaled so that its largest entry maps to the e4m3 maximum, as DeepSeek-V3's checkpoints are made."""
    rows, cols = weight.shape
    blocks = weight.reshape(rows // BLOCK[0], BLOCK[0], cols // BLOCK[1], BLOCK[1])
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale_inv[:, None, :, None]).reshape(rows, cols).to(torch.float8_e4m3fn)
    return q, scale_inv.float()


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``q · scale_inv`` block by block, in float32: the weight the FP8 checkpoint stands for."""
    rows, cols = q.shape
    blocks = q.float().reshape(rows // BLOCK[0], BLOCK[0], cols // BLOCK[1], BLOCK[1])
    return (blocks * scale_inv[:, None, :, None]).reshape(rows, cols)


def raw_entries(folder: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of the safetensors files in ``folder`` as stored: dtype name, shape and raw bytes."""
    entries = {}
    for path in sorted(folder.glob("*.safetensors")):
        data = path.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        header.pop("__metadata__", None)
        for name, entry in header.items():
            start, stop = entry["data_offsets"]
            entries[name] = (entry["dtype"], entry["shape"], data[8 + length + start : 8 + length + stop])
    return entries


def build_fp8_checkpoint(folder: Path, family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Write an FP8 checkpoint of a tiny random ``family`` model (norms perturbed) to ``folder``: every Linear weight
    but the lm_head block-quantized, config.json with the FP8 quantization_config, generation_config.json. Returns
    the unquantized model and the dequantized one (``Q · S`` in place of each quantized weight: what the checkpoint
    stands for)."""
    torch.manual_seed(0)
    folder.mkdir()
    overrides = {"first_k_dense_replace": 2} if family == "deepseek_v3" else {}
    config = tiny_backbone_config(family, initializer_range=0.2, **overrides)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "norm" in name:
                tensor.add_(0.5 * torch.randn_like(tensor))
    dequantized = AutoModelForCausalLM.from_config(config).eval()
    state, reference = {}, {}
    for name, tensor in model.state_dict().items():
        module = model.get_submodule(name.rpartition(".")[0])
        if type(module) is torch.nn.Linear and name != "lm_head.weight":  # the lm_head stays unquantized
            state[name], state[name + "_scale_inv"] = quantize_blockwise(tensor)
            reference[name] = dequantize_blockwise(state[name], state[name + "_scale_inv"])
        else:
            state[name] = reference[name] = tensor.clone()
    dequantized.load_state_dict(reference)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    config.quantization_config = dict(QUANTIZATION)
    config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    return model, dequantized


@pytest.fixture(scope="module")
def fp8_source(tmp_path_factory) -> tuple[Path, torch.nn.Module, torch.nn.Module]:
    """An FP8 DeepSeek-V3 checkpoint folder (MLA, dense layers), its unquantized and its dequantized model."""
    folder = tmp_path_factory.mktemp("fp8") / "src"
    return folder, *build_fp8_checkpoint(folder, "deepseek_v3")


def token_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))


def logits_of(folder: Path, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3"])  # DeepSeek-V3 and Qwen3-*-FP8 are published so
def test_fp8_conversion_keeps_the_quantized_bytes_and_the_source_logits(family, tmp_path):
    """The synthetic checkpoint is what transformers reads as FP8 (its CPU load equals the dequantized model and
    lies within e4m3 rounding of the unquantized one); the conversion copies every float8 weight and scale byte for
    byte, moves the quantization_config to the top of the mHC config (where from_pretrained reads it), adds the HC
    tensors in float32, verifies, and loads (dequantized on CPU) with the source's logits."""
    src = tmp_path / "src"
    unquantized, dequantized = build_fp8_checkpoint(src, family)
    ids = token_ids()
    source_logits = logits_of(src, ids)
    with torch.no_grad():
        scale = dequantized(ids).logits.abs().max().item()
        assert (source_logits - dequantized(ids).logits).abs().max().item() <= 1e-5 * scale
        # e4m3 keeps 3 mantissa bits: each weight moves by up to 1/16 of itself; the logits by a few percent
        fp8_error = (source_logits - unquantized(ids).logits).abs().max().item()
        assert 1e-3 * scale < fp8_error < 0.3 * scale

    out = tmp_path / "out"
    report = convert_checkpoint(src, out, hc_mult=4, progress=False)
    assert report.verification is not None and report.verification.passed, report.verification.summary()

    source_entries, out_entries = raw_entries(src), raw_entries(out)
    fp8_names = [name for name, (dtype, _, _) in source_entries.items() if dtype == "F8_E4M3"]
    linears = [name for name, module in unquantized.named_modules() if type(module) is torch.nn.Linear]
    assert len(fp8_names) == len(linears) - 1 == {"deepseek_v3": 16, "qwen3": 14}[family]  # all but the lm_head
    for name in fp8_names:
        assert out_entries[name] == source_entries[name], name
        assert out_entries[name + "_scale_inv"] == source_entries[name + "_scale_inv"], name
        assert out_entries[name + "_scale_inv"][0] == "F32"
    assert {name: entry for name, entry in out_entries.items() if not is_hc_parameter(name)} == source_entries
    hc = [entry for name, entry in out_entries.items() if is_hc_parameter(name)]
    assert hc and all(dtype == "F32" for dtype, _, _ in hc)

    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION
    assert "quantization_config" not in config["backbone_config"]
    assert report.quantization == QUANTIZATION
    assert "fine-grained FP8, float8 with block scales `weight_scale_inv`" in (out / "README.md").read_text()

    got = logits_of(out, ids)
    assert (got - source_logits).abs().max().item() <= 1e-4 * max(1.0, source_logits.abs().max().item())


def test_dtype_casts_only_the_unquantized_tensors_of_an_fp8_checkpoint(fp8_source, tmp_path, capsys):
    """``--dtype bfloat16`` casts embeddings, norms and lm_head; the float8 weights and their float32 scales stay
    byte-exact (a cast would change what they mean), and one warning line says so."""
    src, _, _ = fp8_source
    out = tmp_path / "out"
    status = main(["convert", str(src), str(out), "--dtype", "bfloat16", "--no-verify"])
    assert status == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("hf-mhc convert: warning: --dtype bfloat16")]
    assert len(warnings) == 1 and "16 float8 weights and their weight_scale_inv stay as stored" in warnings[0], err
    source_entries, out_entries = raw_entries(src), raw_entries(out)
    for name, (dtype, shape, data) in source_entries.items():
        if dtype == "F8_E4M3" or name.endswith("_scale_inv"):
            assert out_entries[name] == (dtype, shape, data), name
        else:
            assert out_entries[name][0] == "BF16", name
    ids = token_ids()
    got, expected = logits_of(out, ids, torch.bfloat16), logits_of(src, ids, torch.bfloat16)
    assert (got - expected).abs().max().item() <= 0.1 * max(1.0, expected.abs().max().item())


def rewrite(
    src: Path, folder: Path, *, drop: str | None = None, replace: dict | None = None, config: dict | None = None
):
    """A copy of the FP8 checkpoint ``src`` in ``folder`` with one tensor dropped or replaced, or config changed."""
    folder.mkdir()
    state = load_file(src / "model.safetensors")
    if drop is not None:
        del state[drop]
    state.update(replace or {})
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    raw.update(config or {})
    (folder / "config.json").write_text(json.dumps(raw))


SCALE = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        (dict(config={"quantization_config": None}), ["holds float8 tensors", "no quantization_config"]),
        (
            dict(config={"quantization_config": {"quant_method": "bitsandbytes"}}),
            ["is quantized (bitsandbytes)", "convert the unquantized model"],
        ),
        (dict(config={"quantization_config": {**QUANTIZATION, "weight_block_size": 8}}), ["weight_block_size is 8"]),
        (dict(config={"quantization_config": {**QUANTIZATION, "activation_scheme": "static"}}), ["fp8 with static"]),
        (dict(drop=SCALE), ["q_a_proj.weight is float8 but has no", "weight_scale_inv beside it"]),
        (dict(replace={SCALE: torch.ones(2, 2)}), [SCALE, "has shape [2, 2]", "needs floating scales of shape [3, 4]"]),
    ],
)
def test_a_malformed_fp8_checkpoint_fails_in_one_line(fp8_source, tmp_path, capsys, change, fragments):
    src, _, _ = fp8_source
    rewrite(src, tmp_path / "bad", **change)
    status = main(["convert", str(tmp_path / "bad"), str(tmp_path / "out"), "--no-verify"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("hf-mhc convert: error: ")]
    assert status == 1 and len(lines) == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not (tmp_path / "out").exists()


def test_fp8_routed_experts_in_the_published_layout_convert_byte_exact(tmp_path):
    """DeepSeek-V3's routed experts are published one FP8 tensor per expert, each with its scales: they are copied as
    stored, and transformers pairs each with its scales and fuses the experts when it loads the mHC checkpoint."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_backbone_config("deepseek_v3")).save_pretrained(tmp_path / "plain")
    state = load_file(tmp_path / "plain" / "model.safetensors")
    experts = [name for name in state if ".experts.0." in name]
    assert experts  # the published layout: one tensor per expert
    for name in [name for name in state if name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")]:
        state[name], state[name + "_scale_inv"] = quantize_blockwise(state[name])
    src = tmp_path / "src"
    src.mkdir()
    save_file(state, src / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((tmp_path / "plain" / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**raw, "quantization_config": QUANTIZATION}))
    report = convert_checkpoint(src, tmp_path / "out", hc_mult=4, progress=False)
    assert report.verification is not None and report.verification.passed, report.verification.summary()
    out_entries = raw_entries(tmp_path / "out")
    assert {name: entry for name, entry in out_entries.items() if not is_hc_parameter(name)} == raw_entries(src)
    assert out_entries[experts[0]][0] == "F8_E4M3"
    ids = token_ids()
    source_logits = logits_of(src, ids)
    got = logits_of(tmp_path / "out", ids)
    assert (got - source_logits).abs().max().item() <= 1e-4 * max(1.0, source_logits.abs().max().item())


def test_verification_decodes_both_models_with_the_same_settings(fp8_source, tmp_path):
    """A source without generation_config.json (as the config-only copies of DeepSeek-V3 often are) derives its
    eos_token_id from config.json; ``min_new_tokens`` then masked that token for the source but not for the mHC
    model, and greedy decoding "differed" where the logits agreed to 1e-6 of their scale."""
    src, _, _ = fp8_source
    bare = tmp_path / "src"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((src / name).read_bytes())
    report = convert_checkpoint(bare, tmp_path / "out", progress=False)
    assert report.verification.passed and report.verification.greedy_agrees, report.verification.summary()


def test_a_sharded_fp8_conversion_loads_with_weight_and_scales_in_different_shards(fp8_source, tmp_path):
    """DeepSeek-V3 is 163 shards: transformers pairs each float8 weight with its scales across shard files, so small
    output shards that separate a pair still load and verify."""
    src, _, _ = fp8_source
    report = convert_checkpoint(src, tmp_path / "out", max_shard_size="6KB", progress=False)
    assert report.verification.passed, report.verification.summary()
    weight_map = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(
        weight_map[name] != weight_map[name.removesuffix("_scale_inv")]
        for name in weight_map
        if name.endswith("_scale_inv")
    )
    source_entries, out_entries = raw_entries(src), raw_entries(tmp_path / "out")
    assert {name: entry for name, entry in out_entries.items() if not is_hc_parameter(name)} == source_entries
