"""Streaming safetensors writing: a file is written tensor by tensor, chunk by chunk, never held in memory whole."""

from __future__ import annotations

import json
import math
import os
import re
import struct
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConversionError

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
TORCH_DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}

_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip
_SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*$")


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"``, ``"500MB"``, ``"1.5GiB"`` or ``"4096"``.

    Decimal units (KB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB) powers of 1024, as in
    transformers' ``max_shard_size``. Raises ``ConversionError`` for anything else or a size below one byte.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        match = _SIZE_PATTERN.match(str(size))
        unit = match.group(2).upper() if match else None
        if unit not in _SIZE_UNITS:
            raise ConversionError(
                f"invalid size {size!r}; write a number with an optional unit, e.g. '5GB', '500MB' or '2GiB'."
            )
        value = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if value < 1:
        raise ConversionError(f"invalid size {size!r}; it must be at least one byte.")
    return value


@dataclass(frozen=True)
class TensorSpec:
    """Name, dtype and shape of one tensor of a safetensors file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def aligned_order(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """``specs`` ordered by element size, largest first (otherwise stable).

    Every byte offset in the file is then a multiple of its tensor's element size, as ``safetensors`` itself
    arranges it: loaders may map a tensor straight from the file, which needs aligned offsets.
    """
    return sorted(specs, key=lambda spec: -spec.dtype.itemsize)


class SafetensorsStreamWriter:
    """Writes one safetensors file whose tensors are declared up front and whose bytes then arrive in chunks.

    The header (names, dtypes, shapes, byte offsets) goes first, so memory holds one chunk at a time. Tensors are
    written in the declared order with :meth:`write_tensor`; :meth:`close` checks that every byte arrived and
    flushes the file to disk (``fsync``), so a completed file survives a crash.
    """

    def __init__(self, path: str | os.PathLike, specs: Sequence[TensorSpec], metadata: dict[str, str] | None = None):
        if sys.byteorder != "little":
            raise ConversionError("safetensors files are little-endian; this big-endian machine cannot write them.")
        self.path = Path(path)
        self.specs = list(specs)
        header: dict[str, object] = {"__metadata__": dict(metadata or {})}
        offset = 0
        for spec in self.specs:
            if spec.dtype not in SAFETENSORS_DTYPES:
                raise ConversionError(f"tensor {spec.name} has dtype {spec.dtype}, which safetensors cannot store.")
            header[spec.name] = {
                "dtype": SAFETENSORS_DTYPES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            offset += spec.nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
        encoded += b" " * (-len(encoded) % 8)
        self.expected_size = 8 + len(encoded) + offset
        self._next = 0
        self._file = open(self.path, "wb")  # closed by close() or __exit__
        self._file.write(struct.pack("<Q", len(encoded)))
        self._file.write(encoded)

    def write_tensor(
        self, name: str, chunks: Iterable[torch.Tensor], on_bytes: Callable[[int], None] | None = None
    ) -> None:
        """Append tensor ``name`` (the next declared one) from ``chunks``: its row blocks in order, in its dtype."""
        if self._next >= len(self.specs) or self.specs[self._next].name != name:
            expected = self.specs[self._next].name if self._next < len(self.specs) else "nothing"
            raise RuntimeError(f"{self.path.name}: wrote {name}, expected {expected}.")
        spec = self.specs[self._next]
        written = 0
        for chunk in chunks:
            if chunk.dtype != spec.dtype:
                raise RuntimeError(f"{name}: chunk dtype {chunk.dtype}, declared {spec.dtype}.")
            data = chunk.contiguous().reshape(-1).view(torch.uint8).numpy()
            self._file.write(data)
            written += data.nbytes
            if on_bytes is not None:
                on_bytes(data.nbytes)
        if written != spec.nbytes:
            raise RuntimeError(f"{name}: wrote {written} bytes, declared {spec.nbytes}.")
        self._next += 1

    def close(self) -> None:
        """Check that every declared tensor was written, then flush, ``fsync`` and close the file."""
        if self._next != len(self.specs):
            missing = [spec.name for spec in self.specs[self._next :]]
            raise RuntimeError(f"{self.path.name}: tensors never written: {missing[:5]}.")
        self._file.flush()
        os.fsync(self._file.fileno())
        size = self._file.tell()
        self._file.close()
        if size != self.expected_size:
            raise RuntimeError(f"{self.path.name}: {size} bytes written, {self.expected_size} expected.")

    def __enter__(self) -> SafetensorsStreamWriter:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
        else:
            self._file.close()


__all__ = [
    "SAFETENSORS_DTYPES",
    "TORCH_DTYPES",
    "SafetensorsStreamWriter",
    "TensorSpec",
    "aligned_order",
    "parse_size",
]
