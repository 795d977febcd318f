"""Measuring memory as the benchmarks and tests report it: bytes held for backward, bytes a KV cache holds."""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch.multiprocessing.reductions import StorageWeakRef

# Held while _recording_checkpoints' classes are in place: counts in two threads take turns, so each restores the
# originals it found.
_RECORDING = threading.RLock()


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


def _closure_tensors(function: Callable) -> Iterator[torch.Tensor]:
    """The tensors bound in ``function``'s closure (cells not yet assigned skipped)."""
    for cell in function.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # a variable of the enclosing function that was never assigned
            continue
        yield from _tensors(contents)


@contextlib.contextmanager
def _recording_checkpoints(record: Callable[[object, torch.Tensor], None]) -> Iterator[None]:
    """Calls ``record(holder, tensor)`` on every tensor a ``torch.utils.checkpoint`` of this thread keeps aside (not
    through ``saved_tensors_hooks``) to recompute its region, when it keeps them (grad enabled); they are held as long
    as ``holder`` lives (the checkpoint's frame, or the autograd node of a reentrant one). Non-reentrant: its
    positional arguments, and what its recomputation closure binds: the keyword arguments, the tensors of a
    ``functools.partial`` it runs (transformers' gradient checkpointing passes the layer's keyword arguments so)
    and, with ``preserve_rng_state`` (the default), the copies of the CPU random state (5,056 bytes) and of each
    initialised device generator's. Reentrant (``use_reentrant=True``): the ``partial``'s tensors and the copies of
    the random states (its tensor arguments it saves through the hooks). One thread at a time."""
    with _RECORDING:  # the originals are read, and back, before another thread takes its own
        frame_class, function_class = torch_checkpoint._CheckpointFrame, torch_checkpoint.CheckpointFunction
        thread = threading.get_ident()

        class RecordingFrame(frame_class):
            def save_inputs(self, *args):
                super().save_inputs(*args)
                if threading.get_ident() == thread:
                    for tensor in (*_tensors(args), *_closure_tensors(self.recompute_fn)):
                        record(self, tensor)

        class RecordingFunction(function_class):
            @staticmethod
            def forward(ctx, run_function, preserve_rng_state, *args):
                outputs = function_class.forward(ctx, run_function, preserve_rng_state, *args)
                if threading.get_ident() == thread:
                    kept = (run_function, getattr(ctx, "fwd_cpu_state", None), getattr(ctx, "fwd_device_states", None))
                    for tensor in _tensors(kept):
                        record(ctx, tensor)
                return outputs

        torch_checkpoint._CheckpointFrame, torch_checkpoint.CheckpointFunction = RecordingFrame, RecordingFunction
        try:
            yield
        finally:
            torch_checkpoint._CheckpointFrame, torch_checkpoint.CheckpointFunction = frame_class, function_class


def held_for_backward(forward: Callable[[], object], exclude: tuple[torch.Tensor, ...] = (),
                      owner: Callable[[], Hashable] = lambda: None) -> dict[Hashable, int]:
    """Bytes of the distinct storages autograd holds for backward once ``forward()`` has returned, by owner.

    Held: what ops save (``saved_tensors_hooks``) and what non-reentrant checkpoints keep to recompute their regions
    (gradient checkpointing, ``hc_recompute``), counted while ``forward()``'s result is alive: a storage counts while
    it lives, what only a checkpoint keeps (its keyword arguments, random states) while its graph lives. So a dropped
    part of the graph (a branch that needs no gradient) counts zero for what it saved, unless a tensor it saved
    lives on elsewhere (an input the caller still holds). A storage held several times (the streams, kept by every
    op of an mHC site) counts once, for the ``owner()`` current when it was first held; the storages of ``exclude``
    (the parameters, which exist anyway) count zero. Works on real and on fake tensors (``FakeTensorMode``: the bytes a
    forward would hold, without memory).
    """
    excluded = {StorageWeakRef(tensor.untyped_storage()).cdata for tensor in exclude}
    held: dict[int, tuple[StorageWeakRef, int, Hashable, list]] = {}

    def hold(tensor: torch.Tensor, frame: object = None) -> None:
        storage = tensor.untyped_storage()
        ref = StorageWeakRef(storage)
        if ref.cdata in excluded:
            return
        known = held.get(ref.cdata)
        if known is None or known[0].expired():  # a new storage, or a freed one's address reused
            known = held[ref.cdata] = (ref, storage.nbytes(), owner(), [])
        # Who holds it: autograd's saved tensors (None) for as long as the storage lives, or a checkpoint's frame.
        known[3].append(None if frame is None else weakref.ref(frame))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        hold(tensor)
        # The same storage, without the grad_fn: a saved output returned as is would form a reference cycle
        # (tensor, its grad_fn, the saved value) that keeps it alive after its graph is dropped. Unpacked, autograd
        # restores the grad_fn (double backward unchanged).
        return tensor.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), _recording_checkpoints(
            lambda frame, tensor: hold(tensor, frame)):
        result = forward()
    by_owner: dict[Hashable, int] = {}
    for ref, size, who, holders in held.values():
        if not ref.expired() and any(holder is None or holder() is not None for holder in holders):
            by_owner[who] = by_owner.get(who, 0) + size
    del result
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
