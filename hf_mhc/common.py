"""What every entry point shares (``hf-mhc`` and its subcommands, the examples, conversion, planning, PEFT): the model
dtypes the commands take, the checks run on a path before any work, and the one-line error report.

:func:`looks_like_local_path`, :func:`folder_error` and :func:`output_path_error` are the checks every entry point
(``hf-mhc``, ``examples/quickstart.py``, ``examples/finetune.py``) runs on its paths before it does any work, so that a
missing folder reads "no such folder: ..." rather than a Hub repo-id or connection error. This module imports only the
standard library and torch, so that anything in the package can import it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The model dtypes hf-mhc's commands take (``--dtype``), by name."""

EXIT_ERROR = 1
# What bad input or a bad environment raises in a command (a missing file, a config transformers rejects, a missing
# package): reported in one line, without a traceback.
BAD_INPUT_ERRORS: tuple[type[Exception], ...] = (OSError, ValueError, ImportError)


def first_line(error: BaseException) -> str:
    """The first non-empty line of ``error``'s message (its type name when it has none)."""
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[0].strip() if lines else type(error).__name__


def print_error(command: str, message: str) -> int:
    """Print ``message`` as one ``hf-mhc COMMAND: error: ...`` line on stderr (its whitespace runs made single spaces);
    return the error status, 1."""
    print(f"hf-mhc {command}: error: {' '.join(message.split())}", file=sys.stderr)
    return EXIT_ERROR


def looks_like_local_path(name: str) -> bool:
    """Whether ``name`` means a local path rather than a Hugging Face Hub repo id (``name`` or ``org/name``).

    True when it exists, is empty, starts with ``.``, ``/`` or ``~``, is absolute, has more than one ``/`` (or a
    ``\\``), or when its first component exists here (``outputs/mergd`` beside a folder ``outputs``). Every entry point
    (``hf-mhc``, the examples) uses it to say "no such folder" instead of a Hub repo-id or connection error.
    """
    if not name.strip() or name.startswith((".", "/", "~")) or os.path.isabs(name) or name.count("/") > 1:
        return True
    if "\\" in name:
        return True
    return os.path.lexists(os.path.expanduser(name)) or ("/" in name and os.path.lexists(name.split("/")[0]))


def folder_error(name: str) -> str | None:
    """``"no such folder: NAME"`` (or ``"not a folder: NAME"``) when ``name`` looks like a local path
    (:func:`looks_like_local_path`) and is no folder; ``None`` otherwise (a folder, or a Hub repo id)."""
    if not looks_like_local_path(name):
        return None
    path = Path(name).expanduser()
    if path.is_dir():
        return None
    return f"not a folder: {name}" if path.exists() else f"no such folder: {name}"


def output_path_error(name: str, *, folder: bool) -> str | None:
    """A one-line reason why ``name`` cannot be written (``None`` when it can), checked without creating it.

    ``folder=True``: a folder to create or write into; ``folder=False``: a file to create or replace (its folder is
    created as needed). Fails on an empty name, a file where a folder is needed (or the reverse), and when the
    nearest existing folder above it refuses a probe file.
    """
    if not name.strip():
        return "empty path"
    path = Path(name).expanduser().absolute()
    if path.exists():
        if folder and not path.is_dir():
            return f"{name} is a file, not a folder"
        if not folder and path.is_dir():
            return f"{name} is a folder, not a file"
    existing = path if folder else path.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"cannot create {name}: {existing} is a file"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        return f"cannot write to {existing}: {error.strerror or first_line(error)}"
    if not folder and path.exists() and not os.access(path, os.W_OK):
        return f"cannot write to {name}: permission denied"
    return None


__all__ = [
    "BAD_INPUT_ERRORS",
    "DTYPES",
    "EXIT_ERROR",
    "first_line",
    "folder_error",
    "looks_like_local_path",
    "output_path_error",
    "print_error",
]
