"""`hf-mhc convert` never loses data: races on OUT, protected folders, interrupted --overwrite, links out of SRC;
and its verification, which computes the source and the result in float32 from the same weights whatever dtype
was written, and judges rounding relative to the logit scale."""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from conftest import VOCAB, assert_one_line_error, convert, leftovers, save_source, tiny_backbone_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_mhc
import hf_mhc.conversion.convert as convert_module
import hf_mhc.conversion.verify as verify_module
from hf_mhc.conversion import ConversionError, VerificationError, VerificationResult, convert_checkpoint

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
            assert folder.is_dir() and convert_module.STAGING_MARKER in folder.name
            action()
        return real(folder, *args, **kwargs)

    monkeypatch.setattr(convert_module, "write_weights", write_weights)
    return calls


# ---------------------------------------------------------------- OUT appearing or changing during a conversion


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


# ---------------------------------------------------------------- what --overwrite may replace


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


# ---------------------------------------------------------------- a kill between the two renames of --overwrite

KILL_BETWEEN_RENAMES = textwrap.dedent(
    """
    import os, sys
    import hf_mhc.conversion.convert as convert_module

    src, out = sys.argv[1], sys.argv[2]
    real_rename = os.rename

    def rename(old, new):
        real_rename(old, new)
        if os.path.abspath(old) == os.path.abspath(out):  # the old checkpoint was just set aside: die now
            os._exit(9)

    convert_module.os.rename = rename
    convert_module.convert_checkpoint(src, out, overwrite=True, verify=False, progress=False)
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
        if Path(dst) == out and convert_module.STAGING_MARKER in Path(src).name:
            raise KeyboardInterrupt  # after the old checkpoint was set aside, before the new one moves in
        real_rename(src, dst)

    monkeypatch.setattr(convert_module.os, "rename", rename)
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


# ---------------------------------------------------------------- symbolic links in SRC


@pytest.mark.parametrize(
    "link", ["tokenizer.json", "LICENSE", "model.safetensors", "config.json", "additional_chat_templates/x.jinja"]
)
def test_links_out_of_src_are_refused(tmp_path, capsys, link):
    src = tmp_path / "src"
    save_source(src, "llama", tied=True)
    secret = tmp_path / "elsewhere" / "secret"
    secret.parent.mkdir()
    target = src / link
    if link in ("model.safetensors", "config.json"):  # a real weight or config file, but outside SRC
        secret.write_bytes(target.read_bytes())
        target.unlink()
    else:
        secret.write_text("not for the Hub")
        target.parent.mkdir(exist_ok=True)
    target.symlink_to(secret)
    status, _, err = convert(capsys, src, tmp_path / "out", "--no-verify")
    assert_one_line_error(status, err, f"{target} is a symbolic link to {secret}, outside SRC")
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


def hf_cache_snapshot(cache: Path, repo_id: str) -> Path:
    """A Hugging Face cache entry for ``repo_id`` laid out as ``snapshot_download`` leaves it: every file of the
    snapshot is a relative link into ``../../blobs/<sha256>``."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    model = save_source(snapshot, "llama", tied=True)
    (snapshot / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    (repo / "blobs").mkdir()
    for file in sorted(snapshot.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        file.unlink()
        file.symlink_to(Path("..", "..", "blobs", blob.name))
    return model


def test_a_hub_cache_snapshot_of_links_into_its_blobs_converts(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "hub"
    source = hf_cache_snapshot(cache, "tiny-org/linked-llama")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    snapshot = next((cache / "models--tiny-org--linked-llama" / "snapshots").iterdir())
    assert (snapshot / "model.safetensors").is_symlink()

    for src, out in (("tiny-org/linked-llama", "by-id"), (snapshot, "by-path")):
        status, _, err = convert(capsys, src, tmp_path / out, "--no-verify")
        assert status == 0, err
        copied = tmp_path / out / "tokenizer_config.json"
        assert not copied.is_symlink() and json.loads(copied.read_text()) == {"model_max_length": 128}
        converted = AutoModelForCausalLM.from_pretrained(tmp_path / out)
        ids = torch.randint(0, 101, (1, 12))
        with torch.no_grad():
            torch.testing.assert_close(converted(ids).logits, source(ids).logits, atol=1e-4, rtol=0)

    # A link of the snapshot that leaves the repo's blob store is refused like any other.
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    (snapshot / "tokenizer_config.json").unlink()
    (snapshot / "tokenizer_config.json").symlink_to(secret)
    status, _, err = convert(capsys, "tiny-org/linked-llama", tmp_path / "out3", "--no-verify")
    assert_one_line_error(status, err, "tokenizer_config.json is a symbolic link to", "outside SRC")


# ---------------------------------------------------------------- missing SRC paths


@pytest.mark.parametrize("src", ["./does-not-exist", "/tmp/hf-mhc-nope-3f", "~/hf-mhc-nope-3f", "a/b/c", "outputs/x"])
def test_a_missing_local_src_says_no_such_folder(tmp_path, capsys, monkeypatch, src):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    status, _, err = convert(capsys, src, tmp_path / "out")
    assert_one_line_error(status, err, f"no such folder: {src}")
    assert "Hub" not in err and not (tmp_path / "out").exists()


def test_a_config_transformers_cannot_build_is_one_line(tmp_path, capsys):
    save_source(tmp_path / "src", "llama")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config["num_attention_heads"] = 0
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out")
    assert_one_line_error(status, err, "config.json")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


# ---------------------------------------------------------------- verification: the same weights, in float32


def save_large_logit_llama(folder: Path) -> None:
    """A 4-layer, 128-wide random Llama whose lm_head is scaled so that its logits reach ~500: float32 rounding then
    differs by ~4e-4 between the mHC model and the source, above an absolute 1e-4 but 1e-6 of the logit scale."""
    config = tiny_backbone_config(
        "llama", vocab_size=256, hidden_size=128, intermediate_size=341, num_hidden_layers=4, num_attention_heads=4
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(600.0)
    model.save_pretrained(folder)


def save_noisy_deepseek_v3(folder: Path) -> None:
    """A 3-layer DeepSeek-V3 (MLA, a dense first layer, 8 routed experts, grouped top-2 routing, a shared expert)
    with N(0, 0.1) noise on every weight and on the routing bias, saved in float32: expert choices close enough that
    half-precision rounding flips some of them."""
    model = AutoModelForCausalLM.from_config(tiny_backbone_config("deepseek_v3", num_hidden_layers=3)).eval()
    with torch.no_grad():
        routing_biases = [tensor for name, tensor in model.named_buffers() if name.endswith("e_score_correction_bias")]
        for tensor in (*model.parameters(), *routing_biases):
            tensor.add_(0.1 * torch.randn_like(tensor))
    model.save_pretrained(folder)


def put_post_bias_off(monkeypatch, layer: int) -> None:
    """A conversion bug: ``layer``'s MLP post biases off by 0.01 in the HC tensors written."""
    real_tensors = convert_module.function_preserving_hc_tensors

    def wrong_init(config):
        tensors = real_tensors(config)
        tensors[f"model.layers.{layer}.ffn_hc.base"][config.hc_mult : 2 * config.hc_mult] += 0.01
        return tensors

    monkeypatch.setattr(convert_module, "function_preserving_hc_tensors", wrong_init)


def swap_tensors(monkeypatch, first: str, second: str) -> None:
    """A conversion bug: source tensors ``first`` and ``second`` written under each other's names."""
    real_plan = convert_module.plan_tensors

    def wrong_plan(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        index = {planned.spec.name: i for i, planned in enumerate(plan)}
        i, j = index[first], index[second]
        plan[i], plan[j] = replace(plan[i], source=plan[j].source), replace(plan[j], source=plan[i].source)
        return plan

    monkeypatch.setattr(convert_module, "plan_tensors", wrong_plan)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_verification_is_relative_to_the_logit_scale_in_every_dtype(tmp_path, dtype):
    save_large_logit_llama(tmp_path / "src")
    report = convert_checkpoint(tmp_path / "src", tmp_path / "out", dtype=dtype, progress=False)
    verification = report.verification
    assert verification.passed and verification.greedy_agrees, verification.summary()
    assert verification.dtype == dtype and verification.compute_dtype == "float32"
    assert (verification.rounded_tensors > 0) == (dtype != "float32")  # the source is stored in float32
    assert verification.logit_scale > 200
    assert verification.tolerance == pytest.approx(1e-4 * verification.logit_scale)
    # The case an absolute 1e-4 failed: rounding is well above it, yet a few 1e-6 of the logit scale.
    assert 1e-4 < verification.max_abs_logit_diff < 1e-5 * verification.logit_scale


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_wrong_hc_tensor_fails_verification_in_every_dtype(tmp_path, monkeypatch, dtype):
    """Layer 3's MLP post biases off by 0.01 move the logits by ~6e-4 of their scale and leave greedy decoding as it
    is; in half precision the threshold used to be 0.1 (bfloat16) or 0.02 (float16) of the scale, so it passed."""
    save_large_logit_llama(tmp_path / "src")
    put_post_bias_off(monkeypatch, layer=3)
    with pytest.raises(VerificationError, match=f"does not reproduce the source: {dtype} weights .*conversion bug"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", dtype=dtype, progress=False)
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_a_bfloat16_conversion_of_an_moe_model_verifies(tmp_path, capsys):
    """Computed in bfloat16, the mHC model's streams round differently from the source's residual stream, which flips
    expert choices of this model: on the verification prompts its logits differ from the source's by a sizeable
    fraction of their scale, and the correct conversion failed. Both computed in float32 from the same rounded
    weights agree to float32 rounding."""
    save_noisy_deepseek_v3(tmp_path / "src")
    source = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16).eval()
    mhc = hf_mhc.upcycle(source, hc_mult=4).eval()
    prompts, _ = verify_module.verification_prompts(tmp_path / "src", VOCAB)
    with torch.no_grad():
        source_logits = torch.cat([source(ids[None]).logits[0].float() for ids in prompts])
        mhc_logits = torch.cat([mhc(ids[None]).logits[0].float() for ids in prompts])
    assert (mhc_logits - source_logits).abs().max() > 0.1 * source_logits.abs().max()  # routing flips in bfloat16

    status, stdout, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--dtype", "bfloat16")
    assert status == 0, err
    rounded = len(load_file(tmp_path / "src" / "model.safetensors"))
    assert (f"Verification: bfloat16 weights against the source with {rounded} tensors rounded to bfloat16 as "
            "converted, both computed in float32, 3 prompts (token ids)") in stdout
    assert "greedy decoding of 32 tokens agrees" in stdout


MOE_CONVERSION_BUGS = {
    "post bias off": lambda monkeypatch: put_post_bias_off(monkeypatch, layer=2),
    "experts swapped": lambda monkeypatch: swap_tensors(
        monkeypatch, "model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.experts.1.gate_proj.weight"
    ),
}


@pytest.mark.parametrize("bug", MOE_CONVERSION_BUGS)
def test_a_wrong_bfloat16_conversion_of_an_moe_model_fails(tmp_path, monkeypatch, bug):
    save_noisy_deepseek_v3(tmp_path / "src")
    MOE_CONVERSION_BUGS[bug](monkeypatch)
    with pytest.raises(VerificationError, match="does not reproduce the source: bfloat16 weights .*conversion bug"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", dtype="bfloat16", progress=False)
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_verification_requires_identical_greedy_decoding_also_in_half_precision(tmp_path, capsys, monkeypatch):
    save_source(tmp_path / "src", "llama")
    real_run = verify_module._run_prompts
    runs = []

    def converted_decodes_differently(*args):
        logits, tokens = real_run(*args)
        runs.append(tokens)
        if len(runs) == 2:  # the converted model: same logits, one greedy token changed
            tokens = tokens.clone()
            tokens[0, -1] = (tokens[0, -1] + 1) % 101
        return logits, tokens

    monkeypatch.setattr(verify_module, "_run_prompts", converted_decodes_differently)
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--dtype", "bfloat16")
    assert_one_line_error(status, err, "greedy decoding of 32 tokens DIFFERS", "conversion bug")
    assert len(runs) == 2 and not (tmp_path / "out").exists()


def test_a_weight_beyond_float16_fails_verification_and_says_so(tmp_path, capsys):
    model = AutoModelForCausalLM.from_config(tiny_backbone_config("llama")).eval()
    with torch.no_grad():
        model.lm_head.weight[5, 0] = 1e5  # inf in float16
    model.save_pretrained(tmp_path / "src")
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--dtype", "float16")
    assert_one_line_error(status, err, "max |logit difference| inf", "float16 holds weights up to 65504 only")
    assert not (tmp_path / "out").exists()
    assert convert(capsys, tmp_path / "src", tmp_path / "out", "--dtype", "bfloat16")[0] == 0


def test_a_verification_passes_with_agreeing_logits_and_greedy_decoding_only():
    common = dict(dtype="bfloat16", compute_dtype="float32", rounded_tensors=12, prompts=3, prompt_source="token ids",
                  logit_scale=50.0, greedy_tokens=32)
    close = VerificationResult(max_abs_logit_diff=4e-3, greedy_agrees=True, **common)
    assert close.passed and close.tolerance == pytest.approx(5e-3)
    assert close.summary().startswith("bfloat16 weights against the source with 12 tensors rounded to bfloat16 as "
                                      "converted, both computed in float32, 3 prompts (token ids)")
    assert not VerificationResult(max_abs_logit_diff=4e-3, greedy_agrees=False, **common).passed
    assert not VerificationResult(max_abs_logit_diff=6e-3, greedy_agrees=True, **common).passed
    assert not VerificationResult(max_abs_logit_diff=math.inf, greedy_agrees=True, **common).passed
    assert verify_module.logit_tolerance(0.5) == pytest.approx(1e-4)  # max(1, scale)
    assert verify_module.logit_tolerance(300.0) == pytest.approx(3e-2)
