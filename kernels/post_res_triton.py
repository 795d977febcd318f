"""The merge in Triton: ``X'[i] = post[i] · y + sum_j comb[j, i] · X[j]``.

Forward, one kernel: reads ``(n+1)·C`` (the streams and ``y``) and writes ``n·C`` per token, with the coefficients in
float32. Backward, one kernel walking C once per token block: ``d X[j] = sum_i comb[j, i] · g[i]``,
``d y = sum_i post[i] · g[i]``, ``d post[i] = <g[i], y>``, ``d comb[j, i] = <X[j], g[i]>``. With ``identity``
(``comb`` empty): ``X'[i] = post[i] · y + X[i]``, no mixing work, ``d X = g`` and no ``d comb``. Reference:
``hf_mhc.mhc_reference.mhc_post_res``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import without_autocast
from .triton_launch import launch_grid

POST_RES_BLOCK_T = 4
POST_RES_BLOCK_C = 128


@triton.jit
def _mhc_post_res_fwd_kernel(x_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, T, C, N: tl.constexpr, NP: tl.constexpr,
                             BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, IDENTITY: tl.constexpr):
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    outs = tl.arange(0, NP)
    token_ok = tokens < T
    out_mask = token_ok[:, None] & (outs < N)[None, :]
    post = tl.load(post_ptr + tokens[:, None] * N + outs[None, :], mask=out_mask, other=0.0).to(tl.float32)
    c_range = tl.arange(0, BLOCK_C)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + c_range
        c_ok = c < C
        y = tl.load(y_ptr + tokens[:, None] * C + c[None, :], mask=token_ok[:, None] & c_ok[None, :], other=0.0)
        acc = post[:, :, None] * y.to(tl.float32)[:, None, :]
        offsets = (tokens[:, None, None] * N + outs[None, :, None]) * C + c[None, None, :]
        if IDENTITY:
            x = tl.load(x_ptr + offsets, mask=out_mask[:, :, None] & c_ok[None, None, :], other=0.0)
            acc += x.to(tl.float32)
        else:
            for j in tl.static_range(N):
                comb_row = tl.load(comb_ptr + tokens[:, None] * (N * N) + j * N + outs[None, :], mask=out_mask,
                                   other=0.0)
                x_j = tl.load(x_ptr + (tokens[:, None] * N + j) * C + c[None, :],
                              mask=token_ok[:, None] & c_ok[None, :], other=0.0)
                acc += comb_row.to(tl.float32)[:, :, None] * x_j.to(tl.float32)[:, None, :]
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask[:, :, None] & c_ok[None, None, :])


@triton.jit
def _mhc_post_res_bwd_kernel(x_ptr, y_ptr, post_ptr, comb_ptr, grad_out_ptr, grad_x_ptr, grad_y_ptr, grad_post_ptr,
                             grad_comb_ptr, T, C, N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_C: tl.constexpr, IDENTITY: tl.constexpr):
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    streams = tl.arange(0, NP)
    token_ok = tokens < T
    stream_mask = token_ok[:, None] & (streams < N)[None, :]
    post = tl.load(post_ptr + tokens[:, None] * N + streams[None, :], mask=stream_mask, other=0.0).to(tl.float32)
    pair_mask = stream_mask[:, :, None] & (streams < N)[None, None, :]
    pair_offsets = tokens[:, None, None] * (N * N) + streams[None, :, None] * N + streams[None, None, :]
    if not IDENTITY:
        comb = tl.load(comb_ptr + pair_offsets, mask=pair_mask, other=0.0).to(tl.float32)  # [t, j, i]
    grad_post = tl.zeros((BLOCK_T, NP), dtype=tl.float32)
    grad_comb = tl.zeros((BLOCK_T, NP, NP), dtype=tl.float32)
    c_range = tl.arange(0, BLOCK_C)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + c_range
        c_ok = c < C
        row_mask = token_ok[:, None] & c_ok[None, :]
        mask = stream_mask[:, :, None] & c_ok[None, None, :]
        offsets = (tokens[:, None, None] * N + streams[None, :, None]) * C + c[None, None, :]
        grad_out = tl.load(grad_out_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # [t, i, c]
        y = tl.load(y_ptr + tokens[:, None] * C + c[None, :], mask=row_mask, other=0.0).to(tl.float32)
        grad_post += tl.sum(grad_out * y[:, None, :], axis=2)
        grad_y = tl.sum(post[:, :, None] * grad_out, axis=1)
        tl.store(grad_y_ptr + tokens[:, None] * C + c[None, :], grad_y.to(grad_y_ptr.dtype.element_ty), mask=row_mask)
        if IDENTITY:
            tl.store(grad_x_ptr + offsets, grad_out.to(grad_x_ptr.dtype.element_ty), mask=mask)
        else:
            x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)  # [t, j, c]
            grad_comb += tl.sum(x[:, :, None, :] * grad_out[:, None, :, :], axis=3)
            grad_x = tl.sum(comb[:, :, :, None] * grad_out[:, None, :, :], axis=2)
            tl.store(grad_x_ptr + offsets, grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)
    tl.store(grad_post_ptr + tokens[:, None] * N + streams[None, :], grad_post, mask=stream_mask)
    if not IDENTITY:
        tl.store(grad_comb_ptr + pair_offsets, grad_comb, mask=pair_mask)


def _block_c(n: int) -> int:
    """Columns per step: the backward holds ``[BLOCK_T, n, n, BLOCK_C]`` products, so wide n takes narrower steps."""
    return max(16, POST_RES_BLOCK_C // triton.next_power_of_2(n))


@without_autocast
def post_res_forward(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                     identity: bool) -> torch.Tensor:
    """The new streams ``[..., n, C]`` (streams' dtype)."""
    n, hidden = streams.shape[-2:]
    x = streams.reshape(-1, n, hidden).contiguous()
    out = torch.empty(streams.shape, device=x.device, dtype=x.dtype)  # not a view: see map_token_chunks
    grid, block = launch_grid(x.shape[0], POST_RES_BLOCK_T)
    _mhc_post_res_fwd_kernel[grid](
        x, y.reshape(-1, hidden).contiguous(), post.reshape(-1, n).float().contiguous(),
        comb.reshape(-1, n * n).float().contiguous(), out, x.shape[0], hidden, N=n, NP=triton.next_power_of_2(n),
        BLOCK_T=block, BLOCK_C=POST_RES_BLOCK_C, IDENTITY=identity,
    )
    return out


@without_autocast
def post_res_backward(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                      grad_out: torch.Tensor, identity: bool) -> tuple[torch.Tensor, ...]:
    """``(d streams, d y, d post, d comb)``; ``d comb`` empty for ``identity``."""
    n, hidden = streams.shape[-2:]
    x = streams.reshape(-1, n, hidden).contiguous()
    tokens = x.shape[0]
    grad_x = torch.empty(streams.shape, device=x.device, dtype=x.dtype)
    grad_y = torch.empty(y.shape, device=x.device, dtype=y.dtype)
    grad_post = torch.empty(post.shape, device=x.device, dtype=torch.float32)
    grad_comb = torch.empty(comb.shape, device=x.device, dtype=torch.float32)  # empty for the identity map
    grid, block = launch_grid(tokens, POST_RES_BLOCK_T)
    _mhc_post_res_bwd_kernel[grid](
        x, y.reshape(-1, hidden).contiguous(), post.reshape(-1, n).float().contiguous(),
        comb.reshape(-1, n * n).float().contiguous(), grad_out.reshape(-1, n, hidden).contiguous(), grad_x, grad_y,
        grad_post, grad_comb, tokens, hidden, N=n, NP=triton.next_power_of_2(n), BLOCK_T=block, BLOCK_C=_block_c(n),
        IDENTITY=identity,
    )
    return grad_x, grad_y, grad_post, grad_comb
