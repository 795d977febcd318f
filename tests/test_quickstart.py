"""``examples/quickstart.py``: bad input is one line before any work, it never writes into its model or a folder
with other files, a config transformers rejects is one line, and the float32 rounding of large logits passes."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from conftest import EXAMPLES, REJECTED_CONFIGS, import_script, tiny_backbone_config
from transformers import LlamaConfig, LlamaForCausalLM

import hf_mhc


@pytest.fixture(scope="module")
def quickstart():
    return import_script(EXAMPLES / "quickstart.py")


@pytest.fixture(scope="module")
def byte_tokenizer():
    return import_script(EXAMPLES / "fsdp2_finetune.py").byte_tokenizer()


def quickstart_error(quickstart, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        quickstart.main(argv)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert ": error: " in lines[-1] and not any("Traceback" in line for line in lines)
    return lines[-1]


def test_quickstart_bad_input_gets_a_one_line_error(quickstart, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default --output-dir outputs/quickstart of an earlier `make demo` is elsewhere
    assert quickstart_error(quickstart, ["--model", "./missing"], capsys).endswith(
        "error: --model: no such folder: ./missing"
    )
    assert "--steps must be >= 1" in quickstart_error(quickstart, ["--steps", "0"], capsys)
    (tmp_path / "file.txt").write_text("x")
    assert "is a file" in quickstart_error(quickstart, ["--output-dir", str(tmp_path / "file.txt" / "out")], capsys)
    no_tokenizer = tmp_path / "llama"
    LlamaForCausalLM(tiny_backbone_config("llama")).save_pretrained(no_tokenizer)
    capsys.readouterr()
    message = quickstart_error(quickstart, ["--model", str(no_tokenizer)], capsys)
    assert f"cannot load --model {no_tokenizer}: " in message
    mhc_dir = tmp_path / "mhc"
    hf_mhc.upcycle(LlamaForCausalLM(tiny_backbone_config("llama"))).save_pretrained(mhc_dir)
    capsys.readouterr()
    assert "is a 'mhc' model; quickstart upcycles a residual" in quickstart_error(
        quickstart, ["--model", str(mhc_dir)], capsys
    )


def test_quickstart_never_writes_into_its_model_or_a_folder_with_other_files(quickstart, tmp_path, capsys):
    """Checked before any work: the source folder, a non-empty folder without --overwrite, and with --overwrite a
    folder holding anything but an earlier output (a stale adapter would be applied on reload; notes would be lost)."""
    model = tmp_path / "model"
    LlamaForCausalLM(tiny_backbone_config("llama")).save_pretrained(model)
    before = sorted(path.name for path in model.iterdir())
    for output_dir in (model, tmp_path):
        assert "is --model" in quickstart_error(quickstart, ["--model", str(model), "--output-dir", str(output_dir)],
                                               capsys)
    assert sorted(path.name for path in model.iterdir()) == before

    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "config.json").write_text("{}")
    (earlier / "model.safetensors").write_bytes(b"old")
    (earlier / "trainer").mkdir()
    assert "is not empty; choose a new folder or pass --overwrite" in quickstart_error(
        quickstart, ["--output-dir", str(earlier)], capsys)
    for stray in ("adapter_config.json", "NOTES.md"):
        (earlier / stray).write_text("{}")
        message = quickstart_error(quickstart, ["--output-dir", str(earlier), "--overwrite"], capsys)
        assert f"holds more than an earlier output ({stray})" in message
        (earlier / stray).unlink()
    args = argparse.Namespace(output_dir=str(earlier), model=None, overwrite=True)
    assert quickstart.check_output_dir(argparse.ArgumentParser(), args) == earlier.resolve()
    quickstart.clear_earlier_run(earlier)
    assert sorted(path.name for path in earlier.iterdir()) == ["trainer"]


@pytest.mark.parametrize(
    ("config", "message"),
    REJECTED_CONFIGS,
)
def test_quickstart_refuses_a_config_transformers_rejects_in_one_line(quickstart, config, message, byte_tokenizer,
                                                                      tmp_path, capsys):
    model = tmp_path / "model"
    LlamaForCausalLM(tiny_backbone_config("llama", vocab_size=len(byte_tokenizer))).save_pretrained(model)
    byte_tokenizer.save_pretrained(model)
    config_file = model / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **config}))
    with pytest.raises(SystemExit) as exit_info:
        quickstart.main(["--model", str(model), "--output-dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    last = error.strip().splitlines()[-1]
    assert f": error: cannot load --model {model}: " in last and message in last


def test_quickstart_allows_the_float32_rounding_of_large_logits(quickstart, byte_tokenizer, tmp_path, capsys,
                                                                  monkeypatch):
    """A Llama whose logits reach about 2,000: the upcycled model's float32 rounding (a few 1e-7 of them) is far
    above an absolute 1e-4 and far below the converter's scale-aware tolerance."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(byte_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=byte_tokenizer.eos_token_id, bos_token_id=None, pad_token_id=None)
    source = LlamaForCausalLM(config)
    with torch.no_grad():
        source.lm_head.weight.mul_(3000.0)
    source.save_pretrained(tmp_path / "model")
    byte_tokenizer.save_pretrained(tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    quickstart.main(["--model", str(tmp_path / "model"), "--steps", "1", "--output-dir", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if "max |logit difference| vs source" in line)
    difference = float(line.split("vs source = ")[1].split()[0])
    tolerance = float(line.split("(tolerance ")[1].split(")")[0])
    assert 1e-4 < difference < tolerance / 10, line
    assert (tmp_path / "out" / "model.safetensors").is_file()
