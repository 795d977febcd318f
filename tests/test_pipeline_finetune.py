"""Pipeline schedules on two gloo ranks, and ``examples/pipeline_finetune.py`` trained with each of them.

One ``torchrun`` launch of ``distributed_workers/pipeline_worker.py`` (a module-scoped fixture) checks every schedule's
gradients against one process and keeps a tied embedding's two copies bit-equal, runs the example with every schedule
on stories260K (tied embeddings; a tiny tied 4-layer model where ../shared/assets is absent), 4 AdamW steps with a
checkpoint at step 2, and resumes one of those runs from its checkpoint. The example's one-process mode (no torchrun)
runs here, in this process, on the same data: it is the reference the pipelined runs must reach.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import (
    BAD_TRAINING_OPTIONS,
    EXAMPLES,
    OLD_GLOO_PIPELINE,
    STORIES260K,
    WORKERS,
    assert_ordinary_mhc_folder,
    free_port,
    import_script,
    needs_torch,
    torchrun,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import hf_mhc

SCHEDULES = ["1f1b", "gpipe", "interleaved1f1b", "dualpipev"]  # the first is also resumed
# The example's options for every run: 4 steps of 4 sequences in 4 microbatches, a checkpoint at step 2.
LR, STEPS = 1e-3, 4
FINETUNE_ARGS = ["--steps", str(STEPS), "--batch-size", "4", "--microbatches", "4", "--block-size", "16", "--lr",
                 str(LR), "--save-every", "2"]
# Losses and gradient norms of the pipelined runs: float32 sums in another order, relative to the one-process run's.
PARITY_RTOL = 1e-6
tolerances = import_script(WORKERS / "tolerances.py")
assert_close_to_scale = tolerances.assert_close_to_scale


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
    if STORIES260K.is_dir():  # a real tied Llama, upcycled to mHC
        hf_mhc.upcycle(AutoModelForCausalLM.from_pretrained(STORIES260K), hc_mult=4).save_pretrained(folder / "model")
        AutoTokenizer.from_pretrained(STORIES260K).save_pretrained(folder / "model")
    else:
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


@needs_torch(*OLD_GLOO_PIPELINE)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_schedule_matches_one_process(work, schedule):
    """One step (no optimizer step): the loss, logits and every gradient of one process, to float32 rounding."""
    log = (work / "launch.log").read_text()
    line = next((line for line in log.splitlines() if line.startswith(f"{schedule}: loss")), None)
    assert line is not None and "parameters match" in line, log[-3000:]


@needs_torch(*OLD_GLOO_PIPELINE)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipelined_finetuning_reaches_the_weights_of_one_process(work, schedule):
    """Losses and gradient norms of every step equal the one-process run's within 1e-6 relative; the weights within
    what 4 AdamW steps allow (an entry whose gradient is rounding noise may step the other way)."""
    weights, log = saved_state(work / schedule)
    expected_weights, expected_log = saved_state(work / "one_process")
    assert set(weights) == set(expected_weights)
    for name, expected in expected_weights.items():
        assert_close_to_scale(weights[name], expected, rtol=0, atol=tolerances.adamw_parameter_atol(LR, STEPS),
                              name=name)
    assert [entry["step"] for entry in log] == [1, 2, 3, 4]
    for entry, expected in zip(log, expected_log, strict=True):
        assert entry["lr"] == expected["lr"]
        assert abs(entry["loss"] - expected["loss"]) <= PARITY_RTOL * expected["loss"], (entry, expected)
        assert abs(entry["grad_norm"] - expected["grad_norm"]) <= PARITY_RTOL * expected["grad_norm"], (entry, expected)
    initial = load_file(work / "model" / "model.safetensors")
    assert any(not torch.equal(initial[name], expected_weights[name]) for name in initial)  # it trained


@needs_torch(*OLD_GLOO_PIPELINE)
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


@needs_torch(*OLD_GLOO_PIPELINE)
def test_the_run_saves_ordinary_mhc_folders_that_stay_tied(work):
    """The tied embedding stays one tensor: ``tie_word_embeddings: true``, the source's parameter count."""
    out = work / SCHEDULES[0]
    assert_ordinary_mhc_folder(out)
    trained = AutoModelForCausalLM.from_pretrained(out)
    source = AutoModelForCausalLM.from_pretrained(work / "model")
    assert type(trained) is hf_mhc.MHCForCausalLM
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert trained.lm_head.weight is trained.model.embed_tokens.weight
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    assert trained.num_parameters() == source.num_parameters()
    initial = load_file(work / "model" / "model.safetensors")
    for name in ("model.embed_tokens.weight", "model.layers.0.attn_hc.fn", "model.layers.3.ffn_hc.fn"):
        assert not torch.equal(trained.state_dict()[name], initial[name]), name
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


