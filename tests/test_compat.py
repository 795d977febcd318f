"""``hf_mhc.compat``: every private thing hf-mhc uses from its dependencies resolves on the installed releases, a
missing one fails in one line naming the release, an untested transformers warns once, the ceilings of
``pyproject.toml`` follow the tested releases, and the repository's own ``kernels/`` folder never stands in for Hugging
Face's ``kernels`` package."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import STORIES260K
from packaging.requirements import Requirement
from packaging.version import Version

from hf_mhc import compat

REPO = Path(__file__).resolve().parents[1]
# Dependencies whose private things hf-mhc uses (compat.PRIVATE_APIS), or whose range is capped at a tested release.
CAPPED = ("transformers", "accelerate", "peft", "deepspeed", "triton", "torch")


@pytest.mark.parametrize("entry", compat.PRIVATE_APIS, ids=lambda entry: entry.target)
def test_every_private_api_resolves_on_the_installed_release(entry):
    if compat.installed_version(entry.package) is None:
        pytest.skip(f"{entry.package} is not installed")
    assert compat.require(entry.target) is not None


def test_a_missing_private_api_fails_in_one_line_naming_the_release(monkeypatch):
    entry = compat.PrivateAPI("transformers", "transformers.cli.serving.server:no_such_function", "hf_mhc.serving",
                              "a test of the message")
    monkeypatch.setattr(compat, "PRIVATE_APIS", (*compat.PRIVATE_APIS, entry))
    with pytest.raises(compat.IncompatibleDependencyError) as error:
        compat.require(entry.target)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("hf_mhc.serving needs transformers.cli.serving.server.no_such_function (a test of")
    version = compat.installed_version("transformers")
    assert f"transformers {version} (hf-mhc was tested with transformers 5.24, 5.25;" in message
    with pytest.raises(KeyError, match="not in hf_mhc.compat.PRIVATE_APIS"):
        compat.require("transformers:not_listed")


def test_the_v4_norm_epsilon_reads_on_either_name():
    class Before:  # transformers 5.24's DeepseekV4UnweightedRMSNorm
        eps = 1e-6

    class After:  # 5.25's
        variance_epsilon = 1e-5

    assert compat.unweighted_norm_eps(Before()) == 1e-6
    assert compat.unweighted_norm_eps(After()) == 1e-5
    with pytest.raises(compat.IncompatibleDependencyError, match="neither of"):
        compat.unweighted_norm_eps(object())


def test_an_untested_transformers_warns_once(monkeypatch):
    monkeypatch.setattr(compat, "_WARNED", set())
    monkeypatch.setattr(compat, "installed_version", lambda package: "5.99.0")
    with pytest.warns(UserWarning) as caught:
        compat.warn_if_untested("transformers")
        compat.warn_if_untested("transformers")
    assert len(caught) == 1
    assert str(caught[0].message) == (
        "hf-mhc was tested with transformers 5.24, 5.25; this is transformers 5.99.0, on which it was not run. "
        "Report what breaks to hf-mhc's issue tracker, with this message.")
    monkeypatch.setattr(compat, "_WARNED", set())
    monkeypatch.setattr(compat, "installed_version", lambda package: "5.25.3")  # a patch release of a tested minor
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compat.warn_if_untested("transformers")


def test_import_of_hf_mhc_on_the_installed_transformers_does_not_warn():
    result = subprocess.run([sys.executable, "-W", "error::UserWarning", "-c", "import hf_mhc"], capture_output=True,
                            text=True, timeout=300, cwd=REPO / "tests")
    assert result.returncode == 0, result.stderr[-2000:]
    assert compat.is_tested("transformers")


def test_the_ceilings_of_pyproject_are_the_next_minor_after_the_newest_tested_release():
    text = (REPO / "pyproject.toml").read_text()
    requirements = [Requirement(line) for line in re.findall(r'"([a-z_-]+(?:\[\w+\])?[<>=!~][^"]*)"', text)]
    for package in CAPPED:
        specs = [spec for requirement in requirements if requirement.name == package
                 for spec in requirement.specifier]
        assert specs, f"{package} has no requirement in pyproject.toml"
        ceilings = {spec.version for spec in specs if spec.operator == "<"}
        major, minor = max(compat.TESTED[package])
        assert ceilings == {f"{major}.{minor + 1}"}, (package, ceilings)
        floors = {spec.version for spec in specs if spec.operator == ">="}
        assert all(Version(floor).release[:2] == min(compat.TESTED[package]) for floor in floors), (package, floors)


def site_packages_without_kernels(tmp_path: Path) -> Path:
    """A site folder holding links to everything of this environment's site-packages but Hugging Face's ``kernels``
    (package and metadata): the environment as it is without that package installed."""
    import torch  # of the venv's site-packages (test-compat puts another transformers first on PYTHONPATH)

    site = Path(torch.__file__).resolve().parents[1]
    linked = tmp_path / "site"
    linked.mkdir()
    for entry in site.iterdir():
        if entry.name != "kernels" and not re.fullmatch(r"kernels-[^-]+\.dist-info", entry.name):
            (linked / entry.name).symlink_to(entry)
    return linked


@pytest.mark.skipif(not STORIES260K.is_dir(), reason="needs ../shared/assets/stories260K")
@pytest.mark.parametrize("hub_kernels", ["installed", "absent"])
def test_from_the_repository_root_transformers_imports_and_loads_models(tmp_path, hub_kernels):
    """``python -c`` in the repository root puts the root on ``sys.path``, where the project's ``kernels/`` folder
    sits: transformers must import and load a model there as anywhere else, with Hugging Face's ``kernels`` package
    installed (``import kernels`` is that package) or not (an empty module that says what it is)."""
    if hub_kernels == "installed" and compat.installed_version("kernels") is None:
        pytest.skip("Hugging Face's kernels package is not installed")
    if hub_kernels == "absent" and any(Requirement(line).name == "kernels" and Requirement(line).marker is None
                                       for line in importlib.metadata.requires("transformers") or []):
        pytest.skip(f"transformers {compat.installed_version('transformers')} requires Hugging Face's kernels package")
    code = ("from transformers import AutoModelForCausalLM\n"
            f"model = AutoModelForCausalLM.from_pretrained({str(STORIES260K)!r})\n"
            "import hf_mhc, hf_mhc.kernels\n"
            "assert hf_mhc.kernels.__file__.endswith('kernels/__init__.py'), hf_mhc.kernels.__file__\n"
            "import kernels\n"
            "try:\n"
            "    kernels.get_kernel\n"
            "except AttributeError as error:\n"
            "    print('kernels:', error)\n"
            "else:\n"
            "    print('kernels:', kernels.__file__)\n")
    command = [sys.executable, "-c", code]
    if hub_kernels == "absent":
        site = site_packages_without_kernels(tmp_path)
        command = [sys.executable, "-S", "-c", f"import site; site.addsitedir({str(site)!r})\n{code}"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    line = result.stdout.strip().splitlines()[-1]
    if hub_kernels == "absent":
        assert line == ("kernels: `kernels` here is hf-mhc's kernels/ folder (the repository root is on sys.path), not "
                        "Hugging Face's `kernels` package, which is not installed; it has no 'get_kernel'")
    else:
        assert line.startswith("kernels: ") and "site-packages" in line and str(REPO / "kernels") not in line, line
