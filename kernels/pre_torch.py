"""The ``pre`` collapse in torch: ``y [..., C] = sum_i pre[i] · X[i]`` and its backward, ``d X[i] = pre[i] · g``,
``d pre[i] = <g, X[i]>``, in float32 on token chunks (``map_token_chunks``). Reference:
``hf_mhc.mhc_reference.mhc_pre``."""

from __future__ import annotations

import torch

from .common import batched_dots, map_token_chunks, without_autocast


def _collapse(x, pre):
    """``y [..., C] = sum_i pre[i] X[i]`` in float32, written into a tensor of its own (not a view)."""
    out = x.new_empty(*x.shape[:-2], x.shape[-1], dtype=torch.float32)
    torch.matmul(pre.float().unsqueeze(-2), x.float(), out=out.unsqueeze(-2))
    return (out,)


def _collapse_backward(x, pre, grad_out):
    grad32 = grad_out.float()
    return pre.float().unsqueeze(-1) * grad32.unsqueeze(-2), batched_dots(x.float(), grad32)


def _weights_grad(x, grad_out):
    """``d pre [..., n] = <g, X[i]>``."""
    return (batched_dots(x.float(), grad_out.float()),)


@without_autocast
def pre_forward(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``streams [..., n, C]``, ``pre [..., n]`` -> ``y [..., C]`` (streams' dtype)."""
    n, hidden = streams.shape[-2:]
    return map_token_chunks(_collapse, (streams, pre), (streams.dtype,), 4 * (n + 1) * hidden)[0]


@without_autocast
def pre_weights_grad(streams: torch.Tensor, pre: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """``d pre [..., n]`` (float32) from ``d y [..., C]``, without the stream gradient."""
    n, hidden = streams.shape[-2:]
    return map_token_chunks(_weights_grad, (streams, grad_out), (torch.float32,), 4 * (n + 1) * hidden)[0]


@without_autocast
def pre_backward(streams: torch.Tensor, pre: torch.Tensor, grad_out: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d streams, d pre)`` from ``d y``."""
    n, hidden = streams.shape[-2:]
    grad_streams, grad_pre = map_token_chunks(_collapse_backward, (streams, pre, grad_out),
                                              (streams.dtype, torch.float32), 4 * (2 * n + 1) * hidden)
    return grad_streams, grad_pre
