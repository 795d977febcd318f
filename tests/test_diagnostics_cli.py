"""``hf_mhc.diagnostics.cli``: ``hf-mhc inspect`` prints the table, writes strict JSON and the plots, refuses bad
input in one line before it loads anything, and plugs into a subcommand parser."""

from __future__ import annotations

import argparse
import json
import logging
import sys

import pytest
import torch
from conftest import STORIES260K, randomize_hc, tiny_backbone_config
from diagnostics_helpers import three_layer_mhc_model
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import hf_mhc
from hf_mhc.diagnostics import cli as diagnostics_cli
from hf_mhc.diagnostics.cli import add_inspect_arguments, inspect_main, run_inspect


def test_inspect_cli_prints_the_table_for_a_checkpoint_without_tokenizer(tmp_path, capsys):
    randomize_hc(three_layer_mhc_model(hc_mult=3)).save_pretrained(tmp_path / "mhc")
    assert inspect_main([str(tmp_path / "mhc"), "--json", str(tmp_path / "report.json")]) == 0
    printed = capsys.readouterr().out
    assert "random token ids" in printed and "layer 2 ffn" in printed and "composite over depth" in printed
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["hc_mult"] == 3 and len(report["sites"]) == 6 and report["num_tokens"] == 64
    assert report["non_finite_parameters"] == [] and report["non_finite_values"] == {}


def refuse_constant(name):
    raise ValueError(f"{name} is not JSON")


