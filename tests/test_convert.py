"""``hf_mhc.conversion.convert`` (``hf-mhc convert``): every family converts exactly (sharded or not, tied or not, in
each dtype) to the folder ``save_pretrained`` writes, the source's auxiliary files are copied, a source that is no
causal LM of a supported family is refused in one line; and fine-grained FP8 checkpoints, the format DeepSeek-V3 is
published in, keep their quantized bytes.

An FP8 checkpoint stores each Linear weight ``W [out, in]`` as float8_e4m3fn ``Q`` with a float32
``weight_scale_inv S [out / b0, in / b1]`` beside it, ``W ≈ Q · S`` block by block, and its config.json has
``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size":
[b0, b1]}``. Without a GPU transformers dequantizes it on load (``W = Q · S`` in the model's dtype). The FP8 tests
build such a checkpoint from a tiny random DeepSeek-V3 (MLA attention; every layer dense; a separate test has routed
experts, published one tensor per expert), check that transformers reads it as the dequantized model, then convert it.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from conftest import (
    FAMILIES,
    STORIES260K,
    VOCAB,
    assert_logits_close,
    assert_one_line_error,
    convert,
    leftovers,
    save_source,
    tiny_backbone_config,
    token_ids,
)
from huggingface_hub import ModelCard
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaForSequenceClassification

import hf_mhc
import hf_mhc.conversion.convert as convert_module
import hf_mhc.conversion.source as source_module
from hf_mhc import MHCForCausalLM
from hf_mhc.cli import main
from hf_mhc.conversion import ConversionError, convert_checkpoint, is_hc_parameter

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def small_chunks(monkeypatch):
    """Read source tensors in 256-byte blocks and re-map source files every 4 KB, as large checkpoints do."""
    monkeypatch.setattr(convert_module, "CHUNK_BYTES", 256)
    monkeypatch.setattr(source_module, "REMAP_BYTES", 4096)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_cli_converts_each_family_exactly(tmp_path, capsys, small_chunks, family, tied):
    source = save_source(tmp_path / "src", family, tied=tied, max_shard_size="20KB")
    assert (tmp_path / "src" / "model.safetensors.index.json").is_file()
    out = tmp_path / "out"
    shard_args = ["--max-shard-size", "30KB"] if not tied else []  # sharded output, or one file when it fits
    # Verification (slow: 2 x 35 forward passes) is exercised below; here the test compares the models itself.
    status, stdout, err = convert(capsys, tmp_path / "src", out, "--hc-mult", "3", "--no-verify", *shard_args)
    assert status == 0, err
    assert "Verification: skipped (--no-verify)" in stdout

    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(converted, MHCForCausalLM) and converted.config.hc_mult == 3
    assert (converted.lm_head.weight is converted.model.embed_tokens.weight) == tied
    ids = torch.randint(0, VOCAB, (2, 16))
    with torch.no_grad():
        assert_logits_close(converted(ids).logits, source(ids).logits)
    # Exactly the tensors that upcycling the same folder (given as a path) produces.
    upcycled = hf_mhc.upcycle(tmp_path / "src", hc_mult=3).state_dict()
    assert set(converted.state_dict()) == set(upcycled)
    for name, tensor in converted.state_dict().items():
        assert torch.equal(tensor, upcycled[name]), name

    index_file = out / "model.safetensors.index.json"
    if tied:
        assert (out / "model.safetensors").is_file() and not index_file.exists()
        assert "lm_head.weight" not in load_file(out / "model.safetensors")  # re-tied on load, as save_pretrained
    else:
        index = json.loads(index_file.read_text())
        shards = sorted(set(index["weight_map"].values()))
        assert len(shards) > 1 and not (out / "model.safetensors").exists()
        total = 0
        for shard in shards:
            tensors = load_file(out / shard)
            assert {name for name, file in index["weight_map"].items() if file == shard} == set(tensors)
            shard_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            assert shard_bytes <= 30_000 or len(tensors) == 1
            total += shard_bytes
        assert index["metadata"]["total_size"] == total
        assert set(index["weight_map"]) == set(converted.state_dict())
    assert not leftovers(tmp_path)


@pytest.mark.parametrize(("dtype", "stored"), [("bfloat16", "BF16"), ("float16", "F16")])
def test_python_api_output_equals_save_pretrained_and_half_precision_keeps_hc_in_float32(tmp_path, dtype, stored):
    save_source(tmp_path / "src", "qwen3", tied=True)
    out = tmp_path / "out"
    report = convert_checkpoint(str(tmp_path / "src"), out, dtype=dtype, hc_eps=1e-5, progress=False)
    assert report.family == "qwen3" and report.hc_mult == 4 and report.weight_files == ("model.safetensors",)
    verification = report.verification
    # Against the source rounded to the same dtype (it is stored in float32), both computed in float32.
    assert verification.passed and verification.greedy_agrees, verification.summary()
    assert verification.dtype == dtype and verification.compute_dtype == "float32"
    assert verification.rounded_tensors == len(load_file(tmp_path / "src" / "model.safetensors"))
    assert verification.tolerance == pytest.approx(1e-4 * max(1.0, verification.logit_scale))

    with safe_open(out / "model.safetensors", framework="pt") as handle:
        dtypes = {name: handle.get_slice(name).get_dtype() for name in handle.keys()}
    assert {dtype for name, dtype in dtypes.items() if is_hc_parameter(name)} == {"F32"}
    assert {dtype for name, dtype in dtypes.items() if not is_hc_parameter(name)} == {stored}
    converted = AutoModelForCausalLM.from_pretrained(out)
    assert converted.model.embed_tokens.weight.dtype == getattr(torch, dtype)
    assert converted.model.layers[0].attn_hc.fn.dtype == torch.float32

    # config.json and the remote-code files are what MHCForCausalLM.save_pretrained writes for the same model.
    source = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=getattr(torch, dtype))
    reference = tmp_path / "reference"
    hf_mhc.upcycle(source, hc_mult=4, hc_eps=1e-5).save_pretrained(reference)
    assert json.loads((out / "config.json").read_text()) == json.loads((reference / "config.json").read_text())
    for code_file in ("modeling_mhc.py", "configuration_mhc.py", "mhc_reference.py"):
        assert (out / code_file).read_bytes() == (reference / code_file).read_bytes()
    assert (out / "generation_config.json").read_text() == (tmp_path / "src" / "generation_config.json").read_text()
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "src" and card.data.library_name == "transformers" and "mhc" in card.data.tags
    assert "hc_mult = 4" in card.text and "hc_init = `function_preserving`" in card.text
    assert f"Verification:** passed: {dtype}" in card.text and str(tmp_path) not in card.content


def test_the_model_card_says_how_it_was_made_and_a_card_hf_mhc_did_not_write_survives_overwrite(tmp_path, capsys):
    """The card reads back with huggingface_hub: the source folder's name as ``base_model``, the verification's
    largest logit difference and its threshold, or "not verified"; ``--overwrite`` updates hf-mhc's own card, and
    keeps one that someone edited, byte for byte, with a warning line."""
    save_source(tmp_path / "tiny-llama", "llama")
    out = tmp_path / "out"
    status, _, err = convert(capsys, tmp_path / "tiny-llama", out, "--hc-mult", "3")
    assert status == 0, err
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "tiny-llama" and card.data.library_name == "transformers"
    assert {"mhc", "hf-mhc"} <= set(card.data.tags)
    assert "**hc_mult = 3**" in card.text and "residual map `sinkhorn`" in card.text
    assert re.search(r"\*\*Verification:\*\* passed: .*max \|logit difference\| \S+ \(threshold \S+", card.text)
    assert 'from_pretrained("out", trust_remote_code=True)' in card.text

    status, _, err = convert(capsys, tmp_path / "tiny-llama", out, "--overwrite", "--no-verify",
                             "--residual-map", "identity")
    assert status == 0 and "README.md" not in err, err
    card = ModelCard.load(out / "README.md")
    assert "residual map `identity`" in card.text and "**Verification:** not verified" in card.text

    edited = (out / "README.md").read_text() + "\nMy notes on this model.\n"
    (out / "README.md").write_text(edited)
    status, _, err = convert(capsys, tmp_path / "tiny-llama", out, "--overwrite", "--no-verify")
    assert status == 0, err
    assert (out / "README.md").read_text() == edited
    assert f"hf-mhc convert: warning: {out / 'README.md'} was not written by hf-mhc" in err
    assert not leftovers(tmp_path)


@pytest.mark.skipif(not STORIES260K.is_dir(), reason="../shared/assets/stories260K is not present")
def test_real_pretrained_llama_converts_exactly(tmp_path, capsys):
    out = tmp_path / "stories-mhc"
    status, stdout, err = convert(capsys, STORIES260K, out, "--max-shard-size", "500KB")
    assert status == 0, err
    # The built-in verification greedily decodes 32 tokens from 3 tokenized prompts with both models.
    assert "3 prompts (tokenizer)" in stdout and "greedy decoding of 32 tokens agrees" in stdout
    assert "Copied from SRC: generation_config.json, tokenizer.json, tokenizer_config.json" in stdout
    for copied in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / copied).read_bytes() == (STORIES260K / copied).read_bytes()
    source = AutoModelForCausalLM.from_pretrained(STORIES260K).eval()
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(3, source.config.vocab_size, (2, 48))
    with torch.no_grad():
        assert_logits_close(converted(ids).logits, source(ids).logits)
    assert "Verification:** passed: float32" in (out / "README.md").read_text()


@pytest.mark.skipif(not STORIES260K.is_dir(), reason="../shared/assets/stories260K is not present")
def test_real_pretrained_llama_converted_to_bfloat16_verifies(tmp_path, capsys):
    """stories260K is stored in float32: its 47 tensors, rounded to bfloat16 as converted, are what the mHC model is
    compared with, both computed in float32, so greedy decoding agrees too (computed in bfloat16, the source's own
    greedy decoding differs from its float32 one)."""
    status, stdout, err = convert(capsys, STORIES260K, tmp_path / "out", "--dtype", "bfloat16")
    assert status == 0, err
    assert ("Verification: bfloat16 weights against the source with 47 tensors rounded to bfloat16 as converted, "
            "both computed in float32, 3 prompts (tokenizer)") in stdout
    assert "greedy decoding of 32 tokens agrees" in stdout
    assert "Verification:** passed: bfloat16" in (tmp_path / "out" / "README.md").read_text()


def test_src_that_is_not_a_causal_lm_checkpoint(tmp_path, capsys):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("not a checkpoint")
    status, _, err = convert(capsys, tmp_path / "notes", tmp_path / "out")
    assert_one_line_error(status, err, "no config.json")

    LlamaForSequenceClassification(tiny_backbone_config("llama")).save_pretrained(tmp_path / "classifier")
    status, _, err = convert(capsys, tmp_path / "classifier", tmp_path / "out")
    assert_one_line_error(status, err, "LlamaForSequenceClassification", "not a causal language model")

    # Config and weights that do not belong together (a base model's names without the "model." prefix).
    save_source(tmp_path / "base", "llama")
    weights = load_file(tmp_path / "base" / "model.safetensors")
    save_file({name.removeprefix("model."): t for name, t in weights.items()}, tmp_path / "base" / "model.safetensors")
    status, _, err = convert(capsys, tmp_path / "base", tmp_path / "out")
    assert_one_line_error(status, err, "do not match a llama causal LM", "missing ['model.embed_tokens.weight'")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_unsupported_architecture_names_the_supported_ones(tmp_path, capsys):
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "gpt2")
    status, _, err = convert(capsys, tmp_path / "gpt2", tmp_path / "out")
    assert_one_line_error(status, err, "'gpt2'", "llama, mistral, qwen2, qwen3")
    assert not (tmp_path / "out").exists()


def test_a_misspelt_mhc_option_of_the_python_api_names_the_function_and_writes_nothing(tmp_path):
    save_source(tmp_path / "src")
    with pytest.raises(ConversionError, match=r"^convert_checkpoint got an unknown mHC option 'hc_sinkhron_iters' "
                                              r"\(did you mean 'hc_sinkhorn_iters'\?\)"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", hc_sinkhron_iters=3)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["src"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-shard-size", "lots"], "invalid size 'lots'"),
        (["--hc-mult", "0"], "hc_mult must be an integer from 1 to 8"),
    ],
)
def test_bad_options(tmp_path, capsys, args, message):
    save_source(tmp_path / "src", "llama")
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", *args)
    assert_one_line_error(status, err, message)
    assert not (tmp_path / "out").exists()


def test_converted_checkpoint_goes_through_hf_mhc_inspect(tmp_path, capsys):
    save_source(tmp_path / "src", "qwen2")
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--no-verify")
    assert status == 0, err
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "out")]) == 0
    assert "layer" in capsys.readouterr().out.lower()


def test_a_config_transformers_cannot_build_is_one_line(tmp_path, capsys):
    save_source(tmp_path / "src", "llama")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["num_attention_heads"] = 0
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out")
    assert_one_line_error(status, err, "config.json")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_links_inside_src_are_copied_as_files(tmp_path, capsys):
    src = tmp_path / "src"
    save_source(src, "llama", tied=True)
    (src / "originals").mkdir()
    (src / "originals" / "LICENSE.txt").write_text("Apache-2.0")
    (src / "LICENSE").symlink_to("originals/LICENSE.txt")
    (src / "originals" / "tool_use.jinja").write_text("{{ tools }}")
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").symlink_to(Path("..", "originals", "tool_use.jinja"))
    (src / "additional_chat_templates" / "same").symlink_to(Path("..", "originals"))
    (src / "additional_chat_templates" / "again").symlink_to(Path("..", "originals"))  # twice, but no loop
    status, _, err = convert(capsys, src, tmp_path / "out", "--no-verify")
    assert status == 0, err
    out = tmp_path / "out"
    for copied, text in [("LICENSE", "Apache-2.0"), ("additional_chat_templates/tool_use.jinja", "{{ tools }}"),
                         ("additional_chat_templates/again/LICENSE.txt", "Apache-2.0")]:  # fmt: skip
        assert not (out / copied).is_symlink() and (out / copied).read_text() == text
    assert not any(path.is_symlink() for path in out.rglob("*"))

    (src / "additional_chat_templates" / "loop").symlink_to(Path(".."))  # links to a folder above it
    status, _, err = convert(capsys, src, tmp_path / "out2", "--no-verify")
    assert_one_line_error(status, err, "links back to a folder above it")
    assert not (tmp_path / "out2").exists() and not leftovers(tmp_path)


# ---------------------------------------------------------------- fine-grained FP8 checkpoints


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
    ids = token_ids(2, 12, seed=1)
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
    status, _, err = convert(capsys, src, out, "--dtype", "bfloat16", "--no-verify")
    assert status == 0
    warnings = [line for line in err.splitlines() if line.startswith("hf-mhc convert: warning: --dtype bfloat16")]
    assert len(warnings) == 1 and "16 float8 weights and their weight_scale_inv stay as stored" in warnings[0], err
    source_entries, out_entries = raw_entries(src), raw_entries(out)
    for name, (dtype, shape, data) in source_entries.items():
        if dtype == "F8_E4M3" or name.endswith("_scale_inv"):
            assert out_entries[name] == (dtype, shape, data), name
        else:
            assert out_entries[name][0] == "BF16", name
    ids = token_ids(2, 12, seed=1)
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
    status, _, err = convert(capsys, tmp_path / "bad", tmp_path / "out", "--no-verify")
    assert_one_line_error(status, err, *fragments)
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
    ids = token_ids(2, 12, seed=1)
    source_logits = logits_of(src, ids)
    got = logits_of(tmp_path / "out", ids)
    assert (got - source_logits).abs().max().item() <= 1e-4 * max(1.0, source_logits.abs().max().item())


def test_verification_decodes_both_models_with_the_same_settings(fp8_source, tmp_path):
    """A source without generation_config.json (as the config-only copies of DeepSeek-V3 often are) derives its
    eos_token_id from config.json: both models decode with the same settings (``min_new_tokens`` masking that token
    for one model only would make greedy decoding differ where the logits agree to 1e-6 of their scale)."""
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


# --- residual maps ------------------------------------------------------------------------------------------------


def test_convert_with_a_residual_map_writes_it_and_verifies(tmp_path, capsys):
    """``hf-mhc convert --residual-map identity``: config.json keeps the map, the folder loads, verification passes
    (the map's function-preserving start reproduces the source), and the model card names the map."""

    source = save_source(tmp_path / "src", "qwen2")
    status, stdout, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--hc-mult", "3", "--residual-map",
                                  "identity")
    assert status == 0, err
    converted = MHCForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert converted.config.hc_residual_map == "identity"
    assert converted.model.layers[0].attn_hc.fn.shape == (6, 3 * 32)
    assert "residual map `identity`" in (tmp_path / "out" / "README.md").read_text()
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        assert_logits_close(converted(ids).logits, source(ids).logits)


def test_convert_refuses_permutations_of_five_streams_in_one_line(tmp_path, capsys):

    save_source(tmp_path / "src", "llama")
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--hc-mult", "5", "--residual-map",
                             "permutations")
    assert_one_line_error(status, err, "hc_residual_map='permutations' supports hc_mult <= 4")
    assert not (tmp_path / "out").exists()


