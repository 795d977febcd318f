"""``hf_mhc.conversion.source``: where SRC lives (a folder, a Hub id from the cache, a cache snapshot of links into
its blobs), what is refused (a missing folder, links out of SRC, damaged safetensors, pickles without
--allow-pickle or that run code), all through ``hf-mhc convert``."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from conftest import VOCAB, assert_logits_close, assert_one_line_error, convert, leftovers, save_source
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")


def test_missing_src(tmp_path, capsys):
    status, _, err = convert(capsys, tmp_path / "absent", tmp_path / "out")
    assert_one_line_error(status, err, f"no such folder: {tmp_path / 'absent'}")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("src", ["./does-not-exist", "/tmp/hf-mhc-nope-3f", "~/hf-mhc-nope-3f", "a/b/c", "outputs/x"])
def test_a_missing_local_src_says_no_such_folder(tmp_path, capsys, monkeypatch, src):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    status, _, err = convert(capsys, src, tmp_path / "out")
    assert_one_line_error(status, err, f"no such folder: {src}")
    assert "Hub" not in err and not (tmp_path / "out").exists()


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
        assert_logits_close(converted(ids).logits, source(ids).logits)

    status, _, err = convert(capsys, "tiny-org/not-in-the-cache", tmp_path / "out2")
    assert_one_line_error(status, err, "'tiny-org/not-in-the-cache'", "Hugging Face Hub")
    assert not (tmp_path / "out2").exists()


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
            assert_logits_close(converted(ids).logits, source(ids).logits)

    # A link of the snapshot that leaves the repo's blob store is refused like any other.
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    (snapshot / "tokenizer_config.json").unlink()
    (snapshot / "tokenizer_config.json").symlink_to(secret)
    status, _, err = convert(capsys, "tiny-org/linked-llama", tmp_path / "out3", "--no-verify")
    assert_one_line_error(status, err, "tokenizer_config.json is a symbolic link to", "outside SRC")


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
        assert_logits_close(converted(ids).logits, source(ids).logits)

    # A pickle that would run code when unpickled is refused, and its code never runs.
    marker = tmp_path / "code-ran"
    monkeypatch.setenv("HF_MHC_TEST_MARKER", str(marker))
    torch.save({"model.embed_tokens.weight": _Payload()}, tmp_path / "src" / "pytorch_model.bin")
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out2", "--allow-pickle")
    assert_one_line_error(status, err, "weights_only=True")
    assert not marker.exists() and not (tmp_path / "out2").exists()
