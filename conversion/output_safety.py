"""Writing OUT all-or-nothing for ``hf-mhc convert``: what OUT may be, one conversion per OUT, staging, recovery.

A conversion writes into a hidden staging folder beside OUT (:func:`staging_folder`) that is renamed into place
(:func:`move_into_place`) only once the checkpoint is complete and verified; on any error or interruption the staging
folder is removed and OUT is left as it was. Nothing a user has is lost:

- One conversion per OUT at a time (:func:`locked_output`): ``.OUT.hf-mhc-lock`` beside OUT is created exclusively
  and holds ``pid@host``; a second conversion to the same OUT fails at once. A lock left by a killed process on this
  host is taken over.
- The final move replaces only what was checked at the start, under the lock (:func:`check_output`): nothing (OUT
  missing, or an empty folder), or, with ``overwrite``, the same folder (same device and inode) that then looked like
  a checkpoint. An OUT that appears or changes meanwhile is left as it is and the conversion fails.
- ``overwrite`` replaces only a folder holding ``config.json`` and weight files and nothing but checkpoint files, and
  OUT may never be, contain or lie inside SRC, nor be or contain the working directory or the home folder (symbolic
  links resolved).
- With ``overwrite`` the old OUT is renamed to ``.OUT.hf-mhc-replaced.*``, the new one renamed to OUT, and only then
  the old one deleted. If the process is killed between the two renames, the next conversion to OUT renames the old
  checkpoint back (when OUT is missing) or says where it is; it never deletes it.

Every refusal raises :class:`~.errors.ConversionError`; warnings (an old checkpoint restored or kept) go to this
module's logger.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from ..processes import owner_is_dead, owner_tag
from .errors import ConversionError
from .source import COPIED_FILE_PATTERNS, COPIED_FOLDERS

STAGING_MARKER = ".hf-mhc-partial."
REPLACED_MARKER = ".hf-mhc-replaced."
LOCK_SUFFIX = ".hf-mhc-lock"
# Files in a folder that mark it as a checkpoint --overwrite may replace (besides config.json).
WEIGHT_FILE_PATTERNS: tuple[str, ...] = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
# What a checkpoint folder holds (the files a conversion writes, and those of an ordinary transformers checkpoint):
# --overwrite replaces only a folder with nothing else in it.
CHECKPOINT_FILE_PATTERNS: tuple[str, ...] = (
    "config.json", "README.md", "*.py", *WEIGHT_FILE_PATTERNS, *COPIED_FILE_PATTERNS,
)

logger = logging.getLogger(__name__)


class ExistingOutput(NamedTuple):
    """An OUT folder found at the start: its ``(st_dev, st_ino)``, and whether it was empty."""

    device_and_inode: tuple[int, int]
    empty: bool


def _device_and_inode(path: Path) -> tuple[int, int]:
    """``(st_dev, st_ino)`` of ``path`` itself (a symbolic link is not followed): what tells two folders apart."""
    stat = os.lstat(path)
    return stat.st_dev, stat.st_ino


def output_path(out: str | os.PathLike) -> Path:
    """``out`` as an absolute path ("." and "a/.." name real folders); an empty OUT is refused."""
    text = os.fspath(out)
    if not text.strip():
        raise ConversionError("OUT is empty; name the folder to create, e.g. ./my-model-mhc.")
    return Path(os.path.abspath(Path(text).expanduser()))


def foreign_entries(folder: Path) -> list[str]:
    """The entries of ``folder`` that are no part of a checkpoint (:data:`CHECKPOINT_FILE_PATTERNS`,
    :data:`~.source.COPIED_FOLDERS`): a ``.git`` folder, notes, training checkpoints, ..."""
    return sorted(
        entry.name + ("/" if entry.is_dir() else "")
        for entry in folder.iterdir()
        if not (entry.is_dir() and not entry.is_symlink() and entry.name in COPIED_FOLDERS)
        and not (entry.is_file() and any(fnmatch.fnmatch(entry.name, pattern) for pattern in CHECKPOINT_FILE_PATTERNS))
    )


def looks_like_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a ``config.json`` and weight files (``*.safetensors``, ``*.bin`` or an index)."""
    names = [entry.name for entry in folder.iterdir() if entry.is_file()]
    return "config.json" in names and any(
        fnmatch.fnmatch(name, pattern) for name in names for pattern in WEIGHT_FILE_PATTERNS
    )


