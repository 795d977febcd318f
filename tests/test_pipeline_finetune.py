"""Pipeline schedules on two gloo ranks, and ``examples/pipeline_finetune.py`` trained with each of them.

One ``torchrun`` launch of ``distributed_workers/pipeline_worker.py`` (a module-scoped fixture) checks every schedule's
gradients against one process, runs the example with every schedule on a tiny tied 4-layer model (4 AdamW steps, a
checkpoint at step 2) and resumes one of those runs from its checkpoint. The example's one-process mode (no torchrun)
runs here, in this process, on the same data: it is the reference the pipelined runs must reach.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import import_script
from safetensors.torch import load_file
from test_distributed import EXAMPLES, WORKERS, assert_ordinary_mhc_folder, torchrun
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import hf_mhc

SCHEDULES = ["1f1b", "gpipe", "interleaved1f1b", "dualpipev"]  # the first is also resumed
# The example's options for every run: 4 steps of 4 sequences in 4 microbatches, a checkpoint at step 2.
FINETUNE_ARGS = ["--steps", "4", "--batch-size", "4", "--microbatches", "4", "--block-size", "16", "--lr", "1e-3",
                 "--save-every", "2"]
PARITY_RTOL = 1e-4  # of each tensor's largest entry, after 4 AdamW steps
assert_close_to_scale = import_script(WORKERS / "tolerances.py").assert_close_to_scale


def example():
    return import_script(EXAMPLES / "pipeline_finetune.py")


def write_tiny_model(folder: Path, num_layers: int = 4) -> None:
    """A random Llama (hidden 32, tied embeddings) over the examples' byte-level tokenizer, upcycled to 2 streams."""
    tokenizer = import_script(EXAMPLES / "fsdp2_finetune.py").byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(0)
    hf_mhc.upcycle(LlamaForCausalLM(config), hc_mult=2).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def write_texts(path: Path) -> None:
    """About 17 kB of Python's help texts: a thousand 16-token blocks."""
    from pydoc_data.topics import topics

    path.write_text("\n\n".join(topics[key] for key in sorted(topics)[:3]), encoding="utf-8")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The tiny model and texts (``model/``, ``data.txt``), the one-process run (``one_process/``) and, from one
    two-rank launch, a run per schedule (``SCHEDULE/``) and the resumed run (``resumed/``). ``launch.log``: its
    output."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    folder = tmp_path_factory.mktemp("pipeline")
    write_tiny_model(folder / "model")
    write_texts(folder / "data.txt")
    argv = ["--model", str(folder / "model"), "--dataset", str(folder / "data.txt"), *FINETUNE_ARGS]
    (folder / "finetune_args.json").write_text(json.dumps(argv))
    (folder / "launch.log").write_text(torchrun(WORKERS / "pipeline_worker.py", str(folder), *SCHEDULES, cwd=folder))
    threads = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # as the ranks ran
    try:
        assert example().main([*argv, "--output-dir", str(folder / "one_process")]) == 0
    finally:
        torch.set_num_threads(threads)
    return folder


def saved_state(folder: Path) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """The weights and the per-step log of a saved run."""
    log = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return load_file(folder / "model.safetensors"), log


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_schedule_matches_one_process(work, schedule):
    """One step (no optimizer step): the loss, logits and every gradient of one process, to float32 rounding."""
    log = (work / "launch.log").read_text()
    line = next((line for line in log.splitlines() if line.startswith(f"{schedule}: loss")), None)
    assert line is not None and "parameters match" in line, log[-3000:]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipelined_finetuning_reaches_the_weights_of_one_process(work, schedule):
    weights, log = saved_state(work / schedule)
    expected_weights, expected_log = saved_state(work / "one_process")
    assert set(weights) == set(expected_weights)
    for name, expected in expected_weights.items():
        assert_close_to_scale(weights[name], expected, rtol=PARITY_RTOL, name=name)
    assert [entry["step"] for entry in log] == [1, 2, 3, 4]
    for entry, expected in zip(log, expected_log, strict=True):
        assert entry["lr"] == expected["lr"]
        assert abs(entry["loss"] - expected["loss"]) <= PARITY_RTOL * expected["loss"], (entry, expected)
        assert abs(entry["grad_norm"] - expected["grad_norm"]) <= PARITY_RTOL * expected["grad_norm"], (entry, expected)
    initial = load_file(work / "model" / "model.safetensors")
    assert any(not torch.equal(initial[name], expected_weights[name]) for name in initial)  # it trained


