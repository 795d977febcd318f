"""``make wheelhouse`` (tools/wheelhouse.py): the wheels an offline node lacks, given its ``pip freeze``.

The end-to-end test builds the wheelhouse for this machine's Python from a HAVE list like the node's (its torch and
triton being this environment's), makes a fresh virtual environment holding only torch, triton and the packages of
that list, installs the wheelhouse with ``pip install --no-index --no-deps --target DIR`` and runs a forward pass
with ``PYTHONPATH=DIR``. It needs the package registry (skipped when unreachable); pip's cache keeps later runs short.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import import_script

ROOT = Path(__file__).resolve().parents[1]
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"


@pytest.fixture
def wheelhouse():
    return import_script(ROOT / "tools" / "wheelhouse.py")


def test_the_default_have_list_is_the_node_of_the_docs(wheelhouse):
    have = wheelhouse.read_have(wheelhouse.DEFAULT_HAVE)
    expected = {"torch": "2.11.0", "triton": "3.6.0", "accelerate": "1.15.0", "safetensors": "0.8.0",
                "huggingface-hub": "1.33.0", "tokenizers": "0.23.2", "transformers": "5.17.0"}
    assert {name: str(have[name]) for name in expected} == expected
    assert "datasets" not in have and "peft" not in have


@pytest.mark.parametrize(("line", "message"), [
    ("numpy", "'numpy' is not NAME==VERSION"),
    ("numpy>=2", "'numpy>=2' is not NAME==VERSION"),
    ("hf-mhc @ file:///src", "'hf-mhc @ file:///src' is not NAME==VERSION"),
])
def test_a_have_line_that_is_not_a_pin_is_refused_in_one_line(wheelhouse, tmp_path, capsys, line, message):
    have = tmp_path / "freeze.txt"
    have.write_text(f"# a comment\ntorch==2.11.0\n\n{line}\n")
    out = tmp_path / "wheelhouse"
    assert wheelhouse.main(["--have", str(have), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err == f"wheelhouse: error: {have}:4: {message} (write pip freeze's form)\n"
    assert not out.exists()


def test_a_non_empty_output_folder_is_refused(wheelhouse, tmp_path, capsys):
    (tmp_path / "kept.whl").write_bytes(b"")
    assert wheelhouse.main(["--out", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"wheelhouse: error: {tmp_path} is not empty; remove it or name another --out\n"
    assert [path.name for path in tmp_path.iterdir()] == ["kept.whl"]


@pytest.mark.parametrize(("have", "out", "message"), [
    ("none.txt", "wheelhouse", "--have {tmp}/none.txt: no such file; pass the node's pip freeze file (pip freeze > "
                               "FILE)"),
    (".", "wheelhouse", "--have {tmp} is a folder; pass the node's pip freeze file (pip freeze > FILE)"),
    ("freeze.txt", "file.txt", "--out {tmp}/file.txt is a file; name a folder that is empty or absent"),
    ("freeze.txt", "file.txt/wheelhouse", "--out {tmp}/file.txt/wheelhouse lies inside a file, {tmp}/file.txt; name a "
                                          "folder that is empty or absent"),
])
def test_a_have_that_is_not_a_file_or_an_out_that_is_one_is_refused_in_one_line_before_pip(
        wheelhouse, tmp_path, capsys, monkeypatch, have, out, message):
    def no_pip(*args):
        raise AssertionError(f"pip ran: {args}")

    monkeypatch.setattr(wheelhouse, "pip", no_pip)
    (tmp_path / "freeze.txt").write_text("torch==2.11.0\n")
    (tmp_path / "file.txt").write_text("kept\n")
    with pytest.raises(SystemExit) as exit_info:
        wheelhouse.main(["--have", str(tmp_path / have), "--out", str(tmp_path / out)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: wheelhouse ") and "Traceback" not in err
    assert err.splitlines()[-1] == f"wheelhouse: error: {message.format(tmp=tmp_path)}"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["file.txt", "freeze.txt"]
    assert (tmp_path / "file.txt").read_text() == "kept\n"


def test_the_pytorch_stack_is_never_downloaded(wheelhouse):
    for name in ("torch", "Triton", "nvidia-cudnn-cu13", "nvidia_cublas", "cuda-toolkit", "cuda_bindings"):
        assert wheelhouse.is_node_stack(name), name
    for name in ("torchvision", "transformers", "numpy", "tritonclient"):
        assert not wheelhouse.is_node_stack(name), name


def registry_reachable() -> bool:
    result = subprocess.run([sys.executable, "-m", "pip", "index", "versions", "iniconfig"], capture_output=True,
                            timeout=120)
    return result.returncode == 0


def node_like_have(wheelhouse, path: Path) -> dict[str, str]:
    """The default HAVE list with this environment's torch and triton instead of the node's; the list's own pins."""
    pins = {name: str(version) for name, version in wheelhouse.read_have(wheelhouse.DEFAULT_HAVE).items()
            if not wheelhouse.is_node_stack(name)}
    stack = {name: importlib.metadata.version(name).split("+")[0] for name in ("torch", "triton")}
    path.write_text("".join(f"{name}=={version}\n" for name, version in (stack | pins).items()))
    return pins