def test_inspect_writes_strict_json_and_fails_on_non_finite_parameters(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    model = three_layer_mhc_model(hc_mult=2)
    with torch.no_grad():
        model.model.layers[0].attn_hc.fn.fill_(float("nan"))
    model.save_pretrained(tmp_path / "mhc")
    capsys.readouterr()
    json_path, plots = tmp_path / "report.json", tmp_path / "plots"
    assert inspect_main([str(tmp_path / "mhc"), "--json", str(json_path), "--plot", str(plots)]) == 1
    captured = capsys.readouterr()  # stderr: the loading progress bar, then the error
    assert captured.err.splitlines()[-1] == (
        "hf-mhc inspect: error: non-finite parameters: model.layers.0.attn_hc.fn; the report's non-finite values are "
        "null in --json (its non_finite_values lists them); no plots written") and "Traceback" not in captured.err
    assert f"report written to {json_path}" in captured.out and not plots.exists()
    report = json.loads(json_path.read_text(), parse_constant=refuse_constant)
    assert report["non_finite_parameters"] == ["model.layers.0.attn_hc.fn"]
    assert report["sites"][0]["forward_gain_max"] is None
    assert report["non_finite_values"]["sites[0].forward_gain_max"] == "nan"
    assert report["non_finite_values"]["summary.composite_forward_gain"] == "nan"
    assert all(value in ("nan", "inf", "-inf") for value in report["non_finite_values"].values())
    assert inspect_main([str(tmp_path / "mhc")]) == 1  # without --json too
    assert capsys.readouterr().err.endswith("the report's non-finite values are nan / inf in the table\n")


def test_inspect_refuses_empty_text(tmp_path, capsys):
    three_layer_mhc_model(hc_mult=2).save_pretrained(tmp_path / "mhc")
    capsys.readouterr()
    for text in ("", "  \n"):
        assert inspect_main([str(tmp_path / "mhc"), "--text", text]) == 1
        assert capsys.readouterr().err == ("hf-mhc inspect: error: --text is empty; give text to run the model on, or "
                                           "leave --text out for the default passage\n")


def test_inspect_cli_names_the_variant_of_a_saved_checkpoint(tmp_path, capsys):
    randomize_hc(three_layer_mhc_model(hc_mult=2, hc_residual_map="unconstrained")).save_pretrained(tmp_path / "hc")
    assert inspect_main([str(tmp_path / "hc"), "--json", str(tmp_path / "report.json")]) == 0
    assert "mHC stability report (unconstrained residual maps): n = 2 streams" in capsys.readouterr().out
    assert json.loads((tmp_path / "report.json").read_text())["hc_residual_map"] == "unconstrained"


def test_inspect_arguments_plug_into_a_subcommand_parser(tmp_path, capsys):
    three_layer_mhc_model(hc_mult=2).save_pretrained(tmp_path / "mhc")
    parser = argparse.ArgumentParser(prog="hf-mhc")
    subcommands = parser.add_subparsers(dest="command", required=True)
    add_inspect_arguments(subcommands.add_parser("inspect")).set_defaults(run=run_inspect)
    args = parser.parse_args(["inspect", str(tmp_path / "mhc"), "--device", "cpu"])
    assert args.run(args) == 0
    assert "n = 2 streams, 3 layers" in capsys.readouterr().out


def test_inspect_cli_errors_are_one_line(tmp_path, capsys, monkeypatch):
    assert inspect_main([str(tmp_path / "missing")]) == 1
    assert capsys.readouterr().err == f"hf-mhc inspect: error: no such folder: {tmp_path / 'missing'}\n"
    for local in ("./missing", "~/missing-hf-mhc-model", "outputs/finetune/mergd"):  # never a Hub repo-id error
        assert inspect_main([local]) == 1
        assert capsys.readouterr().err == f"hf-mhc inspect: error: no such folder: {local}\n"
    LlamaForCausalLM(tiny_backbone_config("llama")).save_pretrained(tmp_path / "llama")
    three_layer_mhc_model().save_pretrained(tmp_path / "mhc")
    capsys.readouterr()  # drop the save progress bars
    assert inspect_main([str(tmp_path / "llama")]) == 1
    message = capsys.readouterr().err
    assert message.startswith("hf-mhc inspect: error: ") and "not an mHC" in message and message.count("\n") == 1
    assert inspect_main([str(tmp_path / "mhc"), "--text", "hello"]) == 1
    assert "no tokenizer" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert inspect_main([str(tmp_path / "mhc"), "--plot", str(tmp_path / "plots")]) == 1
    assert "needs matplotlib" in capsys.readouterr().err


def test_inspect_cli_writes_an_overview_and_one_plot_per_layer(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    randomize_hc(three_layer_mhc_model(hc_mult=2)).save_pretrained(tmp_path / "mhc")
    assert inspect_main([str(tmp_path / "mhc"), "--plot", str(tmp_path / "plots")]) == 0
    assert "4 plots written" in capsys.readouterr().out
    names = sorted(path.name for path in (tmp_path / "plots").iterdir())
    assert names == ["layer_0.png", "layer_1.png", "layer_2.png", "overview.png"]
    assert all((tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in names)


@pytest.mark.skipif(not STORIES260K.is_dir(), reason="../shared/assets/stories260K is not present")
def test_inspect_cli_on_the_upcycled_real_llama_with_its_tokenizer(tmp_path, capsys):
    model = hf_mhc.upcycle(AutoModelForCausalLM.from_pretrained(STORIES260K), hc_mult=4)
    model.save_pretrained(tmp_path / "mhc")
    AutoTokenizer.from_pretrained(STORIES260K).save_pretrained(tmp_path / "mhc")
    text = "Once upon a time, there was a little girl named Lily."
    assert inspect_main([str(tmp_path / "mhc"), "--text", text, "--json", str(tmp_path / "report.json")]) == 0
    printed = capsys.readouterr().out
    assert "n = 4 streams, 5 layers" in printed
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["num_tokens"] == len(AutoTokenizer.from_pretrained(STORIES260K)(text)["input_ids"])
    # Upcycled: the residual mixing is the identity up to hc_eps at every site and over the depth.
    assert abs(report["summary"]["composite_backward_gain"] - 1) < 1e-4


def test_inspect_checks_the_plot_and_json_paths_before_it_loads_anything(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    three_layer_mhc_model(hc_mult=2).save_pretrained(tmp_path / "mhc")
    (tmp_path / "file.txt").write_text("mine")
    (tmp_path / "folder").mkdir()

    def no_loading(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the output paths were checked")

    monkeypatch.setattr(diagnostics_cli, "_load_for_inspection", no_loading)
    file, folder = tmp_path / "file.txt", tmp_path / "folder"
    cases = [
        (["--plot", str(file)], f"--plot {file}: {file} is a file, not a folder"),
        (["--plot", str(file / "p")], f"--plot {file / 'p'}: cannot create {file / 'p'}: {file} is a file"),
        (["--json", str(folder)], f"--json {folder}: {folder} is a folder, not a file"),
        (["--json", str(file / "a")], f"--json {file / 'a'}: cannot create {file / 'a'}: {file} is a file"),
        (["--json", ""], "--json : empty path"),
    ]
    capsys.readouterr()
    for options, expected in cases:
        assert inspect_main([str(tmp_path / "mhc"), *options]) == 1, options
        assert capsys.readouterr().err == f"hf-mhc inspect: error: {expected}\n"
    assert (tmp_path / "file.txt").read_text() == "mine"


def test_inspect_cuts_a_text_longer_than_the_context_to_its_first_tokens_with_one_warning(tmp_path, capfd, caplog,
                                                                                            monkeypatch):
    """As transformers truncates: the first max_position_embeddings tokens (16 here) of a 40-token --text, one
    warning line on stderr (not also transformers' own about the tokenizer's model_max_length, logged), the report
    that of those 16 tokens alone. Before, the model ran on all 40 positions without a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setattr(logging.getLogger("transformers"), "propagate", True)  # its records to caplog

    words = ["<unk>", *(f"w{index}" for index in range(40))]
    backend = Tokenizer(models.WordLevel({word: index for index, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", model_max_length=16).save_pretrained(
        tmp_path / "mhc")
    config = hf_mhc.MHCConfig(backbone_config=tiny_backbone_config("llama", max_position_embeddings=16), hc_mult=2)
    model = randomize_hc(hf_mhc.MHCForCausalLM(config))
    model.save_pretrained(tmp_path / "mhc")
    capfd.readouterr()
    reports = {}
    for count in (40, 16):
        text = " ".join(words[1:count + 1])
        json_path = tmp_path / f"report_{count}.json"
        assert inspect_main([str(tmp_path / "mhc"), "--text", text, "--json", str(json_path)]) == 0
        err = capfd.readouterr().err
        assert "Traceback" not in err, err
        warnings = [line for line in err.splitlines() if "warning" in line.lower()]
        expected = ("hf-mhc inspect: warning: --text is 40 tokens, more than the model's 16 positions "
                    "(max_position_embeddings); measuring on its first 16 tokens")
        assert warnings == ([expected] if count == 40 else []), err
        reports[count] = json.loads(json_path.read_text())
    assert not [record for record in caplog.records if "sequence length" in record.getMessage()]
    assert reports[40]["num_tokens"] == 16
    assert reports[40] == reports[16]
    # without a tokenizer: random token ids, as many as the context holds when it holds fewer than 64
    model.save_pretrained(tmp_path / "no_tokenizer")
    capfd.readouterr()
    assert inspect_main([str(tmp_path / "no_tokenizer"), "--json", str(tmp_path / "random.json")]) == 0
    assert "has no tokenizer: measuring on 16 random token ids (seed 0)" in capfd.readouterr().out
    assert json.loads((tmp_path / "random.json").read_text())["num_tokens"] == 16
