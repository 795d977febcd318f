"""Sinkhorn-Knopp for ``comb`` in Triton: per-token tiles in registers, forward and the exact backward.

The numbers of ``sinkhorn_torch`` (see there for the formula and its backward); the backward recomputes each step's
input from the logits in registers, so only the ``[..., n, n]`` logits are saved. ``sinkhorn_tile_forward`` /
``sinkhorn_tile_backward`` are also called by the fused coefficient kernels (``coeffs_triton``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import launch_grid, padded_streams

# Per-token Sinkhorn on [BLOCK_T, NP, NP] register tiles (NP = padded n, `valid` masks the real n x n).

@triton.jit
def _softmax_plus_eps(logits, valid, eps):
    z = tl.where(valid, logits, -1.0e30)
    z = z - tl.max(z, axis=2)[:, :, None]
    e = tl.where(valid, tl.exp(z), 0.0)
    probs = e / tl.maximum(tl.sum(e, axis=2), 1.0)[:, :, None]  # a real row sums to >= 1 (its max gives exp(0))
    return tl.where(valid, probs, 0.0)


@triton.jit
def _normalise(matrix, step, eps):
    """Step 0 and every even step normalise columns (axis 1), odd steps rows (axis 2)."""
    if step % 2 == 0:
        out = matrix / (tl.sum(matrix, axis=1)[:, None, :] + eps)
    else:
        out = matrix / (tl.sum(matrix, axis=2)[:, :, None] + eps)
    return out


@triton.jit
def sinkhorn_tile_forward(logits, valid, eps, ITERS: tl.constexpr):
    """``comb`` of a ``[BLOCK_T, NP, NP]`` tile of logits (padding stays 0)."""
    matrix = tl.where(valid, _softmax_plus_eps(logits, valid, eps) + eps, 0.0)
    for step in range(0, 2 * ITERS - 1):
        matrix = _normalise(matrix, step, eps)
    return matrix


@triton.jit
def sinkhorn_tile_backward(logits, grad_comb, valid, eps, ITERS: tl.constexpr):
    """Gradient w.r.t. a ``[BLOCK_T, NP, NP]`` tile of logits; each step's input is recomputed from the logits."""
    probs = _softmax_plus_eps(logits, valid, eps)
    grad = tl.where(valid, grad_comb, 0.0)
    n_steps = 2 * ITERS - 1
    for reverse_step in range(0, n_steps):
        step = n_steps - 1 - reverse_step
        matrix = tl.where(valid, probs + eps, 0.0)
        for earlier in range(0, step):
            matrix = _normalise(matrix, earlier, eps)
        # The two branches name their denominators apart: Triton's compiler needs a name bound in both branches of a
        # runtime `if` to have one shape (the interpreter does not check this).
        if step % 2 == 0:
            column_sums = tl.sum(matrix, axis=1)[:, None, :] + eps
            grad = (grad - tl.sum(grad * (matrix / column_sums), axis=1)[:, None, :]) / column_sums
        else:
            row_sums = tl.sum(matrix, axis=2)[:, :, None] + eps
            grad = (grad - tl.sum(grad * (matrix / row_sums), axis=2)[:, :, None]) / row_sums
        grad = tl.where(valid, grad, 0.0)  # padding must not carry gradient into the next (eps-sized) denominator
    return probs * (grad - tl.sum(grad * probs, axis=2)[:, :, None])


@triton.jit
def _tile_offsets(pid, T, N: tl.constexpr, NP: tl.constexpr, BLOCK_T: tl.constexpr):
    tokens = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = tl.arange(0, NP)
    cols = tl.arange(0, NP)
    offsets = tokens[:, None, None] * (N * N) + rows[None, :, None] * N + cols[None, None, :]
    valid = (rows[None, :, None] < N) & (cols[None, None, :] < N)
    return offsets, valid & (tokens[:, None, None] < T), valid


@triton.jit
def _sinkhorn_fwd_kernel(logits_ptr, comb_ptr, T, eps, N: tl.constexpr, NP: tl.constexpr, ITERS: tl.constexpr,
                         BLOCK_T: tl.constexpr):
    offsets, mask, valid = _tile_offsets(tl.program_id(0), T, N, NP, BLOCK_T)
    logits = tl.load(logits_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(comb_ptr + offsets, sinkhorn_tile_forward(logits, valid, eps, ITERS), mask=mask)


@triton.jit
def _sinkhorn_bwd_kernel(logits_ptr, grad_comb_ptr, grad_logits_ptr, T, eps, N: tl.constexpr, NP: tl.constexpr,
                         ITERS: tl.constexpr, BLOCK_T: tl.constexpr):
    offsets, mask, valid = _tile_offsets(tl.program_id(0), T, N, NP, BLOCK_T)
    logits = tl.load(logits_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    grad_comb = tl.load(grad_comb_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(grad_logits_ptr + offsets, sinkhorn_tile_backward(logits, grad_comb, valid, eps, ITERS), mask=mask)


SINKHORN_BLOCK_T = 16


def sinkhorn_forward(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    n = logits.shape[-1]
    flat = logits.reshape(-1, n, n).float().contiguous()
    comb = torch.empty(logits.shape, device=flat.device, dtype=torch.float32)  # the final shape: not a view
    grid, block = launch_grid(flat.shape[0], SINKHORN_BLOCK_T)
    _sinkhorn_fwd_kernel[grid](
        flat, comb, flat.shape[0], eps, N=n, NP=padded_streams(n), ITERS=iters, BLOCK_T=block
    )
    return comb


def sinkhorn_backward(logits: torch.Tensor, grad_comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    n = logits.shape[-1]
    flat = logits.reshape(-1, n, n).float().contiguous()
    grad = grad_comb.reshape(-1, n, n).float().contiguous()
    grad_logits = torch.empty(logits.shape, device=flat.device, dtype=torch.float32)
    grid, block = launch_grid(flat.shape[0], SINKHORN_BLOCK_T)
    _sinkhorn_bwd_kernel[grid](
        flat, grad, grad_logits, flat.shape[0], eps, N=n, NP=padded_streams(n), ITERS=iters, BLOCK_T=block
    )
    return grad_logits

