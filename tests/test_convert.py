"""`hf-mhc convert`: streaming checkpoint conversion that is exact, verified, and safe on bad input."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from conftest import (
    FAMILIES,
    STORIES260K,
    VOCAB,
    assert_one_line_error,
    convert,
    leftovers,
    save_source,
    tiny_backbone_config,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaForSequenceClassification

import hf_mhc
import hf_mhc.conversion.convert as convert_module
import hf_mhc.conversion.source as source_module
from hf_mhc import MHCForCausalLM
from hf_mhc.cli import main
from hf_mhc.conversion import ConversionError, convert_checkpoint, is_hc_parameter
from hf_mhc.conversion.safetensors_stream import SafetensorsStreamWriter, TensorSpec, aligned_order, parse_size

HF_MHC_SCRIPT = Path(sys.executable).with_name("hf-mhc")


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
        torch.testing.assert_close(converted(ids).logits, source(ids).logits, atol=1e-4, rtol=0)
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
    card = (out / "README.md").read_text()
    assert str(tmp_path / "src") in card and "hc_mult = 4" in card and "function-preserving" in card
    assert f"Verification:** passed: {dtype}" in card


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
        torch.testing.assert_close(converted(ids).logits, source(ids).logits, atol=1e-4, rtol=0)
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


@pytest.mark.skipif(not HF_MHC_SCRIPT.is_file(), reason="the hf-mhc console script is not installed")
def test_console_script(tmp_path):
    save_source(tmp_path / "src", "mistral", max_shard_size="20KB")
    result = subprocess.run(
        [str(HF_MHC_SCRIPT), "convert", str(tmp_path / "src"), str(tmp_path / "out"), "--hc-mult", "2", "--no-verify"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Converted" in result.stdout and "Verification: skipped" in result.stdout
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.hc_mult == 2


def test_hub_id_resolves_from_the_cache_offline(tmp_path, capsys, monkeypatch):
    cache, commit = tmp_path / "hub", "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--tiny-org--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    source = save_source(repo / "snapshots" / commit, "llama", tied=True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    assert huggingface_hub.constants.HF_HUB_OFFLINE  # conftest: tests never download

    status, _, err = convert(capsys, "tiny-org/tiny-llama", tmp_path / "out", "--no-verify")
    assert status == 0, err
    assert "base_model: tiny-org/tiny-llama" in (tmp_path / "out" / "README.md").read_text()
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, source(ids).logits, atol=1e-4, rtol=0)

    status, _, err = convert(capsys, "tiny-org/not-in-the-cache", tmp_path / "out2")
    assert_one_line_error(status, err, "'tiny-org/not-in-the-cache'", "Hugging Face Hub")
    assert not (tmp_path / "out2").exists()


def test_missing_src(tmp_path, capsys):
    status, _, err = convert(capsys, tmp_path / "absent", tmp_path / "out")
    assert_one_line_error(status, err, f"no such folder: {tmp_path / 'absent'}")
    assert not (tmp_path / "out").exists()


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


def test_existing_out_is_kept_without_overwrite_and_replaced_with_it(tmp_path, capsys):
    save_source(tmp_path / "src", "qwen2")
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    status, _, err = convert(capsys, tmp_path / "src", out, "--no-verify")
    assert_one_line_error(status, err, "not empty", "--overwrite")
    assert [p.name for p in out.iterdir()] == ["precious.txt"] and (out / "precious.txt").read_text() == "keep me"

    status, _, err = convert(capsys, tmp_path / "src", out, "--no-verify", "--overwrite")
    assert_one_line_error(status, err, "does not look like a checkpoint")  # --overwrite replaces only a checkpoint
    assert [p.name for p in out.iterdir()] == ["precious.txt"]

    save_source(out, "llama")  # now OUT holds a checkpoint, and precious.txt beside it: still kept
    status, _, err = convert(capsys, tmp_path / "src", out, "--no-verify", "--overwrite")
    assert_one_line_error(status, err, "holds more than a checkpoint (precious.txt)")
    assert (out / "precious.txt").read_text() == "keep me"

    (out / "precious.txt").unlink()  # a checkpoint alone is replaced
    status, _, err = convert(capsys, tmp_path / "src", out, "--no-verify", "--overwrite")
    assert status == 0, err
    assert (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["backbone_config"]["model_type"] == "qwen2"
    assert not leftovers(tmp_path)

    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "src", "--overwrite")
    assert_one_line_error(status, err, "is SRC or contains it")
    assert (tmp_path / "src" / "model.safetensors").is_file()


@pytest.mark.parametrize("damage", ["truncated", "corrupted header", "missing shard"])
def test_damaged_safetensors(tmp_path, capsys, damage):
    save_source(tmp_path / "src", "llama", max_shard_size="20KB")
    shard = tmp_path / "src" / "model-00002-of-00005.safetensors"
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "corrupted header":
        shard.write_bytes(data[:8] + b"\x00garbage" + data[16:])
    else:
        shard.unlink()
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out")
    expected = "missing" if damage == "missing shard" else "truncated or corrupted"
    assert_one_line_error(status, err, shard.name, expected)
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


class _Payload:
    def __reduce__(self):
        return (Path.touch, (Path(os.environ["HF_MHC_TEST_MARKER"]),))


def test_pickled_weights_need_allow_pickle_and_load_weights_only(tmp_path, capsys, monkeypatch):
    source = save_source(tmp_path / "src", "llama", tied=True)
    (tmp_path / "src" / "model.safetensors").unlink()
    torch.save(source.state_dict(), tmp_path / "src" / "pytorch_model.bin")
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *args, **kwargs: loads.append(kwargs) or real_load(*args, **kwargs))

    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--no-verify")
    assert_one_line_error(status, err, "pytorch_model.bin", "--allow-pickle")
    assert loads == [] and not (tmp_path / "out").exists()

    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--no-verify", "--allow-pickle")
    assert status == 0, err
    assert loads and all(kwargs.get("weights_only") is True for kwargs in loads)
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, source(ids).logits, atol=1e-4, rtol=0)

    # A pickle that would run code when unpickled is refused, and its code never runs.
    marker = tmp_path / "code-ran"
    monkeypatch.setenv("HF_MHC_TEST_MARKER", str(marker))
    torch.save({"model.embed_tokens.weight": _Payload()}, tmp_path / "src" / "pytorch_model.bin")
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out2", "--allow-pickle")
    assert_one_line_error(status, err, "weights_only=True")
    assert not marker.exists() and not (tmp_path / "out2").exists()


def test_interruption_leaves_no_output_and_no_staging(tmp_path, capsys, monkeypatch):
    save_source(tmp_path / "src", "llama", max_shard_size="20KB")
    written = []
    real_write = SafetensorsStreamWriter.write_tensor

    def write_then_interrupt(self, name, chunks, on_bytes=None):
        if len(written) == 5:
            raise KeyboardInterrupt
        written.append(name)
        return real_write(self, name, chunks, on_bytes)

    monkeypatch.setattr(SafetensorsStreamWriter, "write_tensor", write_then_interrupt)
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "new" / "out", "--max-shard-size", "10KB")
    assert status == 130 and "interrupted" in err
    assert len(written) == 5 and not (tmp_path / "new").exists()  # not even the parent it created

    out = tmp_path / "out"
    save_source(out, "qwen2")
    old = {path.name: path.read_bytes() for path in out.iterdir()}
    written.clear()
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(tmp_path / "src", out, overwrite=True, progress=False)
    assert {path.name: path.read_bytes() for path in out.iterdir()} == old and not leftovers(tmp_path)


def test_stale_staging_of_a_dead_process_is_removed(tmp_path, capsys):
    save_source(tmp_path / "src", "llama")
    host = socket.gethostname()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".out.hf-mhc-partial.{int(dead.stdout)}@{host}.abc123"
    running = tmp_path / f".out.hf-mhc-partial.{os.getpid()}@{host}.def456"
    stale.mkdir()
    running.mkdir()
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--no-verify")
    assert status == 0, err
    assert not stale.exists() and running.is_dir()


def test_failed_verification_writes_nothing(tmp_path, capsys, monkeypatch):
    save_source(tmp_path / "src", "llama")
    real_tensors = convert_module.function_preserving_hc_tensors

    def wrong_init(config):  # a conversion bug: layer 0's attention output weighted too much against the residual
        tensors = real_tensors(config)
        n = config.hc_mult
        tensors["model.layers.0.attn_hc.base"][n : 2 * n] += 1.0
        return tensors

    monkeypatch.setattr(convert_module, "function_preserving_hc_tensors", wrong_init)
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out")
    assert_one_line_error(status, err, "does not reproduce the source", "greedy decoding of 32 tokens", "bug")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


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


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 * 2**30 and parse_size("1.5 kb") == 1500 and parse_size("4096") == 4096
    assert parse_size(123) == 123
    for bad in ("", "5XB", "-1MB", "0"):
        with pytest.raises(ConversionError):
            parse_size(bad)


def test_stream_writer_aligns_mixed_dtypes(tmp_path):
    tensors = {
        "odd_bytes": torch.arange(3, dtype=torch.int8),
        "halves": torch.randn(3, 5).to(torch.bfloat16),
        "floats": torch.randn(7),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    specs = aligned_order(TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in tensors.items())
    with SafetensorsStreamWriter(tmp_path / "mixed.safetensors", specs, metadata={"format": "pt"}) as writer:
        for spec in specs:
            tensor = tensors[spec.name]
            writer.write_tensor(spec.name, tensor.split(2) if tensor.dim() else [tensor])
    loaded = load_file(tmp_path / "mixed.safetensors")
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    with pytest.raises(RuntimeError, match="wrote 8 bytes, declared 12"):
        with SafetensorsStreamWriter(tmp_path / "short.safetensors", [TensorSpec("x", torch.float32, (3,))]) as w:
            w.write_tensor("x", [torch.zeros(2)])


def test_converted_checkpoint_goes_through_hf_mhc_inspect(tmp_path, capsys):
    save_source(tmp_path / "src", "qwen2")
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--no-verify")
    assert status == 0, err
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "out")]) == 0
    assert "layer" in capsys.readouterr().out.lower()