@pytest.mark.parametrize(("option", "value", "message"), BAD_TRAINING_OPTIONS)
def test_a_bad_training_option_is_refused_before_anything_is_loaded(option, value, message, two_layer_model,
                                                                    tmp_path, capsys):
    """One line, status 2, nothing written, checked as the options are parsed (before the --model, which here does
    not exist): a block of one token has no next token to learn (the run used to end in "the loss is nan; lower
    --lr"), and the rest trained wrongly or failed only after loading the model."""
    write_texts(tmp_path / "data.txt")
    argv = ["--model", str(two_layer_model), "--dataset", str(tmp_path / "data.txt"), *ONE_PROCESS_ARGS,
            "--output-dir", str(tmp_path / "out"), option, value]
    for model in (two_layer_model, tmp_path / "missing"):
        argv[1] = str(model)
        with pytest.raises(SystemExit) as exit_info:
            example().main(argv)
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert error.strip().splitlines()[-1] == f"pipeline_finetune.py: error: argument {option}: {message}", error
        assert not (tmp_path / "out").exists() and not dist.is_initialized()


# --- interrupted saves, damaged checkpoints and a longer resumed run, in one process ----------------------------------

# 4 steps of 4 sequences in 2 microbatches on the 2-layer model, a checkpoint after every step but the last.
ONE_PROCESS_ARGS = ["--steps", "4", "--save-every", "1", "--batch-size", "4", "--microbatches", "2", "--block-size",
                    "16", "--lr", "1e-3"]