def check_output(out: Path, overwrite: bool, src: Path | None = None) -> ExistingOutput | None:
    """Check that ``out`` may be written (and is not ``src``, a local SRC folder, or around it): ``None`` when it
    does not exist, else the folder the final move replaces."""
    if out.is_symlink():
        raise ConversionError(f"OUT {out} is a symbolic link; name the folder itself.")
    if out.exists() and not out.is_dir():
        raise ConversionError(f"OUT {out} exists and is a file; choose a folder path.")
    check_not_protected(out, src)
    if not out.exists():
        ancestor = out.parent
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise ConversionError(f"OUT {out} cannot be created: {ancestor} is a file.")
        return None
    empty = not any(out.iterdir())
    if not empty and not overwrite:
        raise ConversionError(
            f"OUT {out} exists and is not empty; choose a new folder or pass --overwrite "
            "(the old folder is then replaced only once the new checkpoint is complete)."
        )
    if not empty and not looks_like_checkpoint(out):
        raise ConversionError(
            f"OUT {out} is not empty and does not look like a checkpoint (a config.json and *.safetensors, *.bin or "
            "index files); --overwrite replaces only a checkpoint folder: choose a new folder, or empty it yourself."
        )
    foreign = [] if empty else foreign_entries(out)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ConversionError(
            f"OUT {out} holds more than a checkpoint ({shown}); --overwrite would delete them with the folder: move "
            "them away or choose a new folder."
        )
    return ExistingOutput(_device_and_inode(out), empty)


def check_not_protected(out: Path, src: Path | None) -> None:
    """Refuse an OUT that is, or contains, the working directory, the home folder or SRC, or that lies inside SRC."""
    real_out = Path(os.path.realpath(out))
    guarded = {"the working directory": Path.cwd()}
    try:
        guarded["your home folder"] = Path.home()
    except (KeyError, RuntimeError):  # no home folder known
        pass
    if src is not None:
        guarded["SRC"] = src
    for what, folder in guarded.items():
        real = Path(os.path.realpath(folder))
        if real_out == real or real_out in real.parents:
            raise ConversionError(
                f"OUT {out} is {what} or contains it; write the converted checkpoint to a new folder."
            )
    if src is not None and Path(os.path.realpath(src)) in real_out.parents:
        raise ConversionError(f"OUT {out} is inside SRC {src}; write the converted checkpoint to another folder.")