def test_a_resumed_run_continues_the_loss_curve(work):
    """Resumed from its step-2 checkpoint, the 1f1b run reaches the losses and weights of the run that went on."""
    log = (work / "launch.log").read_text()
    assert f"{SCHEDULES[0]}: resumed from checkpoint-2" in log and "resuming from" in log, log[-3000:]
    weights, resumed_log = saved_state(work / "resumed")
    expected_weights, expected_log = saved_state(work / SCHEDULES[0])
    assert [entry["step"] for entry in resumed_log] == [1, 2, 3, 4]
    for entry, expected in zip(resumed_log, expected_log, strict=True):
        assert abs(entry["loss"] - expected["loss"]) <= 1e-6 * expected["loss"], (entry, expected)
    for name, expected in expected_weights.items():
        assert_close_to_scale(weights[name], expected, rtol=1e-6, name=name)


def test_the_run_saves_ordinary_mhc_folders_with_an_untied_lm_head(work):
    out = work / SCHEDULES[0]
    assert_ordinary_mhc_folder(out)
    trained = AutoModelForCausalLM.from_pretrained(out)
    assert type(trained) is hf_mhc.MHCForCausalLM
    assert not trained.config.tie_word_embeddings and trained.lm_head.weight is not trained.model.embed_tokens.weight
    initial = load_file(work / "model" / "model.safetensors")
    for name in ("model.embed_tokens.weight", "model.layers.0.attn_hc.fn", "model.layers.3.ffn_hc.fn"):
        assert not torch.equal(trained.state_dict()[name], initial[name]), name
    # lm_head started as the embedding's copy, and trained apart from it
    assert not torch.equal(trained.lm_head.weight, trained.model.embed_tokens.weight)
    checkpoint = out / "checkpoint-2"
    assert_ordinary_mhc_folder(checkpoint)
    files = {path.name for path in checkpoint.iterdir()}
    assert {"optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json"} <= files
    optimizer = torch.load(checkpoint / "optimizer.pt")
    assert len(optimizer["ranks"]) == 2 and all(rank_state["state"] for rank_state in optimizer["ranks"])


# --- bad input: one line, before any process group -------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_layer_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny") / "model"
    write_tiny_model(folder, num_layers=2)
    return folder


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing model", "--model: no such folder: {tmp}/missing"),
        ("empty dataset", "--dataset {tmp}/empty.txt: empty file"),
        ("no text", "--dataset {tmp}/empty_texts.jsonl: no text to train on (every 'text' is empty or null)"),
        ("microbatches", "--microbatches 3 does not divide --batch-size 4"),
        ("output dir", "--output-dir {tmp}/full is not empty: pass --overwrite"),
        ("stages", "--schedule dualpipev on 2 ranks makes 4 stages, but the model has 2 decoder layers"),
        ("schedule", "--schedule dualpipev needs --microbatches >= the 4 stages (2 per rank), got 2"),
    ],
)
def test_bad_input_is_a_one_line_error_before_any_process_group(case, message, two_layer_model, tmp_path,
                                                                 monkeypatch, capsys):
    (tmp_path / "texts.txt").write_text("Some text to train on.\n\nAnother paragraph.\n" * 20)
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty_texts.jsonl").write_text('{"text": ""}\n' * 3)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("kept")
    argv = {"--model": str(two_layer_model), "--dataset": str(tmp_path / "texts.txt"), "--batch-size": "4",
            "--block-size": "8", "--output-dir": str(tmp_path / "out")}
    if case == "missing model":
        argv["--model"] = str(tmp_path / "missing")
    elif case == "empty dataset":
        argv["--dataset"] = str(tmp_path / "empty.txt")
    elif case == "no text":
        argv["--dataset"] = str(tmp_path / "empty_texts.jsonl")
    elif case == "microbatches":
        argv["--microbatches"] = "3"
    elif case == "output dir":
        argv["--output-dir"] = str(tmp_path / "full")
    else:  # as torchrun starts two ranks: the stages are counted before any process group exists
        monkeypatch.setenv("WORLD_SIZE", "2")
        argv.update({"--schedule": "dualpipev", "--microbatches": "4" if case == "stages" else "2"})
    with pytest.raises(SystemExit) as exit_info:
        example().main([item for pair in argv.items() for item in pair])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("pipeline_finetune.py: error: ") and message.format(tmp=tmp_path) in error, error
    assert not dist.is_initialized()
    assert (tmp_path / "full" / "notes.txt").read_text() == "kept" and not (tmp_path / "out").exists()


# --- data -------------------------------------------------------------------------------------------------------------


def test_empty_texts_are_skipped(two_layer_model, tmp_path):
    """A thousand empty texts (a whole tokenisation batch of them) before the real ones."""
    texts = [{"text": ""}] * 1000 + [{"text": paragraph} for paragraph in "Some text.\n\nMore text here.".split("\n")]
    from pydoc_data.topics import topics

    texts += [{"text": topics[key]} for key in sorted(topics)[:2]]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps(text) + "\n" for text in texts))
    argv = ["--model", str(two_layer_model), "--dataset", str(tmp_path / "texts.jsonl"), "--steps", "1",
            "--batch-size", "2", "--block-size", "16", "--output-dir", str(tmp_path / "out")]
    assert example().main(argv) == 0