# Run as a script by the tests: ``python THIS HOW EXAMPLE ARGS...`` (also under torchrun) runs EXAMPLE, whose save of
# checkpoint-3's optimizer.pt, after that checkpoint's model files, SIGKILLs the process (HOW = kill) or fails as on a
# full disk (HOW = disk-full).
FAILING_SAVE = """
import errno, os, runpy, signal, sys
import torch

save, how = torch.save, sys.argv[1]

def failing_save(obj, file, *args, **kwargs):
    target = os.fspath(file) if isinstance(file, (str, os.PathLike)) else getattr(file, "name", "")  # path or file
    if "checkpoint-3" in target and target.endswith("optimizer.pt"):
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return save(obj, file, *args, **kwargs)

torch.save = failing_save
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_with_failing_save(how: str, argv: list[str], tmp_path: Path, ranks: int = 1) -> subprocess.CompletedProcess:
    """The example run by :data:`FAILING_SAVE` in a process of its own (``ranks`` > 1: under torchrun, gloo)."""
    (tmp_path / "failing_save.py").write_text(FAILING_SAVE)
    launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                    f"--nproc_per_node={ranks}", "--master_addr=127.0.0.1",
                                                    f"--master_port={free_port()}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()),  # the threads of this process's runs
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "datasets_cache")}
    return subprocess.run([*launcher, str(tmp_path / "failing_save.py"), how, str(EXAMPLES / "pipeline_finetune.py"),
                           *argv], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def one_process_run(two_layer_model, tmp_path_factory) -> tuple[list[str], Path]:
    """The options of a one-process run (without --output-dir) and the folder of that run, never interrupted
    (checkpoint-1 to checkpoint-3 and the final model)."""
    folder = tmp_path_factory.mktemp("one_process")
    write_texts(folder / "data.txt")
    argv = ["--model", str(two_layer_model), "--dataset", str(folder / "data.txt"), *ONE_PROCESS_ARGS]
    assert example().main([*argv, "--output-dir", str(folder / "uninterrupted")]) == 0
    return argv, folder / "uninterrupted"


def assert_same_run(folder: Path, reference: Path) -> None:
    """The run saved in ``folder`` took the steps of the one in ``reference``: same losses, same final weights (the
    same code in the same process, so to float32 rounding)."""
    weights, log = saved_state(folder)
    expected_weights, expected_log = saved_state(reference)
    assert [entry["step"] for entry in log] == [entry["step"] for entry in expected_log]
    for entry, expected in zip(log, expected_log, strict=True):
        assert abs(entry["loss"] - expected["loss"]) <= 1e-6 * expected["loss"], (entry, expected)
    assert set(weights) == set(expected_weights)
    for name, expected in expected_weights.items():
        assert_close_to_scale(weights[name], expected, rtol=1e-6, name=name)


def checkpoint_entries(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if "checkpoint-" in path.name)


def test_a_run_killed_mid_save_resumes_from_the_last_complete_checkpoint(one_process_run, tmp_path, capsys):
    argv, uninterrupted = one_process_run
    killed = tmp_path / "killed"
    result = run_with_failing_save("kill", [*argv, "--output-dir", str(killed)], tmp_path)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    # checkpoint-3 was being written: only its hidden folder is there, which no --resume takes
    partial, *entries = checkpoint_entries(killed)
    assert entries == ["checkpoint-1", "checkpoint-2"], entries
    assert partial.startswith(".checkpoint-3.partial-") and (killed / partial / "model.safetensors").is_file()

    capsys.readouterr()
    assert example().main([*argv, "--output-dir", str(killed), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert (f"resuming from {killed / 'checkpoint-2'} at step 2; skipped: {partial} (an "
            "interrupted save)") in printed, printed
    assert (killed / partial).is_dir()  # left as it was
    assert_same_run(killed, uninterrupted)
    assert_same_run(killed / "checkpoint-3", uninterrupted / "checkpoint-3")


def test_a_save_that_fails_stops_with_one_line_and_leaves_no_checkpoint(one_process_run, tmp_path, capsys,
                                                                         monkeypatch):
    argv, uninterrupted = one_process_run
    out = tmp_path / "out"
    save = torch.save

    def disk_full(obj, file, *args, **kwargs):  # what FAILING_SAVE's disk-full does, in this process
        target = os.fspath(file) if isinstance(file, (str, os.PathLike)) else getattr(file, "name", "")
        if "checkpoint-3" in target and target.endswith("optimizer.pt"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return save(obj, file, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "save", disk_full)
        assert example().main([*argv, "--output-dir", str(out)]) == 1
    error = capsys.readouterr().err
    assert "Traceback" not in error
    assert error.strip().splitlines()[-1].startswith(
        f"pipeline_finetune.py: error: cannot save {out / 'checkpoint-3'}: [Errno 28] No space left on device"
    ), error[-2000:]
    assert checkpoint_entries(out) == ["checkpoint-1", "checkpoint-2"]  # nothing half-written is left

    assert example().main([*argv, "--output-dir", str(out), "--resume"]) == 0
    assert f"resuming from {out / 'checkpoint-2'} at step 2\n" in capsys.readouterr().out
    assert_same_run(out, uninterrupted)


def test_a_save_that_fails_stops_every_rank(two_layer_model, tmp_path):
    """On two ranks, rank 0's failed save ends both (neither waits for the other) with the one error line."""
    write_texts(tmp_path / "data.txt")
    out = tmp_path / "out"
    argv = ["--model", str(two_layer_model), "--dataset", str(tmp_path / "data.txt"), *FINETUNE_ARGS[:-2],
            "--save-every", "1", "--output-dir", str(out)]
    result = run_with_failing_save("disk-full", argv, tmp_path, ranks=2)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if "pipeline_finetune.py: error:" in line]
    assert len(errors) == 1, result.stderr[-3000:]
    assert f"cannot save {out / 'checkpoint-3'}: [Errno 28] No space left on device" in errors[0]
    assert "step 3/4" in result.stdout and "step 4/4" not in result.stdout
    assert checkpoint_entries(out) == ["checkpoint-1", "checkpoint-2"]


def cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize(
    ("case", "resume", "message"),
    [
        ("optimizer.pt cut short", "", "--resume {ckpt}: optimizer.pt is damaged or cut short (not a complete torch "
                                       "archive)"),
        ("scheduler.pt missing", "", "--resume {ckpt}: scheduler.pt is missing; not a whole checkpoint"),
        ("rng_state_0.pth cut short", "", "--resume {ckpt}: rng_state_0.pth is damaged or cut short"),
        ("model.safetensors cut short", "", "--resume {ckpt}: model.safetensors is damaged or cut short (Error "
                                            "while deserializing header"),
        ("trainer_state.json garbage", "{ckpt}", "--resume {ckpt}: incomplete checkpoint (trainer_state.json is not "
                                                 "valid JSON (line 1: Expecting value)), not one to continue from"),
        ("trainer_state.json of Trainer", "", "--resume {ckpt}: its trainer_state.json is not one this script writes"),
    ],
)
def test_a_damaged_checkpoint_is_a_one_line_error_naming_the_file(case, resume, message, one_process_run, tmp_path,
                                                                  capsys):
    argv, uninterrupted = one_process_run
    out = tmp_path / "out"
    shutil.copytree(uninterrupted, out)
    checkpoint = out / "checkpoint-3"
    name = case.split()[0]
    if case.endswith("cut short"):
        cut_short(checkpoint / name)
    elif case.endswith("missing"):
        (checkpoint / name).unlink()
    elif case.endswith("garbage"):
        (checkpoint / name).write_text("not JSON")
    else:  # what examples/finetune.py's Trainer writes
        (checkpoint / name).write_text(json.dumps({"global_step": 3, "log_history": [], "max_steps": 4}))
    before = sorted(str(path.relative_to(out)) for path in out.rglob("*"))
    resume_args = ["--resume", resume.format(ckpt=checkpoint)] if resume else ["--resume"]
    with pytest.raises(SystemExit) as exit_info:
        example().main([*argv, "--output-dir", str(out), *resume_args])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error
    line = error.strip().splitlines()[-1]
    assert line.startswith("pipeline_finetune.py: error: ") and message.format(ckpt=checkpoint, out=out) in line, line
    assert sorted(str(path.relative_to(out)) for path in out.rglob("*")) == before  # nothing deleted or written


@pytest.mark.parametrize("damage", ["trainer_state.json cut short", "trainer_state.json missing"])
def test_resume_sets_aside_an_incomplete_checkpoint_it_would_save_again(damage, one_process_run, tmp_path, capsys):
    """A checkpoint-3 without a whole trainer_state.json (written last) is a save that did not finish: the same command
    with --resume continues from checkpoint-2, renames checkpoint-3 out of the way (deleting nothing), says so in one
    line and reaches the uninterrupted run."""
    argv, uninterrupted = one_process_run
    out = tmp_path / "out"
    shutil.copytree(uninterrupted, out)
    state = out / "checkpoint-3" / "trainer_state.json"
    if damage.endswith("cut short"):
        cut_short(state)
    else:
        state.unlink()
    left = {path.name: path.read_bytes() for path in (out / "checkpoint-3").iterdir()}

    assert example().main([*argv, "--output-dir", str(out), "--resume"]) == 0
    printed = capsys.readouterr().out
    (aside,) = [path for path in out.iterdir() if path.name.startswith("incomplete-checkpoint-3.")]
    reason = "trainer_state.json is missing" if damage.endswith("missing") else "trainer_state.json is not valid JSON"
    assert f"resuming from {out / 'checkpoint-2'} at step 2; skipped: checkpoint-3 (incomplete: {reason}" in printed
    line = next(line for line in printed.splitlines() if line.startswith("--resume: set aside"))
    assert line.startswith(f"--resume: set aside the incomplete checkpoint-3 ({reason}") and line.endswith(
        f" as {aside.name}, so that this run can save checkpoint-3 again; nothing of it is deleted"), line
    assert {path.name: path.read_bytes() for path in aside.iterdir()} == left  # as it was
    assert checkpoint_entries(out) == ["checkpoint-1", "checkpoint-2", "checkpoint-3", aside.name]
    assert_same_run(out, uninterrupted)
    assert_same_run(out / "checkpoint-3", uninterrupted / "checkpoint-3")


def test_resume_never_moves_a_complete_checkpoint_or_what_is_not_one(one_process_run, tmp_path, capsys):
    """Resumed from checkpoint-1, the run would save checkpoint-2 again: complete, or a file, it is refused in one line
    and nothing is renamed or written."""
    argv, uninterrupted = one_process_run
    out = tmp_path / "out"
    shutil.copytree(uninterrupted, out)
    message = (f"pipeline_finetune.py: error: --resume {out / 'checkpoint-1'} continues at step 1 and would save "
               "checkpoint-2 again, which --output-dir already holds: move it away first (nothing is replaced)")
    for what in ("a complete checkpoint", "a file"):
        if what == "a file":
            shutil.rmtree(out / "checkpoint-2")
            (out / "checkpoint-2").write_text("the user's own")
        before = {str(path.relative_to(out)): path.stat().st_mtime_ns for path in out.rglob("*")}
        with pytest.raises(SystemExit) as exit_info:
            example().main([*argv, "--output-dir", str(out), "--resume", str(out / "checkpoint-1")])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == message, what
        assert {str(path.relative_to(out)): path.stat().st_mtime_ns for path in out.rglob("*")} == before, what


