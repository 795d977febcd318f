"""Measuring memory as the benchmarks and tests report it: bytes saved for backward, bytes a KV cache holds."""

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


def cache_bytes(cache) -> int:
    """Bytes of every tensor the layers of a transformers ``Cache`` hold: keys and values, or the quantized states
    with their scales. A tensor subclass that wraps others (quanto's ``QTensor``, whose own ``element_size`` is the
    float dtype's) is counted by its inner tensors; a tensor reachable twice counts once."""
    seen: set[int] = set()

    def held(value) -> int:
        if isinstance(value, torch.Tensor):
            if id(value) in seen:
                return 0
            seen.add(id(value))
            if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
                names, _ = value.__tensor_flatten__()
                return sum(held(getattr(value, name)) for name in names)
            return value.numel() * value.element_size()
        if isinstance(value, (tuple, list)):
            return sum(held(item) for item in value)
        if isinstance(value, dict):
            return sum(held(item) for item in value.values())
        return 0

    return sum(held(vars(layer)) for layer in cache.layers)
