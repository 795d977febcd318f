"""``hf_mhc.conversion.output_safety``: ``hf-mhc convert`` never loses data. One conversion per OUT (a lock, taken
over from a dead process); an OUT that appears or changes meanwhile is left alone; --overwrite replaces only a
checkpoint folder, never SRC, a folder around it, the working directory or home; an interrupted conversion or
--overwrite leaves OUT as it was (its staging folder removed, an old checkpoint set aside restored or named)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import assert_one_line_error, convert, leftovers, save_source

import hf_mhc.conversion.convert as convert_module
import hf_mhc.conversion.output_safety as output_safety
from hf_mhc.conversion import ConversionError, convert_checkpoint
from hf_mhc.conversion.safetensors_stream import SafetensorsStreamWriter

pytestmark = pytest.mark.usefixtures("one_thread")


def folder_digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path -> sha256), to show a folder is byte-for-byte unchanged."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def dead_pid() -> int:
    """The pid of a process that has exited."""
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def pause_in_weight_writer(monkeypatch, action):
    """Run ``action()`` once, when the conversion writes its weights (the staging folder exists by then)."""
    real = convert_module.write_weights
    calls = []

    def write_weights(folder, *args, **kwargs):
        if not calls:
            calls.append(folder)
            assert folder.is_dir() and output_safety.STAGING_MARKER in folder.name
            action()
        return real(folder, *args, **kwargs)

    monkeypatch.setattr(convert_module, "write_weights", write_weights)
    return calls


@pytest.mark.parametrize("at_start", ["missing", "empty", "checkpoint"])
def test_an_out_that_appears_or_changes_while_converting_is_left_alone(tmp_path, capsys, monkeypatch, at_start):
    save_source(tmp_path / "src", "llama")
    out = tmp_path / "out"
    if at_start == "empty":
        out.mkdir()
    elif at_start == "checkpoint":
        save_source(out, "llama")

    def another_program_writes_out():
        if at_start == "checkpoint":  # the checked folder is swapped for another one
            out.rename(tmp_path / "old-checkpoint")
        out.mkdir(exist_ok=True)
        (out / "notes.txt").write_text("mine")

    calls = pause_in_weight_writer(monkeypatch, another_program_writes_out)
    status, _, err = convert(capsys, tmp_path / "src", out, "--no-verify", "--overwrite")
    assert calls, "the hook did not run"
    assert_one_line_error(status, err, "appeared or changed while converting", "left as it is")
    assert folder_digest(out) == {"notes.txt": hashlib.sha256(b"mine").hexdigest()}
    assert not leftovers(tmp_path)


def test_an_out_that_appears_is_kept_without_overwrite(tmp_path, capsys, monkeypatch):
    save_source(tmp_path / "src", "llama")
    out = tmp_path / "out"
    pause_in_weight_writer(monkeypatch, lambda: (out.mkdir(), (out / "notes.txt").write_text("mine")))
    status, _, err = convert(capsys, tmp_path / "src", out, "--no-verify")
    assert_one_line_error(status, err, "appeared or changed while converting")
    assert (out / "notes.txt").read_text() == "mine" and len(list(out.iterdir())) == 1
    assert not leftovers(tmp_path)


def test_two_conversions_to_the_same_out_one_wins(tmp_path, capsys, monkeypatch):
    save_source(tmp_path / "src", "llama")
    save_source(tmp_path / "src2", "qwen2")
    out = tmp_path / "out"
    second = []

    def second_conversion():  # started while the first one is writing its weights
        try:
            convert_checkpoint(tmp_path / "src2", out, overwrite=True, verify=False, progress=False)
        except ConversionError as error:
            second.append(str(error))
        else:
            second.append("succeeded")

    pause_in_weight_writer(monkeypatch, second_conversion)
    status, _, err = convert(capsys, tmp_path / "src", out, "--no-verify")
    assert status == 0, err
    assert len(second) == 1 and "another hf-mhc convert" in second[0] and ".out.hf-mhc-lock" in second[0], second
    assert f"{os.getpid()}@{socket.gethostname()}" in second[0]
    assert json.loads((out / "config.json").read_text())["backbone_config"]["model_type"] == "llama"
    assert not leftovers(tmp_path)  # the lock is gone with the first conversion


def test_lock_of_a_live_conversion_blocks_and_a_dead_ones_is_taken_over(tmp_path, capsys):
    save_source(tmp_path / "src", "llama")
    lock = tmp_path / ".out.hf-mhc-lock"
    for holder in (f"{os.getppid()}@{socket.gethostname()} abc", "4242@another-host abc"):
        lock.write_text(holder)
        status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--no-verify")
        assert_one_line_error(status, err, "another hf-mhc convert", holder.split()[0], str(lock))
        assert not (tmp_path / "out").exists() and lock.read_text() == holder
    lock.write_text(f"{dead_pid()}@{socket.gethostname()} abc")
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--no-verify")
    assert status == 0, err
    assert (tmp_path / "out" / "model.safetensors").is_file() and not leftovers(tmp_path)


def test_stale_staging_of_a_dead_process_is_removed(tmp_path, capsys):
    save_source(tmp_path / "src", "llama")
    host = socket.gethostname()
    stale = tmp_path / f".out.hf-mhc-partial.{dead_pid()}@{host}.abc123"
    running = tmp_path / f".out.hf-mhc-partial.{os.getpid()}@{host}.def456"
    stale.mkdir()
    running.mkdir()
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--no-verify")
    assert status == 0, err
    assert not stale.exists() and running.is_dir()


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


def test_empty_out_is_refused(tmp_path, capsys, monkeypatch):
    save_source(tmp_path / "src", "llama")
    work = tmp_path / "work"
    save_source(work, "llama")  # even a working directory that looks like a checkpoint
    (work / "notes.txt").write_text("mine")
    before = folder_digest(work)
    monkeypatch.chdir(work)
    status, _, err = convert(capsys, tmp_path / "src", "", "--overwrite", "--no-verify")
    assert_one_line_error(status, err, "OUT is empty")
    status, _, err = convert(capsys, tmp_path / "src", ".", "--overwrite", "--no-verify")
    assert_one_line_error(status, err, "is the working directory or contains it")
    assert folder_digest(work) == before and not leftovers(tmp_path)
    with pytest.raises(ConversionError, match="SRC is empty"):
        convert_checkpoint("", tmp_path / "out2", verify=False, progress=False)


@pytest.mark.parametrize("case", ["SRC", "parent of SRC", "inside SRC", "link to SRC", "inside a link to SRC", "home"])
def test_overwrite_never_replaces_src_its_parents_or_home(tmp_path, capsys, monkeypatch, case):
    parent = tmp_path / "parent"
    save_source(parent, "llama")  # the parent looks like a checkpoint too
    src = parent / "src"
    save_source(src, "llama")
    home = tmp_path / "home"
    save_source(home, "llama")
    monkeypatch.setenv("HOME", str(home))
    (tmp_path / "link").symlink_to(src)
    out = {
        "SRC": src,
        "parent of SRC": parent,
        "inside SRC": src / "mhc",
        "link to SRC": tmp_path / "link",
        "inside a link to SRC": tmp_path / "link" / "mhc",
        "home": home,
    }[case]
    before = folder_digest(tmp_path)
    status, _, err = convert(capsys, src, out, "--overwrite", "--no-verify")
    expected = {
        "SRC": "is SRC or contains it",
        "parent of SRC": "is SRC or contains it",
        "inside SRC": "is inside SRC",
        "link to SRC": "is a symbolic link",
        "inside a link to SRC": "is inside SRC",
        "home": "is your home folder or contains it",
    }[case]
    assert_one_line_error(status, err, expected)
    assert folder_digest(tmp_path) == before and not leftovers(tmp_path) and not leftovers(src)


def test_overwrite_refuses_a_checkpoint_folder_that_holds_anything_else(tmp_path, capsys):
    """A Hub clone (``.git``), notes or training checkpoints beside the weights would go with the replaced folder."""
    save_source(tmp_path / "src", "llama")
    out = tmp_path / "out"
    assert convert(capsys, tmp_path / "src", out, "--no-verify")[0] == 0
    (out / ".git").mkdir()
    (out / ".git" / "HEAD").write_text("ref: refs/heads/main")
    (out / "NOTES.md").write_text("mine")
    (out / "checkpoint-500").mkdir()
    before = folder_digest(out)
    status, _, err = convert(capsys, tmp_path / "src", out, "--overwrite", "--no-verify")
    assert_one_line_error(status, err, "holds more than a checkpoint (.git/, NOTES.md, checkpoint-500/)")
    assert folder_digest(out) == before and (out / "checkpoint-500").is_dir()
    assert not leftovers(tmp_path)


def test_overwrite_replaces_only_a_checkpoint_folder(tmp_path, capsys):
    save_source(tmp_path / "src", "llama")
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("{}")  # a config alone is not a checkpoint
    (out / "thesis.tex").write_text("years of work")
    before = folder_digest(out)
    status, _, err = convert(capsys, tmp_path / "src", out, "--overwrite", "--no-verify")
    assert_one_line_error(status, err, "does not look like a checkpoint")
    assert folder_digest(out) == before

    (out / "thesis.tex").unlink()
    (out / "pytorch_model.bin").write_bytes(b"old weights")
    status, _, err = convert(capsys, tmp_path / "src", out, "--overwrite", "--no-verify")
    assert status == 0, err
    assert (out / "model.safetensors").is_file() and not (out / "pytorch_model.bin").exists()
    assert not leftovers(tmp_path)


KILL_BETWEEN_RENAMES = textwrap.dedent(
    """
    import os, sys
    import hf_mhc.conversion.output_safety as output_safety
    from hf_mhc.conversion import convert_checkpoint

    src, out = sys.argv[1], sys.argv[2]
    real_rename = os.rename

    def rename(old, new):
        real_rename(old, new)
        if os.path.abspath(old) == os.path.abspath(out):  # the old checkpoint was just set aside: die now
            os._exit(9)

    output_safety.os.rename = rename
    convert_checkpoint(src, out, overwrite=True, verify=False, progress=False)
    """
)


def test_a_kill_between_the_renames_of_overwrite_loses_nothing(tmp_path, capsys, caplog):
    save_source(tmp_path / "src", "qwen2")
    out = tmp_path / "out"
    save_source(out, "llama")
    old = folder_digest(out)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(
        [sys.executable, "-c", KILL_BETWEEN_RENAMES, str(tmp_path / "src"), str(out)],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert killed.returncode == 9, killed.stderr[-3000:]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(".out.hf-mhc-replaced.")]
    assert not out.exists() and len(aside) == 1 and folder_digest(aside[0]) == old

    # The next run restores the old checkpoint; without --overwrite it then keeps it.
    status, _, err = convert(capsys, tmp_path / "src", out, "--no-verify")
    assert f"restored {out} from {aside[0].name}" in err
    assert_one_line_error(status, err, "not empty", "--overwrite")
    assert folder_digest(out) == old and not leftovers(tmp_path)  # also the dead run's lock and staging folder


def test_ctrl_c_between_the_renames_of_overwrite_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    save_source(tmp_path / "src", "qwen2")
    out = tmp_path / "out"
    save_source(out, "llama")
    old = folder_digest(out)
    real_rename = os.rename

    def rename(src, dst):
        if Path(dst) == out and output_safety.STAGING_MARKER in Path(src).name:
            raise KeyboardInterrupt  # after the old checkpoint was set aside, before the new one moves in
        real_rename(src, dst)

    monkeypatch.setattr(output_safety.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(tmp_path / "src", out, overwrite=True, verify=False, progress=False)
    assert folder_digest(out) == old and not leftovers(tmp_path)


def test_an_old_checkpoint_set_aside_beside_an_existing_out_is_kept_and_named(tmp_path, capsys):
    save_source(tmp_path / "src", "llama")
    out = tmp_path / "out"
    save_source(out, "llama")
    aside = tmp_path / ".out.hf-mhc-replaced.0123456789ab"  # killed after the second rename, before the delete
    save_source(aside, "qwen2")
    kept = folder_digest(aside)
    status, _, err = convert(capsys, tmp_path / "src", out, "--no-verify", "--overwrite")
    assert status == 0, err
    assert f"hf-mhc convert: warning: {aside} holds an earlier checkpoint of {out}" in err
    assert folder_digest(aside) == kept and (out / "modeling_mhc.py").is_file()
