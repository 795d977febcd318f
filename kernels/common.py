"""What the kernel files share, without Triton: the residual maps' codes, CPU token chunking, autocast, small
tensor helpers. The Triton launch helpers are in ``triton_launch.py``."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

# The residual maps' codes in the kernels: the Triton kernels' MAP constexpr (coeffs_op) and the C++ decode kernels'
# kSinkhorn, kUnconstrained, kIdentity, kPermutations (cpu_decode.cpp).
MAP_CODES: dict[str, int] = {"sinkhorn": 0, "unconstrained": 1, "identity": 2, "permutations": 3}


def interpreting() -> bool:
    """Whether Triton kernels run on the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"



CPU_CHUNK_BYTES = 4 * 2**20  # float32 working set of one token chunk of a torch kernel (token_slices)


def token_slices(tokens: int, bytes_per_token: int) -> Iterator[slice]:
    """Token ranges of about ``CPU_CHUNK_BYTES`` of float32 working set each (at least one token), for a torch kernel
    that makes several passes over temporaries: they stay in cache and come from reused heap memory instead of fresh,
    page-faulting allocations the size of all the streams."""
    step = max(1, CPU_CHUNK_BYTES // bytes_per_token)
    for start in range(0, tokens, step):
        yield slice(start, start + step)


def map_token_chunks(
    compute: Callable[..., tuple[torch.Tensor, ...]],
    inputs: tuple[torch.Tensor, ...],
    out_dtypes: tuple[torch.dtype, ...],
    bytes_per_token: int,
) -> list[torch.Tensor]:
    """``compute(*inputs)`` with its results cast to ``out_dtypes``. The inputs share their leading (token) dims with
    the streams ``inputs[0] [*lead, n, C]``, and so do the results; ``compute`` must work for any leading dims.

    float32 streams, and streams with no tokens, run in one call. Other streams (16-bit, float64) run on token chunks
    of about ``CPU_CHUNK_BYTES`` of float32 working set (``token_slices``), each chunk's results written into
    preallocated outputs: the float32 copies ``compute`` makes of its inputs then stay in cache and come from reused
    memory, instead of stream-sized fresh allocations that page-fault. float32 streams need no copies, so they are not
    chunked. Either way the results are not views, so autograd can accumulate a stream gradient into them in place.
    """
    lead = inputs[0].shape[:-2]
    tokens = math.prod(lead)
    if inputs[0].dtype == torch.float32 or tokens == 0:  # no tokens: no chunk would learn the results' shapes
        return [result.to(dtype) for result, dtype in zip(compute(*inputs), out_dtypes, strict=True)]
    flat_inputs = [tensor.reshape(tokens, *tensor.shape[len(lead):]) for tensor in inputs]
    outputs: list[torch.Tensor] = []
    flat_outputs: list[torch.Tensor] = []
    for part in token_slices(tokens, bytes_per_token):
        results = compute(*(tensor[part] for tensor in flat_inputs))
        if not outputs:
            outputs = [result.new_empty((*lead, *result.shape[1:]), dtype=dtype)
                       for result, dtype in zip(results, out_dtypes, strict=True)]
            flat_outputs = [output.view(tokens, *output.shape[len(lead):]) for output in outputs]
        for output, result in zip(flat_outputs, results, strict=True):
            output[part] = result
    return outputs




def batched_dots(matrices: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """``out[..., i] = <matrices[..., i, :], vectors[..., :]>`` for ``[..., n, C]`` and ``[..., C]``, computed as a row
    vector times the transposed matrix (on CPU the faster layout of the two)."""
    return torch.matmul(vectors.unsqueeze(-2), matrices.transpose(-1, -2)).squeeze(-2)


def zeros_if_none(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """An op's incoming gradient, or zeros where autograd passed None (the output was not used)."""
    return torch.zeros_like(like) if grad is None else grad.contiguous()


def without_autocast(function):
    """Run ``function`` with autocast off on its tensors' device: the mHC coefficient math stays float32 even inside
    ``torch.autocast`` (which would otherwise run its matmuls in bf16)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        device = next(a for a in args if isinstance(a, torch.Tensor)).device.type
        with torch.autocast(device_type=device, enabled=False):
            return function(*args, **kwargs)

    return wrapper


@dataclass(frozen=True)
class Kernels:
    """One backend's kernels: plain functions without autograd, which the custom ops of ``*_op.py`` wrap, with the
    same signatures in every backend (``sinkhorn_torch`` / ``sinkhorn_triton``, ``coeffs_torch`` / ``coeffs_triton``,
    ...)."""

    sinkhorn_forward: Callable  # (logits, iters, eps) -> comb
    sinkhorn_backward: Callable  # (logits, grad_comb, iters, eps) -> d logits
    coeffs_forward: Callable  # (streams, fn, base, scale, iters, eps, norm_eps, head, residual_map, post_magnitude)
    coeffs_backward: Callable  # (streams, fn, base, scale, mix, rstd, grads, iters, eps, head, collapse, residual_map,
    #                             post_magnitude) -> (d streams, d fn, d base, d scale)
    pre_forward: Callable  # (streams, pre) -> y
    pre_backward: Callable  # (streams, pre, d y) -> (d streams, d pre)
    pre_weights_grad: Callable  # (streams, pre, d y) -> d pre
    post_res_forward: Callable  # (streams, y, post, comb, identity) -> new streams
    post_res_backward: Callable  # (streams, y, post, comb, d out, identity) -> (d streams, d y, d post, d comb)
