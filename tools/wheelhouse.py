"""Build a wheelhouse for an offline node: hf-mhc's own wheel and every wheel it needs that the node does not have.

    .venv/bin/python tools/wheelhouse.py [--have tools/node-freeze.txt] [--out wheelhouse] [--python-version 3.12]
        [--platform manylinux_2_28_x86_64 ...]

``--have`` is the node's ``pip freeze`` (``name==version`` lines). Starting from hf-mhc's requirements (PEFT's and
``datasets``' among them) and pytest (``make gpu-check`` runs the CUDA tests), each requirement the node already
satisfies is left out, with its own requirements (the node has them); every other one is downloaded as a binary
wheel for the target Python and platform, and its requirements are followed in turn: a project the node lacks comes
in its newest release that fits the requirements met so far, a project the node has in too old a release in the
oldest release that fits (the smallest change to the node). torch, triton and the CUDA libraries (``nvidia-*``,
``cuda-*``) are never downloaded: they are the node's own PyTorch stack, and a requirement on them that the node does
not meet is an error. On the node, ``pip install --no-index --no-deps --target DIR wheelhouse/*.whl`` installs the
wheelhouse into ``DIR``, and ``PYTHONPATH=DIR`` puts it before the node's own packages (a newer transformers there
shadows the node's).

Writes the wheels into ``--out`` (which must be empty or absent), then lists them with their sizes and the total.
A ``--have`` that is not a file, or an ``--out`` that is (or lies inside) a file, ends in one
``wheelhouse: error: ...`` line and exit status 2, before pip runs.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_HAVE = ROOT / "tools" / "node-freeze.txt"
# manylinux tags a glibc 2.28 x86_64 node runs (pip takes the listed tags only, not the older ones each implies).
DEFAULT_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                     "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]
# Beside hf-mhc's own requirements: make gpu-check's test runner.
EXTRA_REQUIREMENTS = ["pytest>=8"]
# The node's PyTorch stack, never in the wheelhouse: these projects and every project named with these prefixes.
NODE_STACK, NODE_STACK_PREFIXES = ("torch", "triton"), ("nvidia-", "cuda-")


class WheelhouseError(Exception):
    """A HAVE list, requirement or resolution the wheelhouse cannot be built from (one line)."""


def is_node_stack(name: str) -> bool:
    name = canonicalize_name(name)
    return name in NODE_STACK or name.startswith(NODE_STACK_PREFIXES)


def read_have(path: Path) -> dict[str, Version]:
    """``{canonical name: version}`` of a ``pip freeze`` file (comments and blank lines skipped)."""
    have = {}
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise WheelhouseError(f"{path}:{number}: {raw.strip()!r} is not NAME==VERSION (write pip freeze's form)")
        have[canonicalize_name(name.strip())] = Version(version.strip().split("+")[0])
    return have


def marker_environment(python_version: str) -> dict[str, str]:
    """The environment markers of CPython ``python_version`` on Linux x86_64, the wheelhouse's target."""
    return {"python_version": python_version, "python_full_version": f"{python_version}.0", "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "platform_python_implementation": "CPython", "implementation_name": "cpython", "extra": ""}


def wheel_requirements(wheel: Path, environment: dict[str, str]) -> list[Requirement]:
    """The ``Requires-Dist`` of ``wheel`` whose markers hold in ``environment`` (no extras)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        metadata = Parser().parsestr(archive.read(name).decode())
    requirements = [Requirement(text) for text in metadata.get_all("Requires-Dist") or []]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(environment)]


def pip(*args: str) -> str:
    """Run pip with ``args``; its stdout."""
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        last_line = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        raise WheelhouseError(f"{' '.join(command[2:])} failed: {last_line}")
    return result.stdout


def target_args(python_version: str, platforms: list[str]) -> list[str]:
    """pip's options that pick binary wheels for the node, not for this machine."""
    return ["--only-binary=:all:", "--python-version", python_version,
            *(arg for platform in platforms for arg in ("--platform", platform))]


def parse_version(text: str) -> Version | None:
    """``text`` as a version; None for the few old releases whose version is not PEP 440 (pip skips them too)."""
    try:
        return Version(text.strip())
    except InvalidVersion:
        return None


def oldest_release(name: str, specifier: SpecifierSet, python_version: str, platforms: list[str]) -> Version:
    """The oldest release of ``name`` with a wheel for the node that ``specifier`` allows."""
    text = pip("index", "versions", name, *target_args(python_version, platforms))
    line = next((line for line in text.splitlines() if line.startswith("Available versions:")), "")
    allowed = [v for v in map(parse_version, line.removeprefix("Available versions:").split(","))
               if v is not None and specifier.contains(v)]
    if not allowed:
        raise WheelhouseError(f"no release of {name} with a wheel for the node satisfies {specifier or 'any'}")
    return min(allowed)


def build_own_wheel(out: Path) -> Path:
    print("building hf-mhc's wheel", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        pip("wheel", "--no-deps", "--wheel-dir", scratch, str(ROOT))
        (built,) = Path(scratch).glob("hf_mhc-*.whl")
        return Path(built.replace(out / built.name))


def download(requirements: dict[str, SpecifierSet], out: Path, python_version: str,
             platforms: list[str]) -> dict[str, Path]:
    """Download one binary wheel per requirement (no dependencies) into ``out``; ``{name: wheel}``."""
    before = set(out.glob("*.whl"))
    pip("download", "--no-deps", *target_args(python_version, platforms), "--dest", str(out),
        *(f"{name}{specifier}" for name, specifier in sorted(requirements.items())))
    fetched = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in set(out.glob("*.whl")) - before}
    missing = set(requirements) - set(fetched)
    if missing:
        raise WheelhouseError(f"pip download brought no new wheel for {', '.join(sorted(missing))}")
    return fetched


def build(have: dict[str, Version], out: Path, python_version: str, platforms: list[str]) -> list[Path]:
    """Resolve and download breadth first; the wheels written into ``out``."""
    environment = marker_environment(python_version)
    own = build_own_wheel(out)
    chosen: dict[str, Version] = {"hf-mhc": parse_wheel_filename(own.name)[1]}
    pending = wheel_requirements(own, environment) + [Requirement(text) for text in EXTRA_REQUIREMENTS]
    wheels = [own]
    while pending:
        wanted: dict[str, SpecifierSet] = {}
        for requirement in pending:
            name = canonicalize_name(requirement.name)
            if name in chosen:
                if not requirement.specifier.contains(chosen[name], prereleases=True):
                    raise WheelhouseError(f"{name} {chosen[name]} was chosen, but {requirement} is required too")
            elif name in have and requirement.specifier.contains(have[name], prereleases=True):
                continue  # the node has it, and what it needs
            elif is_node_stack(name):
                found = f"has {name} {have[name]}" if name in have else f"has no {name}"
                raise WheelhouseError(f"the node {found}, but {requirement} is required; the wheelhouse never "
                                      "carries the PyTorch stack (torch, triton, CUDA libraries)")
            else:
                wanted[name] = wanted.get(name, SpecifierSet()) & requirement.specifier
        if not wanted:
            break
        for name in wanted.keys() & have.keys():  # too old on the node: the oldest release that fits
            wanted[name] = SpecifierSet(f"=={oldest_release(name, wanted[name], python_version, platforms)}")
        print(f"downloading {len(wanted)}: {', '.join(sorted(wanted))}", file=sys.stderr, flush=True)
        fetched = download(wanted, out, python_version, platforms)
        pending = []
        for name, wheel in fetched.items():
            chosen[name] = parse_wheel_filename(wheel.name)[1]
            wheels.append(wheel)
            pending += wheel_requirements(wheel, environment)
    return wheels


def listing(wheels: list[Path]) -> str:
    rows = sorted((w.stat().st_size, w.name) for w in wheels)
    lines = [f"{size / 2**20:8.2f} MiB  {name}" for size, name in reversed(rows)]
    lines.append(f"{sum(size for size, _ in rows) / 2**20:8.2f} MiB  in all, {len(rows)} wheels")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="wheelhouse", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--have", type=Path, default=DEFAULT_HAVE,
                        help="the node's pip freeze (default: tools/node-freeze.txt, a typical node)")
    parser.add_argument("--out", type=Path, default=ROOT / "wheelhouse", help="the folder to write (empty or absent)")
    parser.add_argument("--python-version", default="3.12", help="the node's Python, MAJOR.MINOR (default 3.12)")
    parser.add_argument("--platform", action="append", dest="platforms",
                        help="a wheel platform tag the node takes; repeat for several (default: manylinux x86_64 up "
                             "to glibc 2.28)")
    args = parser.parse_args(argv)
    args.platforms = args.platforms or DEFAULT_PLATFORMS
    if args.have.is_dir():
        parser.error(f"--have {args.have} is a folder; pass the node's pip freeze file (pip freeze > FILE)")
    if not args.have.is_file():
        parser.error(f"--have {args.have}: no such file; pass the node's pip freeze file (pip freeze > FILE)")
    blocking = next((path for path in (args.out, *args.out.parents) if path.exists()), None)
    if blocking is not None and not blocking.is_dir():
        what = "is a file" if blocking == args.out else f"lies inside a file, {blocking}"
        parser.error(f"--out {args.out} {what}; name a folder that is empty or absent")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.out.exists() and any(args.out.iterdir()):
            raise WheelhouseError(f"{args.out} is not empty; remove it or name another --out")
        have = read_have(args.have)
        args.out.mkdir(parents=True, exist_ok=True)
        wheels = build(have, args.out, args.python_version, args.platforms)
    except WheelhouseError as error:
        print(f"wheelhouse: error: {error}", file=sys.stderr)
        return 1
    print(f"{args.out}: for Python {args.python_version} on {args.platforms[0]}, beside {args.have.name}")
    print(listing(wheels))
    return 0


if __name__ == "__main__":
    sys.exit(main())
