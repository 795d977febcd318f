"""``make test-compat``: the tests that touch transformers' internals (``pytest -m compat``) on the floor and on the
newest release of transformers that ``pyproject.toml`` admits, each in a side environment, then one summary line per
release.

A side environment is a folder (``.venv/compat/transformers-VERSION``) holding that transformers alone, installed with
``pip install --target --no-deps`` and put first on ``PYTHONPATH`` of the test run (and so of every process it
starts), over the project's venv, which brings everything else. Its requirements are checked against the venv first:
a release that needs another version of a package says so in one line instead of running.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "transformers"


def admitted_range(pyproject: Path = REPO / "pyproject.toml") -> SpecifierSet:
    """The specifier of ``transformers`` among ``pyproject.toml``'s dependencies (``>=5.24,<5.26``)."""
    for line in re.findall(r'^\s*"(transformers[<>=!~][^"]*)"', pyproject.read_text(), re.M):
        return Requirement(line).specifier
    raise SystemExit(f"test-compat: error: {pyproject} names no {PACKAGE} requirement")


def registry_versions(python: str) -> list[Version]:
    """The releases of transformers the package registry serves (``pip index versions``), newest first."""
    result = subprocess.run([python, "-m", "pip", "index", "versions", PACKAGE], capture_output=True, text=True)
    found = re.search(r"Available versions: (.*)", result.stdout)
    if result.returncode != 0 or found is None:
        reason = (result.stderr.strip().splitlines() or ["no answer"])[-1]
        raise SystemExit(f"test-compat: error: pip could not list the releases of {PACKAGE}: {reason}")
    return sorted((Version(text) for text in found.group(1).split(", ")), reverse=True)


def floor_and_newest(specifier: SpecifierSet, available: list[Version]) -> list[Version]:
    """The oldest and the newest final release ``specifier`` admits (one when they are the same)."""
    admitted = sorted(version for version in available if not version.is_prerelease and version in specifier)
    if not admitted:
        raise SystemExit(f"test-compat: error: the registry has no {PACKAGE} release in {specifier}")
    return sorted({admitted[0], admitted[-1]})


def install(python: str, version: Version, root: Path) -> Path:
    """``transformers==version`` alone into ``root/transformers-version`` (once), its requirements checked against
    the venv of ``python``; returns the folder."""
    target = root / f"{PACKAGE}-{version}"
    if not (target / ".installed").exists():
        print(f"test-compat: installing {PACKAGE} {version} into {target}", flush=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", "--upgrade", "--target", str(target),
                        f"{PACKAGE}=={version}"], check=True)
        (target / ".installed").touch()
    unmet = unmet_requirements(python, target)
    if unmet:
        raise SystemExit(f"test-compat: error: {PACKAGE} {version} needs {', '.join(unmet)}, which the venv lacks")
    return target


def unmet_requirements(python: str, target: Path) -> list[str]:
    """The requirements (extras left out) of the transformers in ``target`` that the venv of ``python`` does not
    satisfy."""
    script = ("import importlib.metadata as m, sys\n"
              "from packaging.requirements import Requirement\n"
              f"d = next(m.distributions(name={PACKAGE!r}, path=[{str(target)!r}]))\n"
              "for line in d.requires or []:\n"
              "    r = Requirement(line)\n"
              "    if r.marker is not None and not r.marker.evaluate({'extra': ''}):\n"
              "        continue\n"
              "    try:\n"
              "        v = m.version(r.name)\n"
              "    except m.PackageNotFoundError:\n"
              "        v = None\n"
              "    if v is None or not r.specifier.contains(v, prereleases=True):\n"
              "        print(f'{line} (has {v})')\n")
    result = subprocess.run([python, "-c", script], capture_output=True, text=True, check=True)
    return result.stdout.splitlines()


def run_tests(pytest: str, target: Path, arguments: list[str]) -> tuple[int, str, float]:
    """``pytest -m compat ARGUMENTS`` with ``target`` first on ``PYTHONPATH``; its exit status, closing line and
    seconds."""
    path = os.pathsep.join(entry for entry in (str(target), os.environ.get("PYTHONPATH", "")) if entry)
    started = time.monotonic()
    process = subprocess.Popen([pytest, "-q", "-m", "compat", *arguments], cwd=REPO, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONPATH": path})
    closing = ""
    for line in process.stdout:
        print(line, end="", flush=True)
        if re.search(r"\d+ (passed|failed|errors?|skipped|deselected)\b", line):
            closing = line.strip()
    return process.wait(), closing.strip("= "), time.monotonic() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="test-compat", description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", nargs="+", type=Version, metavar="VERSION",
                        help="transformers releases to run (default: the floor and the newest that pyproject admits)")
    parser.add_argument("--root", type=Path, default=REPO / ".venv" / "compat",
                        help="where the side environments go (default: .venv/compat)")
    parser.add_argument("pytest_args", nargs="*", help="more arguments for pytest (after --)")
    args = parser.parse_args(argv)
    python = sys.executable
    pytest = str(Path(python).with_name("pytest"))
    versions = args.versions or floor_and_newest(admitted_range(), registry_versions(python))
    summary = []
    for version in versions:
        target = install(python, version, args.root)
        print(f"test-compat: {PACKAGE} {version}: pytest -m compat", flush=True)
        status, closing, seconds = run_tests(pytest, target, args.pytest_args)
        summary.append((version, status, closing, seconds))
    print(f"test-compat: venv's own {PACKAGE} is {importlib.metadata.version(PACKAGE)}")
    for version, status, closing, seconds in summary:
        print(f"test-compat: {PACKAGE} {version}: {'ok' if status == 0 else 'FAILED'}: {closing} ({seconds:.0f} s)")
    return max(status for _, status, _, _ in summary)


if __name__ == "__main__":
    sys.exit(main())
