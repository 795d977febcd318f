"""``hf_mhc.cli`` (the ``hf-mhc`` command): local paths told from Hub repo ids, bad input in one line without a
traceback for every subcommand, the options the subcommands and the examples share defined once, and the installed
console script."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import save_source
from transformers import AutoModelForCausalLM

import hf_mhc.diagnostics.cli
from hf_mhc.cli import DEFAULT_HC_MULT, SHARED_OPTIONS, add_shared_option, build_parser, main
from hf_mhc.common import folder_error, looks_like_local_path, output_path_error


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

    monkeypatch.setattr(hf_mhc.diagnostics.cli, "run_inspect", disk_full)
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


def test_shared_options_have_one_definition_and_each_commands_default():
    """convert and plan take --hc-mult, --residual-map and --dtype as SHARED_OPTIONS defines them (type, metavar,
    choices), each with its own default; redefining anything else of them is refused."""
    defaults = {"convert": {"hc_mult": DEFAULT_HC_MULT, "residual_map": "sinkhorn", "dtype": None},
                "plan": {"hc_mult": None, "residual_map": None, "dtype": "bfloat16"}}
    for command, expected in defaults.items():
        subparsers = next(action for action in build_parser(command)._actions
                          if isinstance(action, argparse._SubParsersAction))
        actions = {action.option_strings[0]: action for action in subparsers.choices[command]._actions
                   if action.option_strings}
        for flag, definition in SHARED_OPTIONS.items():
            for key, value in definition.items():
                assert getattr(actions[flag], key) == value, (command, flag, key)
            assert actions[flag].default == expected[actions[flag].dest], (command, flag)
    assert DEFAULT_HC_MULT == 4
    with pytest.raises(ValueError, match="--hc-mult has one definition"):
        add_shared_option(argparse.ArgumentParser(), "--hc-mult", type=float)


HF_MHC_SCRIPT = Path(sys.executable).with_name("hf-mhc")


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
