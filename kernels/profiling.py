"""Measuring memory as the benchmarks and tests report it: bytes saved for backward, bytes a KV cache holds."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Hashable, Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.multiprocessing.reductions import StorageWeakRef


def _tensors(value) -> Iterator[torch.Tensor]:
    """The tensors in ``value``: itself, or those in its tuples, lists, dicts and ``functools.partial`` bindings."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, functools.partial):
        yield from _tensors(value.args)
        yield from _tensors(value.keywords)


@contextlib.contextmanager
def _recording_checkpoint_inputs(record: Callable[[torch.Tensor], None],
                                 record_copy: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Calls ``record`` on every tensor a non-reentrant ``torch.utils.checkpoint`` keeps to recompute its region: its
    arguments, those bound in a ``functools.partial`` it runs (transformers' gradient checkpointing passes the layer's
    keyword arguments so), and, with ``preserve_rng_state`` (the default), a copy of the CPU random generator's state
    (5,056 bytes) and of each initialised device generator's, made here again and passed to ``record_copy``.
    Autograd holds them, not through ``saved_tensors_hooks``."""
    original = torch_checkpoint._checkpoint_without_reentrant_generator

    def recording(fn, preserve_rng_state=True, *args, **kwargs):
        inputs = (fn, args, kwargs)
        for tensor in _tensors(inputs):
            record(tensor)
        if preserve_rng_state:
            record_copy(torch.get_rng_state())
            device_type = torch_checkpoint._infer_device_type(*_tensors(inputs))
            if getattr(torch_checkpoint._get_device_module(device_type), "_initialized", False):
                for state in torch_checkpoint.get_device_states(*_tensors(inputs))[1]:
                    record_copy(state)
        return original(fn, preserve_rng_state, *args, **kwargs)

    torch_checkpoint._checkpoint_without_reentrant_generator = recording
    try:
        yield
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator = original


def held_for_backward(forward: Callable[[], object], exclude: tuple[torch.Tensor, ...] = (),
                      owner: Callable[[], Hashable] = lambda: None) -> dict[Hashable, int]:
    """Bytes of the distinct storages autograd holds for backward once ``forward()`` has returned, by owner.

    Held: what ops save (``saved_tensors_hooks``) and what non-reentrant checkpoints keep to recompute their regions
    (gradient checkpointing, ``hc_recompute``), counted while ``forward()``'s result is alive, so a storage saved by
    a part of the graph that was dropped (a branch that needs no gradient) counts zero. A storage held several times
    (the streams, kept by every op of an mHC site) counts once, for the ``owner()`` current when it was first held;
    the storages of ``exclude`` (the parameters, which exist anyway) count zero. Works on real and on fake tensors
    (``FakeTensorMode``: the bytes a forward would hold, without memory).
    """
    excluded = {StorageWeakRef(tensor.untyped_storage()).cdata for tensor in exclude}
    held: dict[int, tuple[StorageWeakRef, int, Hashable]] = {}
    states: list[torch.Tensor] = []  # the checkpoints' generator states: copies only they hold, kept alive here

    def hold(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        ref = StorageWeakRef(storage)
        if ref.cdata in excluded:
            return
        known = held.get(ref.cdata)
        if known is None or known[0].expired():  # a new storage, or a freed one's address reused
            held[ref.cdata] = (ref, storage.nbytes(), owner())

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        hold(tensor)
        return tensor

    def hold_copy(state: torch.Tensor) -> None:
        states.append(state)
        hold(state)

    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
          _recording_checkpoint_inputs(hold, hold_copy)):
        result = forward()
    by_owner: dict[Hashable, int] = {}
    for ref, size, who in held.values():
        if not ref.expired():
            by_owner[who] = by_owner.get(who, 0) + size
    del result
    states.clear()
    return by_owner


def saved_bytes_for_backward(forward: Callable[[], object], exclude: tuple[torch.Tensor, ...] = ()) -> int:
    """Bytes of the distinct storages autograd holds for backward once ``forward()`` has returned (see
    :func:`held_for_backward`); the storages of ``exclude`` (typically the parameters) count zero."""
    return sum(held_for_backward(forward, exclude).values())


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
