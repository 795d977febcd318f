"""``mhc_pre``: collapse ``[T, n, C]`` streams with weights ``pre [T, n]`` into the sublayer input ``[T, C]``.

Forward reads ``n·C`` and writes ``C`` per token. Backward: ``d X[i] = pre[i] · g`` and ``d pre[i] = <g, X[i]>``, one
kernel that walks C once per token block, so the reduction stays in registers. ``pre_weights_grad`` is the same kernel
writing ``d pre`` only, for ``mhc_coeffs_pre``, whose backward folds ``pre[i] · g`` into its own stream gradient.
Saved for backward: the streams (shared with the other ops of the site) and ``pre``.
Reference: ``hf_mhc.mhc_reference.mhc_pre``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import batched_dots, launch_grid, map_token_chunks, without_autocast

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
def pre_forward(streams: torch.Tensor, pre: torch.Tensor, backend: str) -> torch.Tensor:
    n, hidden = streams.shape[-2:]
    if backend != "triton":
        return map_token_chunks(_collapse_torch, (streams, pre), (streams.dtype,), 4 * (n + 1) * hidden)[0]
    x = streams.reshape(-1, n, hidden).contiguous()
    out = torch.empty(*streams.shape[:-2], hidden, device=x.device, dtype=x.dtype)  # not a view: see map_token_chunks
    grid, block = launch_grid(x.shape[0], PRE_BLOCK_T)
    _mhc_pre_fwd_kernel[grid](x, pre.reshape(-1, n).float().contiguous(), out, x.shape[0], hidden, N=n,
                              NP=triton.next_power_of_2(n), BLOCK_T=block, BLOCK_C=PRE_BLOCK_C)
    return out


def _pre_backward_triton(streams, pre, grad_out, write_grad_x):
    n, hidden = streams.shape[-2:]
    x = streams.reshape(-1, n, hidden).contiguous()
    grad_x = torch.empty(streams.shape, device=x.device, dtype=x.dtype) if write_grad_x else x.new_empty(0)
    grad_pre = torch.empty(pre.shape, device=x.device, dtype=torch.float32)
    grid, block = launch_grid(x.shape[0], PRE_BLOCK_T)
    _mhc_pre_bwd_kernel[grid](x, pre.reshape(-1, n).float().contiguous(), grad_out.reshape(-1, hidden).contiguous(),
                              grad_x, grad_pre, x.shape[0], hidden, N=n, NP=triton.next_power_of_2(n), BLOCK_T=block,
                              BLOCK_C=PRE_BLOCK_C, WRITE_GRAD_X=write_grad_x)
    return grad_x if write_grad_x else None, grad_pre


def _collapse_torch(x, pre):
    """``y [..., C] = sum_i pre[i] X[i]`` in float32, written into a tensor of its own (not a view)."""
    out = x.new_empty(*x.shape[:-2], x.shape[-1], dtype=torch.float32)
    torch.matmul(pre.float().unsqueeze(-2), x.float(), out=out.unsqueeze(-2))
    return (out,)


def _collapse_backward_torch(x, pre, grad_out):
    grad32 = grad_out.float()
    return pre.float().unsqueeze(-1) * grad32.unsqueeze(-2), batched_dots(x.float(), grad32)


def _pre_weights_grad_torch(x, grad_out):
    """``d pre [..., n] = <g, X[i]>``."""
    return (batched_dots(x.float(), grad_out.float()),)


@without_autocast
def pre_weights_grad(streams: torch.Tensor, pre: torch.Tensor, grad_out: torch.Tensor, backend: str) -> torch.Tensor:
    """``d pre [..., n]`` (float32) from ``d out [..., C]``, without the stream gradient."""
    if backend != "triton":
        n, hidden = streams.shape[-2:]
        return map_token_chunks(_pre_weights_grad_torch, (streams, grad_out), (torch.float32,),
                                4 * (n + 1) * hidden)[0]
    return _pre_backward_triton(streams, pre, grad_out, write_grad_x=False)[1]


@without_autocast
def pre_backward(streams, pre, grad_out, backend):
    if backend != "triton":
        n, hidden = streams.shape[-2:]
        grad_streams, grad_pre = map_token_chunks(_collapse_backward_torch, (streams, pre, grad_out),
                                                  (streams.dtype, torch.float32), 4 * (2 * n + 1) * hidden)
        return grad_streams, grad_pre
    return _pre_backward_triton(streams, pre, grad_out, write_grad_x=True)


@torch.library.custom_op("hf_mhc::mhc_pre_fwd", mutates_args=())
def mhc_pre_fwd_op(streams: torch.Tensor, pre: torch.Tensor, backend: str) -> torch.Tensor:
    return pre_forward(streams, pre, backend)


@mhc_pre_fwd_op.register_fake
def _(streams, pre, backend):
    return streams.new_empty(*streams.shape[:-2], streams.shape[-1])


@torch.library.custom_op("hf_mhc::mhc_pre_bwd", mutates_args=())
def mhc_pre_bwd_op(streams: torch.Tensor, pre: torch.Tensor, grad_out: torch.Tensor,
                   backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return pre_backward(streams, pre, grad_out, backend)


@mhc_pre_bwd_op.register_fake
def _(streams, pre, grad_out, backend):
    return torch.empty_like(streams), torch.empty_like(pre, dtype=torch.float32)


def _pre_setup_context(ctx, inputs, output):
    streams, pre, backend = inputs
    ctx.save_for_backward(streams, pre)
    ctx.backend = backend


def _pre_backward(ctx, grad_out):
    streams, pre = ctx.saved_tensors
    grad_streams, grad_pre = mhc_pre_bwd_op(streams, pre, grad_out.contiguous(), ctx.backend)
    return grad_streams, grad_pre.to(pre.dtype), None


mhc_pre_fwd_op.register_autograd(_pre_backward, setup_context=_pre_setup_context)
