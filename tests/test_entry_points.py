"""One error style across the entry points: a missing local path reads "no such folder", bad input one line, no
traceback (``hf-mhc``, ``examples/quickstart.py``; ``examples/finetune.py`` in test_finetune_example.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from conftest import import_script, tiny_backbone_config
from transformers import LlamaForCausalLM

import hf_mhc
import hf_mhc.diagnostics_cli
from hf_mhc.cli import folder_error, looks_like_local_path, main, output_path_error

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


def test_local_paths_are_told_from_hub_repo_ids(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    (tmp_path / "notes.txt").write_text("x")
    for repo_id in ("gpt2", "Qwen/Qwen3-0.6B", "meta-llama/Llama-3.2-1B"):
        assert not looks_like_local_path(repo_id) and folder_error(repo_id) is None, repo_id
    for path in ("./model", "../model", "/no/such/model", "~/model", "a/b/c", "outputs/mergd", "outputs", ""):
        assert looks_like_local_path(path), path
    assert folder_error("outputs") is None
    assert folder_error("outputs/mergd") == "no such folder: outputs/mergd"  # exists partly
    assert folder_error("./model") == "no such folder: ./model"
    assert folder_error("notes.txt") == "not a folder: notes.txt"
    assert output_path_error("outputs/new/deeper", folder=True) is None  # created later; nothing made now
    assert not (tmp_path / "outputs" / "new").exists()
    assert output_path_error("notes.txt/out", folder=True) == "cannot create notes.txt/out: " + str(
        tmp_path / "notes.txt"
    ) + " is a file"
    assert output_path_error("notes.txt", folder=False) is None  # a file to replace


def test_hf_mhc_says_no_such_folder_and_turns_bad_input_into_one_line(capsys, monkeypatch):
    assert main(["inspect", "./no/such/checkpoint"]) == 1
    assert capsys.readouterr().err == "hf-mhc inspect: error: no such folder: ./no/such/checkpoint\n"

    def disk_full(args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(hf_mhc.diagnostics_cli, "run_inspect", disk_full)
    assert main(["inspect", "anything"]) == 1
    assert capsys.readouterr().err == "hf-mhc inspect: error: [Errno 28] No space left on device\n"
    with pytest.raises(SystemExit) as exit_info:  # what argparse itself rejects keeps its status 2
        main(["inspect"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(("backbone", "reason"), [
    ({"hidden_size": 100, "num_attention_heads": 3},
     "The hidden size (100) is not a multiple of the number of attention heads (3)."),
    ({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3},
     "num_attention_heads (4) is not a multiple of num_key_value_heads (3): each key/value head serves the same "
     "number of query heads."),
])
def test_every_subcommand_refuses_a_config_transformers_cannot_use_in_one_line(backbone, reason, tmp_path, capsys):
    """What transformers' config validation rejects, and what its attention then fails on: convert, plan and inspect
    load the config the same way and say so in one line (status 1); inspect reads the backbone of an mHC config."""
    backbone = {"model_type": "llama", "num_hidden_layers": 2, "intermediate_size": 32, "vocab_size": 50, **backbone}
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(backbone))
    (tmp_path / "mhc").mkdir()
    (tmp_path / "mhc" / "config.json").write_text(json.dumps({"model_type": "mhc", "backbone_config": backbone}))
    for argv, model_type, prefix in (
        (["convert", str(tmp_path / "llama"), str(tmp_path / "out")], "llama", ""),
        (["plan", str(tmp_path / "llama")], "llama", ""),
        (["inspect", str(tmp_path / "mhc")], "mhc", f"cannot load {tmp_path / 'mhc'}: "),
    ):
        folder = tmp_path / model_type
        assert main(argv) == 1, argv
        assert capsys.readouterr().err == (f"hf-mhc {argv[0]}: error: {prefix}{folder / 'config.json'} cannot be "
                                           f"loaded as a {model_type} config ({reason}).\n")
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def quickstart():
    return import_script(QUICKSTART)


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
    quickstart.clear_earlier_output(earlier)
    assert sorted(path.name for path in earlier.iterdir()) == ["trainer"]