def test_untie_word_embeddings_is_an_option_and_a_tied_run_resumes_tied(one_process_run, tmp_path, capsys):
    """--untie-word-embeddings trains lm_head apart and saves it untied; a tied run's checkpoint refuses it."""
    argv, uninterrupted = one_process_run
    assert json.loads((uninterrupted / "config.json").read_text())["tie_word_embeddings"] is True
    steps = argv.index("--steps") + 1
    two_steps = [*argv[:steps], "2", *argv[steps + 1:]]
    assert example().main([*two_steps, "--untie-word-embeddings", "--output-dir", str(tmp_path / "untied")]) == 0
    untied = AutoModelForCausalLM.from_pretrained(tmp_path / "untied")
    assert not untied.config.tie_word_embeddings and "lm_head.weight" in load_file(tmp_path / "untied" /
                                                                                   "model.safetensors")
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)  # trained apart
    shutil.copytree(uninterrupted / "checkpoint-1", tmp_path / "tied" / "checkpoint-1")
    with pytest.raises(SystemExit):
        example().main([*argv, "--untie-word-embeddings", "--output-dir", str(tmp_path / "tied"), "--resume"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.endswith("kept its word embeddings tied: drop --untie-word-embeddings"), line


def test_a_resumed_run_may_take_more_steps_and_keeps_its_warm_up(one_process_run, tmp_path, capsys):
    """Saved by a 10-step run (warm-up 10 // 10 = 1) at step 5, resumed for 20 steps: the warm-up stays 1 (20 // 10
    would be 2), and from step 7 on the cosine decay runs to step 20, as Trainer's resumed schedule does; step 6 keeps
    the learning rate the saved run would have used."""
    from transformers import get_cosine_schedule_with_warmup

    argv, _ = one_process_run
    argv = [*argv[: argv.index("--steps")], *argv[argv.index("--steps") + 2 :]]
    out = tmp_path / "out"
    assert example().main([*argv, "--steps", "10", "--save-every", "5", "--output-dir", str(out)]) == 0
    short_log = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert example().main([*argv, "--steps", "20", "--save-every", "5", "--output-dir", str(out), "--resume"]) == 0
    assert f"resuming from {out / 'checkpoint-5'} at step 5" in capsys.readouterr().out
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["options"]["warmup_steps"] == 1 and state["options"]["steps"] == 20
    log = state["log_history"]
    assert [entry["step"] for entry in log] == list(range(1, 21))
    assert [entry["lr"] for entry in log[:6]] == [entry["lr"] for entry in short_log[:6]]
    assert log[5]["loss"] == pytest.approx(short_log[5]["loss"], rel=1e-6)  # from the weights of checkpoint-5
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    schedule = get_cosine_schedule_with_warmup(optimizer, 1, 20)
    expected = []
    for _ in range(20):
        expected.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert [entry["lr"] for entry in log[6:]] == pytest.approx(expected[6:], rel=1e-12)

    with pytest.raises(SystemExit):
        example().main([*argv, "--steps", "30", "--save-every", "5", "--warmup-steps", "3", "--output-dir", str(out),
                        "--resume", str(out / "checkpoint-15")])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--resume {out / 'checkpoint-15'} was saved by a run with --warmup-steps 1 (now 3)" in line, line


@needs_torch(*OLD_GLOO_PIPELINE)
def test_resuming_on_another_number_of_ranks_names_the_torchrun_option(work, tmp_path, capsys):
    """The 1f1b run's checkpoint was saved on two ranks; one process may not continue it."""
    argv = json.loads((work / "finetune_args.json").read_text())
    with pytest.raises(SystemExit):
        example().main([*argv, "--output-dir", str(tmp_path / "out"), "--resume", str(work / "1f1b" / "checkpoint-2")])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "was saved by a run with ranks (torchrun --nproc-per-node) 2 (now 1): run it as that run ran" in line, line
    assert "--world-size" not in line


def test_empty_texts_are_skipped(two_layer_model, tmp_path):
    """A thousand empty texts (a whole tokenisation batch of them) before the real ones."""
    texts = [{"text": ""}] * 1000 + [{"text": paragraph} for paragraph in "Some text.\n\nMore text here.".split("\n")]
    from pydoc_data.topics import topics

    texts += [{"text": topics[key]} for key in sorted(topics)[:2]]
    (tmp_path / "texts.jsonl").write_text("".join(json.dumps(text) + "\n" for text in texts))
    argv = ["--model", str(two_layer_model), "--dataset", str(tmp_path / "texts.jsonl"), "--steps", "1",
            "--batch-size", "2", "--block-size", "16", "--output-dir", str(tmp_path / "out")]
    assert example().main(argv) == 0
