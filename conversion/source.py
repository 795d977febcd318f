"""The source checkpoint: where it lives (a folder or a Hub id), which tensors it holds, and reading them in chunks."""

from __future__ import annotations

import json
import math
import os
import pickle
import zipfile
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError, safe_open

from hf_mhc.common import looks_like_local_path

from .errors import ConversionError
from .safetensors_stream import TORCH_DTYPES

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
PICKLE_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"

# The source's files copied beside the converted weights: tokenizer, chat template, generation defaults, license terms.
COPIED_FILE_PATTERNS: tuple[str, ...] = (
    "LICENSE*",
    "NOTICE*",
    "USE_POLICY*",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template.json",
    "chat_template.jinja",
    "generation_config.json",
)
COPIED_FOLDERS: tuple[str, ...] = ("additional_chat_templates",)
# Bytes read through one memory map of a safetensors file before it is re-opened (see TensorReader).
REMAP_BYTES = 64 * 2**20
# What a Hub download fetches before the weights: configs, indexes, tokenizer, chat-template and license files.
HUB_METADATA_PATTERNS: tuple[str, ...] = (
    "*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja", "LICENSE*", "NOTICE*", "USE_POLICY*",
)  # fmt: skip


@dataclass(frozen=True)
class ResolvedSource:
    """A source checkpoint as a local folder (a Hub id's is its snapshot in the cache)."""

    folder: Path


def resolve_source(src: str | Path, *, allow_pickle: bool = False) -> ResolvedSource:
    """A local folder for ``src``: the folder itself, or a Hub id's snapshot (downloaded or from the cache).

    Like ``from_pretrained``, an existing path wins over a Hub id; a missing one that is written as a path
    (:func:`looks_like_local_path`) is reported as a missing folder, not looked up on the Hub. From the Hub, the config,
    index and tokenizer files come first, then only the weight files the index names (``*.bin`` only with
    ``allow_pickle``). With ``HF_HUB_OFFLINE=1`` the local Hub cache is used.
    """
    if not os.fspath(src).strip():
        raise ConversionError("SRC is empty; pass a checkpoint folder or a Hub model id such as 'org/name'.")
    path = Path(src).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConversionError(f"SRC {str(src)!r} is a file; pass the checkpoint folder that holds its config.json.")
        return ResolvedSource(path)
    if looks_like_local_path(os.fspath(src)):
        raise ConversionError(f"no such folder: {src} (SRC); pass an existing checkpoint folder.")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(str(src))
    except HFValidationError:
        raise ConversionError(
            f"SRC {str(src)!r} does not exist; pass a checkpoint folder or a Hub model id such as 'org/name'."
        ) from None
    try:
        folder = Path(snapshot_download(str(src), allow_patterns=list(HUB_METADATA_PATTERNS)))
        snapshot_download(str(src), allow_patterns=hub_weight_files(folder, allow_pickle=allow_pickle))
    except OSError as error:  # huggingface_hub's HTTP, offline and cache errors all derive from OSError
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConversionError(
            f"SRC {str(src)!r} is not a local folder and could not be fetched from the Hugging Face Hub ({reason}); "
            "check the path or the model id (and HF_TOKEN for gated models, HF_HUB_OFFLINE for the cache)."
        ) from None
    return ResolvedSource(folder)


def allowed_link_roots(folder: Path) -> tuple[Path, ...]:
    """Where the files of the source folder may really live: in the folder itself and, for a Hugging Face cache
    snapshot (``models--org--name/snapshots/REVISION``, made of links into ``../../blobs/``), in that repo's blob
    store. Both are resolved (symbolic links followed)."""
    folder = Path(os.path.realpath(folder))
    roots = [folder]
    blobs = folder.parent.parent / "blobs"
    if folder.parent.name == "snapshots" and blobs.is_dir():
        roots.append(Path(os.path.realpath(blobs)))
    return tuple(roots)


def check_inside_source(path: Path, folder: Path) -> None:
    """Raise ConversionError when ``path`` (a file or folder in the source ``folder``) is a symbolic link, or lies
    under one, that leads outside the folder (and outside a cache snapshot's blob store, see
    :func:`allowed_link_roots`): nothing from elsewhere on the machine may end up in the converted checkpoint."""
    real = Path(os.path.realpath(path))
    if any(real == root or root in real.parents for root in allowed_link_roots(folder)):
        return
    raise ConversionError(
        f"{path} is a symbolic link to {real}, outside SRC; hf-mhc convert does not follow links out of the source "
        "folder, so that no file from elsewhere on this machine ends up in OUT. Copy the file into SRC (cp -L) if "
        "you mean to include it."
    )