@contextmanager
def locked_output(out: Path, overwrite: bool) -> Iterator[ExistingOutput | None]:
    """Hold OUT's lock for the block and yield what :func:`check_output` finds under it.

    Before the check, staging folders of dead conversions to OUT are removed and an old checkpoint that a killed
    ``--overwrite`` set aside is recovered. Folders above OUT that this creates are removed again when the block
    fails.
    """
    created_parents = _missing_ancestors(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with _OutputLock(out):
            _remove_stale_staging(out)
            _recover_replaced(out)
            yield check_output(out, overwrite)
    except BaseException:
        for folder in created_parents:
            try:
                folder.rmdir()
            except OSError:
                break
        raise


@contextmanager
def staging_folder(out: Path) -> Iterator[Path]:
    """A new hidden folder beside ``out`` (same file system, so the final rename is atomic; the umask's permissions)
    to write the checkpoint into; removed with its contents when the block fails. Hand it to
    :func:`move_into_place` at the end of the block."""
    staging = out.parent / f".{out.name}{STAGING_MARKER}{owner_tag()}.{secrets.token_hex(6)}"
    try:
        staging.mkdir()
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def move_into_place(staging: Path, out: Path, existing: ExistingOutput | None) -> None:
    """Rename the finished ``staging`` folder to ``out``, replacing only ``existing`` (see :func:`check_output`).

    Without a checkpoint to replace, a single rename, which fails on a non-empty folder or a file: an OUT that
    appeared meanwhile is left as it is. A checkpoint is set aside first, checked to be the folder found at the start,
    and deleted only once the new one is in place.
    """
    if existing is not None and existing.empty:
        if os.path.lexists(out) and (_device_and_inode(out) != existing.device_and_inode or not _rmdir(out)):
            raise _appeared(out)
        existing = None
    if existing is None:
        try:
            os.rename(staging, out)
        except OSError:
            if os.path.lexists(out):
                raise _appeared(out) from None
            raise
        return
    replaced = out.parent / f".{out.name}{REPLACED_MARKER}{secrets.token_hex(6)}"
    try:
        os.rename(out, replaced)
    except FileNotFoundError:  # the old checkpoint was removed meanwhile: nothing to replace
        move_into_place(staging, out, None)
        return
    try:
        checked = _device_and_inode(replaced) == existing.device_and_inode
        if checked:
            os.rename(staging, out)
    except BaseException:  # an error or Ctrl-C between the two renames: the old checkpoint goes back
        _put_back(replaced, out)
        raise
    if not checked:  # what was set aside is not the folder checked at the start
        _put_back(replaced, out)
        raise _appeared(out)
    shutil.rmtree(replaced, ignore_errors=True)


def _missing_ancestors(out: Path) -> list[Path]:
    """Ancestors of ``out`` that do not exist yet, deepest first (removed again if the conversion fails)."""
    missing = []
    folder = out.absolute().parent
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_stale_staging(out: Path) -> None:
    """Delete staging folders for ``out`` left by conversions on this host whose process no longer exists."""
    if not out.parent.is_dir():
        return
    prefix = f".{out.name}{STAGING_MARKER}"
    for entry in out.parent.iterdir():
        if not entry.name.startswith(prefix) or not entry.is_dir() or entry.is_symlink():
            continue
        owner = entry.name[len(prefix) :].rsplit(".", 1)[0]
        if owner_is_dead(owner):
            shutil.rmtree(entry, ignore_errors=True)


class _OutputLock:
    """``.OUT.hf-mhc-lock`` beside OUT: created with ``O_EXCL``, holding ``pid@host token``; one conversion per OUT.

    A lock whose process is dead (same host) is moved aside atomically and taken over; if what was moved aside turns
    out to be a newer lock (another conversion took over first), it is linked back and this conversion fails.
    """

    def __init__(self, out: Path):
        self.out = out
        self.path = out.parent / f".{out.name}{LOCK_SUFFIX}"
        self.owner = f"{owner_tag()} {secrets.token_hex(6)}"

    def __enter__(self) -> _OutputLock:
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read_text(self.path)
                if holder is not None and not owner_is_dead(holder.split(" ")[0]):
                    raise self._busy(holder) from None
                if holder is not None:
                    self._take_over(holder)
                continue
            except OSError as error:
                raise ConversionError(
                    f"cannot write in {self.path.parent}, the folder of OUT ({error.strerror or error})."
                ) from None
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                file.write(self.owner)
            return self
        raise self._busy(_read_text(self.path) or "")

    def _take_over(self, holder: str) -> None:
        aside = self.path.with_name(f"{self.path.name}.stale.{secrets.token_hex(6)}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            if _read_text(aside) != holder:
                os.link(aside, self.path)  # a newer lock: put it back (never over a third one), and give way
                raise self._busy(_read_text(aside) or "")
        finally:
            aside.unlink(missing_ok=True)

    def _busy(self, holder: str) -> ConversionError:
        who = holder.split(" ")[0] or "starting"
        return ConversionError(
            f"another hf-mhc convert ({who}) is writing OUT {self.out}; wait for it to finish, or delete "
            f"{self.path} if no conversion is running there."
        )

    def __exit__(self, exc_type, exc, traceback) -> None:
        if _read_text(self.path) == self.owner:
            self.path.unlink(missing_ok=True)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return ""


def _recover_replaced(out: Path) -> None:
    """Old checkpoints of ``out`` that a killed ``--overwrite`` left in ``.OUT.hf-mhc-replaced.*`` (lock held).

    One, with OUT missing (or an empty folder): renamed back to OUT. Otherwise each is kept and its path logged.
    Never deleted.
    """
    prefix = f".{out.name}{REPLACED_MARKER}"
    aside = sorted(
        entry
        for entry in out.parent.iterdir()
        if entry.name.startswith(prefix) and entry.is_dir() and not entry.is_symlink()
    )
    if len(aside) == 1 and (not os.path.lexists(out) or (out.is_dir() and not out.is_symlink() and _rmdir(out))):
        os.rename(aside[0], out)
        logger.warning(
            "restored %s from %s, where an interrupted --overwrite had set the old checkpoint aside", out, aside[0].name
        )
        return
    for folder in aside:
        logger.warning(
            "%s holds an earlier checkpoint of %s that an interrupted --overwrite set aside; it is kept: move it back "
            "or delete it yourself",
            folder,
            out,
        )


def _rmdir(folder: Path) -> bool:
    """Remove ``folder`` if it is empty; whether it was."""
    try:
        folder.rmdir()
    except OSError:
        return False
    return True


def _put_back(replaced: Path, out: Path) -> None:
    """Rename ``replaced`` back to ``out``; if that fails (OUT taken meanwhile), say where it is."""
    try:
        os.rename(replaced, out)
    except OSError:
        logger.warning("%s could not be renamed back to %s; it is kept where it is", replaced, out)


def _appeared(out: Path) -> ConversionError:
    return ConversionError(
        f"OUT {out} appeared or changed while converting (another program wrote it); it was left as it is and the "
        "converted checkpoint was not kept: remove OUT or choose another folder, then convert again."
    )


__all__ = [
    "CHECKPOINT_FILE_PATTERNS",
    "ExistingOutput",
    "check_not_protected",
    "check_output",
    "foreign_entries",
    "locked_output",
    "looks_like_checkpoint",
    "move_into_place",
    "output_path",
    "staging_folder",
]