def test_a_target_install_of_the_wheelhouse_runs_hf_mhc_beside_only_torch_and_the_have_list(wheelhouse, tmp_path):
    if not registry_reachable():
        pytest.skip("the package registry is unreachable (pip index versions iniconfig failed)")
    have = tmp_path / "freeze.txt"
    pins = node_like_have(wheelhouse, have)
    out = tmp_path / "wheelhouse"
    built = subprocess.run([sys.executable, str(ROOT / "tools" / "wheelhouse.py"), "--have", str(have),
                            "--out", str(out), "--python-version", PYTHON_VERSION],
                           capture_output=True, text=True, timeout=900)
    assert built.returncode == 0, built.stderr
    wheels = {path.name.split("-")[0].lower() for path in out.glob("*.whl")}
    assert {"hf_mhc", "transformers", "peft", "datasets", "pytest"} <= wheels
    assert not {"torch", "triton"} & wheels and not any(name.startswith(("nvidia", "cuda")) for name in wheels)
    assert not {"numpy", "safetensors", "accelerate", "tokenizers"} & wheels  # the node has them
    assert built.stdout.rstrip().endswith(f"in all, {len(wheels)} wheels")

    # A fresh environment with only torch and triton (this environment's, linked) and the HAVE list's packages.
    venv = tmp_path / "node"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    site = next((venv / "lib").glob("python*/site-packages"))
    for name in ("torch", "triton"):
        distribution = importlib.metadata.distribution(name)
        for top in {Path(str(file)).parts[0] for file in distribution.files}:
            source = Path(distribution.locate_file(top))
            if source.exists() and top != "..":
                (site / top).symlink_to(source)
    node_python = str(venv / "bin" / "python")
    subprocess.run([node_python, "-m", "pip", "install", "--quiet", "--no-deps",
                    *(f"{name}=={version}" for name, version in pins.items())], check=True, timeout=900)
    target = tmp_path / "target"
    subprocess.run([node_python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target",
                    str(target), *map(str, out.glob("*.whl"))], check=True, timeout=600)

    forward = textwrap.dedent("""
        import datasets, peft, torch, transformers
        from transformers import LlamaConfig
        import hf_mhc

        assert transformers.__file__.startswith(TARGET), transformers.__file__  # the wheelhouse's, not the node's
        assert hf_mhc.__file__.startswith(TARGET), hf_mhc.__file__
        backbone = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1)
        model = hf_mhc.MHCForCausalLM(hf_mhc.MHCConfig(backbone_config=backbone, hc_mult=4))
        logits = model(torch.tensor([[1, 2, 3]])).logits
        assert logits.shape == (1, 3, 32) and torch.isfinite(logits).all()
        print(transformers.__version__)
    """).replace("TARGET", repr(str(target)))
    env = {"PATH": f"{target / 'bin'}:/usr/bin:/bin", "PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"}
    ran = subprocess.run([node_python, "-c", forward], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=env)
    assert ran.returncode == 0, ran.stderr[-4000:]
    assert ran.stdout.strip() != pins["transformers"]  # the node's older transformers is shadowed


def test_releases_whose_version_is_not_pep_440_are_passed_over(wheelhouse, monkeypatch):
    """``pip index versions`` lists every release, tqdm's ``2013-12-31`` among them: pip never picks those."""
    monkeypatch.setattr(wheelhouse, "pip", lambda *args: "tqdm (4.70.1)\nAvailable versions: 4.70.1, 4.66.3, "
                                                         "4.66.2, 2013-12-31, 1.0\n")
    oldest = wheelhouse.oldest_release("tqdm", wheelhouse.SpecifierSet(">=4.66.3"), "3.12", ["manylinux1_x86_64"])
    assert oldest == wheelhouse.Version("4.66.3")
