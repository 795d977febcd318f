"""Measuring what autograd keeps: bytes saved for backward, as the benchmarks and tests report them."""

from __future__ import annotations

from collections.abc import Callable

import torch


def saved_bytes_for_backward(forward: Callable[[], object], exclude: tuple[torch.Tensor, ...] = ()) -> int:
    """Bytes of the distinct storages that ``forward()`` saves for backward (``saved_tensors_hooks``).

    A storage saved by several ops (the streams, shared by every op of an mHC site) counts once; the storages of
    ``exclude`` (typically the parameters, which exist whether or not anything is saved) count zero.
    """
    excluded = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(storages.values())