def hub_weight_files(folder: Path, *, allow_pickle: bool) -> list[str]:
    """The weight files of a Hub snapshot whose metadata is in ``folder``: the index's shards or the single file."""
    names = [SAFE_WEIGHTS_NAME]
    if (folder / SAFE_WEIGHTS_INDEX_NAME).is_file():
        names += sorted(set(read_index(folder / SAFE_WEIGHTS_INDEX_NAME).values()))
    if allow_pickle:
        names.append(PICKLE_WEIGHTS_NAME)
        if (folder / PICKLE_WEIGHTS_INDEX_NAME).is_file():
            names += sorted(set(read_index(folder / PICKLE_WEIGHTS_INDEX_NAME).values()))
    return names


def read_index(path: Path) -> dict[str, str]:
    """The ``weight_map`` (tensor name -> shard file name) of a sharded checkpoint's index file."""
    try:
        weight_map = json.loads(path.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise ConversionError(
            f"{path} is not a valid checkpoint index ({type(error).__name__}: {error}); re-download the checkpoint."
        ) from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConversionError(f"{path} has an empty or malformed weight_map; re-download the checkpoint.")
    for name, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or file in ("", ".", ".."):
            raise ConversionError(f"{path} maps {name!r} to {file!r}, which is not a shard file name beside the index.")
    return weight_map


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of the source checkpoint: its name, the file holding it, its dtype and shape."""

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class SourceCheckpoint:
    """The weights of a source folder, inspected without reading any tensor data.

    ``tensors`` maps each name to its :class:`SourceTensor`, grouped by file in file order. Safetensors headers are
    validated here (a truncated or corrupted file fails now, not halfway through the conversion); pickled ``.bin``
    files are only opened when ``allow_pickle`` is true, and then with ``torch.load(weights_only=True)``.
    """

    folder: Path
    format: Literal["safetensors", "pickle"]
    files: tuple[str, ...]
    tensors: dict[str, SourceTensor]

    @classmethod
    def inspect(cls, folder: Path, *, allow_pickle: bool = False) -> SourceCheckpoint:
        for name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, PICKLE_WEIGHTS_NAME, PICKLE_WEIGHTS_INDEX_NAME):
            if (folder / name).exists():
                check_inside_source(folder / name, folder)
        if (folder / SAFE_WEIGHTS_NAME).is_file():
            return cls._from_files(folder, "safetensors", [SAFE_WEIGHTS_NAME], None)
        if (folder / SAFE_WEIGHTS_INDEX_NAME).is_file():
            weight_map = read_index(folder / SAFE_WEIGHTS_INDEX_NAME)
            shards = _shards_of(folder, SAFE_WEIGHTS_INDEX_NAME, weight_map)
            return cls._from_files(folder, "safetensors", shards, weight_map)
        pickled = [name for name in (PICKLE_WEIGHTS_NAME, PICKLE_WEIGHTS_INDEX_NAME) if (folder / name).is_file()]
        if pickled and not allow_pickle:
            raise ConversionError(
                f"{folder} holds pickled PyTorch weights ({pickled[0]}) and no safetensors. Unpickling can run "
                "arbitrary code, so they are not read unless you pass --allow-pickle (allow_pickle=True), which "
                "loads them with torch.load(weights_only=True)."
            )
        if (folder / PICKLE_WEIGHTS_NAME).is_file():
            return cls._from_files(folder, "pickle", [PICKLE_WEIGHTS_NAME], None)
        if (folder / PICKLE_WEIGHTS_INDEX_NAME).is_file():
            weight_map = read_index(folder / PICKLE_WEIGHTS_INDEX_NAME)
            shards = _shards_of(folder, PICKLE_WEIGHTS_INDEX_NAME, weight_map)
            return cls._from_files(folder, "pickle", shards, weight_map)
        raise ConversionError(
            f"{folder} has no weights: expected {SAFE_WEIGHTS_NAME}, or {SAFE_WEIGHTS_INDEX_NAME} and its shards."
        )

    @classmethod
    def _from_files(
        cls, folder: Path, fmt: Literal["safetensors", "pickle"], files: list[str], weight_map: dict[str, str] | None
    ) -> SourceCheckpoint:
        tensors: dict[str, SourceTensor] = {}
        for file in files:
            check_inside_source(folder / file, folder)
            for name, dtype, shape in _tensor_headers(folder / file, fmt):
                if name in tensors:
                    raise ConversionError(f"tensor {name} is stored twice, in {tensors[name].file} and {file}.")
                tensors[name] = SourceTensor(name, file, dtype, shape)
        for name, file in (weight_map or {}).items():
            if name not in tensors or tensors[name].file != file:
                raise ConversionError(
                    f"the index maps {name} to {file}, but that shard does not hold it; re-download the checkpoint."
                )
        return cls(folder, fmt, tuple(files), tensors)

    def reader(self) -> TensorReader:
        """A reader of this checkpoint's tensors, holding one source file open at a time."""
        return TensorReader(self)


def _shards_of(folder: Path, index_name: str, weight_map: dict[str, str]) -> list[str]:
    shards = sorted(set(weight_map.values()))
    missing = [shard for shard in shards if not (folder / shard).is_file()]
    if missing:
        raise ConversionError(
            f"{index_name} in {folder} lists {len(missing)} shard(s) that are missing ({', '.join(missing[:3])}); "
            "download the complete checkpoint."
        )
    return shards


def _tensor_headers(path: Path, fmt: str) -> Iterator[tuple[str, torch.dtype, tuple[int, ...]]]:
    if fmt == "pickle":
        for name, tensor in _load_pickle(path).items():
            yield name, tensor.dtype, tuple(tensor.shape)
        return
    try:
        with safe_open(path, framework="pt") as handle:
            entries = []
            for name in handle.keys():
                tensor_slice = handle.get_slice(name)
                dtype_name = tensor_slice.get_dtype()
                if dtype_name not in TORCH_DTYPES:
                    raise ConversionError(f"{path}: tensor {name} has dtype {dtype_name}, which hf-mhc cannot convert.")
                entries.append((name, TORCH_DTYPES[dtype_name], tuple(tensor_slice.get_shape())))
    except (SafetensorError, OSError) as error:
        raise ConversionError(
            f"{path} is not a readable safetensors file ({error}); it is truncated or corrupted: re-download it."
        ) from None
    yield from entries


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    try:
        # Memory-mapped where the file format allows it (zip archives), so the tensors are paged in on demand.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConversionError(
            f"{path} cannot be loaded with torch.load(weights_only=True) ({reason}); it is corrupted or holds "
            "more than tensors: re-download it or convert it to safetensors yourself."
        ) from None
    if not isinstance(state, dict) or not all(
        isinstance(name, str) and isinstance(tensor, torch.Tensor) for name, tensor in state.items()
    ):
        raise ConversionError(f"{path} is not a state dict of tensors.")
    return state


