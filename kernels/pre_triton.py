"""The ``pre`` collapse in Triton: ``y [T, C] = sum_i pre[i] · X[i]``, reading ``n·C`` and writing ``C`` per token.

Backward: ``d X[i] = pre[i] · g`` and ``d pre[i] = <g, X[i]>``, one kernel that walks C once per token block, so the
reduction stays in registers. ``pre_weights_grad`` is the same kernel writing ``d pre`` only, for ``mhc_coeffs_pre``,
whose backward folds ``pre[i] · g`` into its own stream gradient. Reference: ``hf_mhc.mhc_reference.mhc_pre``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import without_autocast
from .triton_launch import launch_grid

PRE_BLOCK_T = 4
PRE_BLOCK_C = 256


@triton.jit
def _mhc_pre_fwd_kernel(x_ptr, pre_ptr, out_ptr, T, C, N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    streams = tl.arange(0, NP)
    token_ok = tokens < T
    weight_mask = token_ok[:, None] & (streams < N)[None, :]
    pre = tl.load(pre_ptr + tokens[:, None] * N + streams[None, :], mask=weight_mask, other=0.0).to(tl.float32)
    c_range = tl.arange(0, BLOCK_C)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + c_range
        mask = weight_mask[:, :, None] & (c < C)[None, None, :]
        x = tl.load(x_ptr + (tokens[:, None, None] * N + streams[None, :, None]) * C + c[None, None, :], mask=mask,
                    other=0.0)
        out = tl.sum(pre[:, :, None] * x.to(tl.float32), axis=1)
        tl.store(out_ptr + tokens[:, None] * C + c[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=token_ok[:, None] & (c < C)[None, :])


@triton.jit
def _mhc_pre_bwd_kernel(x_ptr, pre_ptr, grad_out_ptr, grad_x_ptr, grad_pre_ptr, T, C, N: tl.constexpr,
                        NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, WRITE_GRAD_X: tl.constexpr):
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    streams = tl.arange(0, NP)
    token_ok = tokens < T
    weight_mask = token_ok[:, None] & (streams < N)[None, :]
    pre = tl.load(pre_ptr + tokens[:, None] * N + streams[None, :], mask=weight_mask, other=0.0).to(tl.float32)
    grad_pre = tl.zeros((BLOCK_T, NP), dtype=tl.float32)
    c_range = tl.arange(0, BLOCK_C)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + c_range
        mask = weight_mask[:, :, None] & (c < C)[None, None, :]
        offsets = (tokens[:, None, None] * N + streams[None, :, None]) * C + c[None, None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        grad_out = tl.load(grad_out_ptr + tokens[:, None] * C + c[None, :], mask=token_ok[:, None] & (c < C)[None, :],
                           other=0.0).to(tl.float32)
        grad_pre += tl.sum(grad_out[:, None, :] * x, axis=2)
        if WRITE_GRAD_X:
            tl.store(grad_x_ptr + offsets, (pre[:, :, None] * grad_out[:, None, :]).to(grad_x_ptr.dtype.element_ty),
                     mask=mask)
    tl.store(grad_pre_ptr + tokens[:, None] * N + streams[None, :], grad_pre, mask=weight_mask)


@without_autocast
def pre_forward(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``streams [..., n, C]``, ``pre [..., n]`` -> ``y [..., C]`` (streams' dtype)."""
    n, hidden = streams.shape[-2:]
    x = streams.reshape(-1, n, hidden).contiguous()
    out = torch.empty(*streams.shape[:-2], hidden, device=x.device, dtype=x.dtype)  # not a view: see map_token_chunks
    grid, block = launch_grid(x.shape[0], PRE_BLOCK_T)
    _mhc_pre_fwd_kernel[grid](x, pre.reshape(-1, n).float().contiguous(), out, x.shape[0], hidden, N=n,
                              NP=triton.next_power_of_2(n), BLOCK_T=block, BLOCK_C=PRE_BLOCK_C)
    return out


def _backward(streams, pre, grad_out, write_grad_x):
    n, hidden = streams.shape[-2:]
    x = streams.reshape(-1, n, hidden).contiguous()
    grad_x = torch.empty(streams.shape, device=x.device, dtype=x.dtype) if write_grad_x else x.new_empty(0)
    grad_pre = torch.empty(pre.shape, device=x.device, dtype=torch.float32)
    grid, block = launch_grid(x.shape[0], PRE_BLOCK_T)
    _mhc_pre_bwd_kernel[grid](x, pre.reshape(-1, n).float().contiguous(), grad_out.reshape(-1, hidden).contiguous(),
                              grad_x, grad_pre, x.shape[0], hidden, N=n, NP=triton.next_power_of_2(n), BLOCK_T=block,
                              BLOCK_C=PRE_BLOCK_C, WRITE_GRAD_X=write_grad_x)
    return grad_x, grad_pre


@without_autocast
def pre_weights_grad(streams: torch.Tensor, pre: torch.Tensor, grad_out: torch.Tensor) -> torch.Tensor:
    """``d pre [..., n]`` (float32) from ``d y [..., C]``, without the stream gradient."""
    return _backward(streams, pre, grad_out, write_grad_x=False)[1]


@without_autocast
def pre_backward(streams: torch.Tensor, pre: torch.Tensor, grad_out: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d streams, d pre)`` from ``d y``."""
    return _backward(streams, pre, grad_out, write_grad_x=True)