class TensorReader:
    """Reads source tensors as row blocks of bounded size, keeping one source file open at a time.

    Safetensors files are memory-mapped, and the pages read stay resident while the map is open; the file is
    re-opened after every :data:`REMAP_BYTES` read, so resident memory stays bounded whatever the shard size.
    """

    def __init__(self, checkpoint: SourceCheckpoint):
        self.checkpoint = checkpoint
        self.remap_bytes = REMAP_BYTES
        self._stack = ExitStack()
        self._open_file: str | None = None
        self._handle = None
        self._bytes_since_open = 0

    def _select(self, file: str) -> None:
        stale_map = self.checkpoint.format == "safetensors" and self._bytes_since_open >= self.remap_bytes
        if file == self._open_file and not stale_map:
            return
        self._stack.close()
        self._handle, self._open_file, self._bytes_since_open = None, None, 0
        path = self.checkpoint.folder / file
        if self.checkpoint.format == "pickle":
            self._handle = _load_pickle(path)
        else:
            try:
                self._handle = self._stack.enter_context(safe_open(path, framework="pt"))
            except (SafetensorError, OSError) as error:
                raise ConversionError(f"{path} cannot be read any more ({error}); was it changed?") from None
        self._open_file = file

    def chunks(self, tensor: SourceTensor, chunk_bytes: int) -> Iterator[torch.Tensor]:
        """``tensor`` as consecutive blocks along dim 0, each at most ``chunk_bytes`` (or one row) in memory."""
        row_bytes = math.prod(tensor.shape[1:]) * tensor.dtype.itemsize
        if not tensor.shape or tensor.shape[0] == 0 or row_bytes == 0:
            self._select(tensor.file)
            yield self._read(tensor.name, None, None)
            return
        rows_per_chunk = max(1, chunk_bytes // row_bytes)
        for start in range(0, tensor.shape[0], rows_per_chunk):
            self._select(tensor.file)
            block = self._read(tensor.name, start, min(start + rows_per_chunk, tensor.shape[0]))
            self._bytes_since_open += block.numel() * block.element_size()
            yield block

    def _read(self, name: str, start: int | None, stop: int | None) -> torch.Tensor:
        if self.checkpoint.format == "pickle":
            tensor = self._handle[name]
            return tensor if start is None else tensor[start:stop]
        try:
            if start is None:
                return self._handle.get_tensor(name)
            return self._handle.get_slice(name)[start:stop]
        except SafetensorError as error:
            raise ConversionError(f"reading {name} from {self._open_file} failed ({error}); re-download it.") from None

    def close(self) -> None:
        self._stack.close()
        self._handle, self._open_file = None, None

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self.close()


__all__ = [
    "ResolvedSource",
    "SourceCheckpoint",
    "SourceTensor",
    "TensorReader",
    "check_inside_source",
    "resolve_source",
]
