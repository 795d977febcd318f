"""Fused mHC coefficients: ``streams -> pre, post, comb`` for a sublayer, ``streams -> pre_h`` for the head.

Forward, one pass over the streams per token block: ``flat @ fn.T`` and the sum of squares together (the reordered
RMSNorm: ``RMSNorm(flat) @ fn.T == (flat @ fn.T) * rstd``), then the maps per token in registers, in float32:
sigmoid / 2·sigmoid / softmax + Sinkhorn for mHC, or another residual map (``residual_map``: scaled tanh for
``"unconstrained"``, no comb for ``"identity"``, a softmax over the ``n!`` permutation matrices for
``"permutations"``; see ``hf_mhc.mhc_reference.mhc_maps``). Saved for backward: the streams (shared with the other
ops of the site), ``mix = RMSNorm(flat) @ fn.T`` (``(n+2)·n`` floats per token for mHC) and ``rstd`` (one float per
token).

Backward: the maps' gradient w.r.t. ``mix`` (Sinkhorn recomputed, see ``sinkhorn_op``; in torch for
``"unconstrained"``, whose backward is elementwise), then
``d flat = (d mix · rstd) @ fn - (rstd² / D) · <d mix, mix> · flat`` and ``d fn = (d mix · rstd)^T @ flat``.
The reference for all of it is ``hf_mhc.mhc_reference.mhc_coeffs`` / ``mhc_head``. The head's weights are only used
through ``coeffs_pre_op`` (coefficients and collapse in one op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_mhc import mhc_reference
from hf_mhc.mhc_reference import DEFAULT_RESIDUAL_MAP, POST_MAGNITUDE

from .common import (
    MAP_CODES,
    launch_grid,
    map_token_chunks,
    padded_streams,
    token_slices,
    without_autocast,
    zeros_if_none,
)
from .sinkhorn_op import sinkhorn_backward_torch, sinkhorn_forward_torch, sinkhorn_tile_backward, sinkhorn_tile_forward

COEFFS_BLOCK_T = 16
COEFFS_BLOCK_K = 128
SHARED_MEMORY_BUDGET = 96 * 1024  # bytes per program: fits the smallest of sm_80 / 86 / 89 / 90 (99 KB on sm_86, 89)


def _block_k(n_mix: int) -> int:
    """Columns of ``flat`` per step. The ``fn`` tile ``[n_mix (padded), BLOCK_K]`` and its ``tl.dot`` operands live in
    shared memory, so wide maps (n = 8: 80 rows, padded to 128) take narrower steps to stay within
    ``SHARED_MEMORY_BUDGET``."""
    rows = max(16, triton.next_power_of_2(n_mix))
    return COEFFS_BLOCK_K if rows <= 32 else max(16, COEFFS_BLOCK_K * 32 // rows)


def _vector_width(n: int) -> int:
    """Register width of the ``pre`` / ``post`` vectors: ``tl.dot`` needs at least 16 columns."""
    return max(16, triton.next_power_of_2(n))


@triton.jit
def _map_offsets(N: tl.constexpr, NV: tl.constexpr, NP: tl.constexpr):
    """Columns of ``mix`` / rows of ``fn`` for the padded pre, post and comb register layouts, and their masks."""
    vec = tl.arange(0, NV)
    flat_pair = tl.arange(0, NP * NP)
    row, col = flat_pair // NP, flat_pair % NP
    comb_valid = (row < N) & (col < N)
    return vec, vec < N, 2 * N + row * N + col, comb_valid


@triton.jit
def _tanh(v):
    return 2.0 * tl.sigmoid(2.0 * v) - 1.0


@triton.jit
def _mhc_coeffs_fwd_kernel(
    x_ptr, fn_ptr, base_ptr, scale_ptr, perm_ptr, mix_ptr, rstd_ptr, pre_ptr, post_ptr, comb_ptr,
    T, D, norm_eps, hc_eps, post_magnitude,
    N: tl.constexpr, NV: tl.constexpr, NP: tl.constexpr, N_MIX: tl.constexpr, ITERS: tl.constexpr,
    HEAD: tl.constexpr, MAP: tl.constexpr, NF: tl.constexpr, N_PERMS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """``MAP`` (``MAP_CODES``): 0 mHC, 1 unconstrained, 2 identity (no comb columns), 3 permutations (``N_PERMS``
    weight columns, padded to ``NF``, mixed with the permutation matrices ``perm_ptr [N_PERMS, N*N]``)."""
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    token_ok = tokens < T
    vec, vec_ok, comb_rows, comb_ok = _map_offsets(N, NV, NP)
    perms = tl.arange(0, NF)
    perm_ok = perms < N_PERMS
    k_range = tl.arange(0, BLOCK_K)
    sum_sq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    acc_pre = tl.zeros((BLOCK_T, NV), dtype=tl.float32)
    acc_post = tl.zeros((BLOCK_T, NV), dtype=tl.float32)
    acc_comb = tl.zeros((BLOCK_T, NP * NP), dtype=tl.float32)
    acc_weights = tl.zeros((BLOCK_T, NF), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + k_range
        k_ok = k < D
        x = tl.load(x_ptr + tokens[:, None] * D + k[None, :], mask=token_ok[:, None] & k_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        sum_sq += tl.sum(x * x, axis=1)
        w_pre = tl.load(fn_ptr + vec[None, :] * D + k[:, None], mask=vec_ok[None, :] & k_ok[:, None], other=0.0)
        acc_pre += tl.dot(x, w_pre.to(tl.float32), input_precision="ieee")
        if not HEAD:
            w_post = tl.load(fn_ptr + (N + vec)[None, :] * D + k[:, None], mask=vec_ok[None, :] & k_ok[:, None],
                             other=0.0)
            acc_post += tl.dot(x, w_post.to(tl.float32), input_precision="ieee")
            if MAP <= 1:
                w_comb = tl.load(fn_ptr + comb_rows[None, :] * D + k[:, None], mask=comb_ok[None, :] & k_ok[:, None],
                                 other=0.0)
                acc_comb += tl.dot(x, w_comb.to(tl.float32), input_precision="ieee")
            if MAP == 3:
                w_weights = tl.load(fn_ptr + (2 * N + perms)[None, :] * D + k[:, None],
                                    mask=perm_ok[None, :] & k_ok[:, None], other=0.0)
                acc_weights += tl.dot(x, w_weights.to(tl.float32), input_precision="ieee")
    rstd = 1.0 / tl.sqrt(sum_sq / D + norm_eps)
    tl.store(rstd_ptr + tokens, rstd, mask=token_ok)

    pre_mask = token_ok[:, None] & vec_ok[None, :]
    mix_pre = acc_pre * rstd[:, None]
    tl.store(mix_ptr + tokens[:, None] * N_MIX + vec[None, :], mix_pre, mask=pre_mask)
    pre_b = tl.load(base_ptr + vec, mask=vec_ok, other=0.0)[None, :]
    if MAP == 1 and not HEAD:
        pre = tl.load(scale_ptr) * _tanh(mix_pre) + pre_b
    else:
        pre = tl.sigmoid(mix_pre * tl.load(scale_ptr) + pre_b) + hc_eps
    tl.store(pre_ptr + tokens[:, None] * N + vec[None, :], pre, mask=pre_mask)
    if not HEAD:
        mix_post = acc_post * rstd[:, None]
        tl.store(mix_ptr + tokens[:, None] * N_MIX + (N + vec)[None, :], mix_post, mask=pre_mask)
        post_b = tl.load(base_ptr + N + vec, mask=vec_ok, other=0.0)[None, :]
        if MAP == 1:
            post = tl.load(scale_ptr + 1) * _tanh(mix_post) + post_b
        elif MAP == 2:
            post = post_magnitude * tl.sigmoid(mix_post * tl.load(scale_ptr + 1) + post_b) + hc_eps
        else:
            post = 2.0 * tl.sigmoid(mix_post * tl.load(scale_ptr + 1) + post_b)
        tl.store(post_ptr + tokens[:, None] * N + vec[None, :], post, mask=pre_mask)

        comb_mask = token_ok[:, None] & comb_ok[None, :]
        comb_offsets = (comb_rows - 2 * N)[None, :] + tokens[:, None] * (N * N)
        if MAP <= 1:
            mix_comb = acc_comb * rstd[:, None]
            tl.store(mix_ptr + tokens[:, None] * N_MIX + comb_rows[None, :], mix_comb, mask=comb_mask)
            comb_b = tl.load(base_ptr + comb_rows, mask=comb_ok, other=0.0)[None, :]
            if MAP == 0:
                logits = mix_comb * tl.load(scale_ptr + 2) + comb_b
                comb = tl.reshape(sinkhorn_tile_forward(tl.reshape(logits, (BLOCK_T, NP, NP)),
                                                        tl.reshape(comb_ok, (1, NP, NP)), hc_eps, ITERS),
                                  (BLOCK_T, NP * NP))
            else:
                comb = tl.load(scale_ptr + 2) * _tanh(mix_comb) + comb_b
            tl.store(comb_ptr + comb_offsets, comb, mask=comb_mask)
        if MAP == 3:
            mix_weights = acc_weights * rstd[:, None]
            tl.store(mix_ptr + tokens[:, None] * N_MIX + (2 * N + perms)[None, :], mix_weights,
                     mask=token_ok[:, None] & perm_ok[None, :])
            z = mix_weights * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + perms, mask=perm_ok, other=0.0)
            z = tl.where(perm_ok[None, :], z, -1.0e30)
            e = tl.where(perm_ok[None, :], tl.exp(z - tl.max(z, axis=1)[:, None]), 0.0)
            weights = e / tl.sum(e, axis=1)[:, None]
            pair = comb_rows - 2 * N  # row * N + col of the real entries
            matrices = tl.load(perm_ptr + perms[:, None] * (N * N) + pair[None, :],
                               mask=perm_ok[:, None] & comb_ok[None, :], other=0.0)  # [NF, NP*NP]
            comb = tl.dot(weights, matrices, input_precision="ieee")
            tl.store(comb_ptr + comb_offsets, comb, mask=comb_mask)


@triton.jit
def _mhc_coeffs_bwd_maps_kernel(
    mix_ptr, base_ptr, scale_ptr, perm_ptr, grad_pre_ptr, grad_post_ptr, grad_comb_ptr, grad_z_ptr,
    T, hc_eps, post_magnitude,
    N: tl.constexpr, NV: tl.constexpr, NP: tl.constexpr, N_MIX: tl.constexpr, ITERS: tl.constexpr,
    HEAD: tl.constexpr, MAP: tl.constexpr, NF: tl.constexpr, N_PERMS: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """``grad_z``: gradient w.r.t. the pre-activations ``z = mix * scale + base``, laid out like ``mix``, for the maps
    that are functions of ``z`` (``MAP`` 0 mHC, 2 identity, 3 permutations; see ``_mhc_coeffs_fwd_kernel``)."""
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    token_ok = tokens < T
    vec, vec_ok, comb_rows, comb_ok = _map_offsets(N, NV, NP)
    pre_mask = token_ok[:, None] & vec_ok[None, :]
    mix_pre = tl.load(mix_ptr + tokens[:, None] * N_MIX + vec[None, :], mask=pre_mask, other=0.0)
    sig = tl.sigmoid(mix_pre * tl.load(scale_ptr) + tl.load(base_ptr + vec, mask=vec_ok, other=0.0)[None, :])
    grad_pre = tl.load(grad_pre_ptr + tokens[:, None] * N + vec[None, :], mask=pre_mask, other=0.0)
    tl.store(grad_z_ptr + tokens[:, None] * N_MIX + vec[None, :], grad_pre * sig * (1.0 - sig), mask=pre_mask)
    if not HEAD:
        mix_post = tl.load(mix_ptr + tokens[:, None] * N_MIX + (N + vec)[None, :], mask=pre_mask, other=0.0)
        post_bias = tl.load(base_ptr + N + vec, mask=vec_ok, other=0.0)
        sig = tl.sigmoid(mix_post * tl.load(scale_ptr + 1) + post_bias[None, :])
        grad_post = tl.load(grad_post_ptr + tokens[:, None] * N + vec[None, :], mask=pre_mask, other=0.0)
        magnitude = post_magnitude if MAP == 2 else 2.0
        tl.store(grad_z_ptr + tokens[:, None] * N_MIX + (N + vec)[None, :],
                 magnitude * grad_post * sig * (1.0 - sig), mask=pre_mask)

        comb_mask = token_ok[:, None] & comb_ok[None, :]
        comb_offsets = (comb_rows - 2 * N)[None, :] + tokens[:, None] * (N * N)
        if MAP == 0:
            mix_comb = tl.load(mix_ptr + tokens[:, None] * N_MIX + comb_rows[None, :], mask=comb_mask, other=0.0)
            comb_b = tl.load(base_ptr + comb_rows, mask=comb_ok, other=0.0)[None, :]
            logits = mix_comb * tl.load(scale_ptr + 2) + comb_b
            grad_comb = tl.load(grad_comb_ptr + comb_offsets, mask=comb_mask, other=0.0)
            grad_logits = sinkhorn_tile_backward(tl.reshape(logits, (BLOCK_T, NP, NP)),
                                                 tl.reshape(grad_comb, (BLOCK_T, NP, NP)),
                                                 tl.reshape(comb_ok, (1, NP, NP)), hc_eps, ITERS)
            tl.store(grad_z_ptr + tokens[:, None] * N_MIX + comb_rows[None, :],
                     tl.reshape(grad_logits, (BLOCK_T, NP * NP)), mask=comb_mask)
        if MAP == 3:  # comb = w @ P with w = softmax(z): d w = d comb @ P^T, then the softmax's backward
            perms = tl.arange(0, NF)
            perm_ok = perms < N_PERMS
            weight_mask = token_ok[:, None] & perm_ok[None, :]
            mix_weights = tl.load(mix_ptr + tokens[:, None] * N_MIX + (2 * N + perms)[None, :], mask=weight_mask,
                                  other=0.0)
            z = mix_weights * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + perms, mask=perm_ok, other=0.0)
            z = tl.where(perm_ok[None, :], z, -1.0e30)
            e = tl.where(perm_ok[None, :], tl.exp(z - tl.max(z, axis=1)[:, None]), 0.0)
            weights = e / tl.sum(e, axis=1)[:, None]
            pair = comb_rows - 2 * N
            matrices_t = tl.load(perm_ptr + perms[None, :] * (N * N) + pair[:, None],
                                 mask=perm_ok[None, :] & comb_ok[:, None], other=0.0)  # [NP*NP, NF]
            grad_comb = tl.load(grad_comb_ptr + comb_offsets, mask=comb_mask, other=0.0)
            grad_weights = tl.dot(grad_comb, matrices_t, input_precision="ieee")
            grad_z = weights * (grad_weights - tl.sum(grad_weights * weights, axis=1)[:, None])
            tl.store(grad_z_ptr + tokens[:, None] * N_MIX + (2 * N + perms)[None, :], grad_z, mask=weight_mask)


@triton.jit
def _mhc_coeffs_bwd_streams_kernel(
    x_ptr, fn_ptr, grad_raw_ptr, correction_ptr, pre_ptr, grad_y_ptr, grad_x_ptr,
    T, D, C,
    N_MIX: tl.constexpr, N_MIX_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    COLLAPSE: tl.constexpr,
):
    """``grad_x = grad_raw @ fn + correction * x`` with ``grad_raw = grad_mix * rstd`` ``[T, N_MIX]``; with
    ``COLLAPSE``, plus the ``pre`` collapse's ``pre[i] * grad_y`` (flat column ``k`` is stream ``k // C``, channel
    ``k % C``)."""
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    token_ok = tokens < T
    outs = tl.arange(0, N_MIX_P)
    outs_ok = outs < N_MIX
    grad_raw = tl.load(grad_raw_ptr + tokens[:, None] * N_MIX + outs[None, :],
                       mask=token_ok[:, None] & outs_ok[None, :], other=0.0)
    correction = tl.load(correction_ptr + tokens, mask=token_ok, other=0.0)
    k_range = tl.arange(0, BLOCK_K)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + k_range
        k_ok = k < D
        mask = token_ok[:, None] & k_ok[None, :]
        w = tl.load(fn_ptr + outs[:, None] * D + k[None, :], mask=outs_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + tokens[:, None] * D + k[None, :], mask=mask, other=0.0)
        grad_x = tl.dot(grad_raw, w.to(tl.float32), input_precision="ieee") + correction[:, None] * x.to(tl.float32)
        if COLLAPSE:
            pre = tl.load(pre_ptr + tokens[:, None] * (D // C) + k[None, :] // C, mask=mask, other=0.0)
            grad_y = tl.load(grad_y_ptr + tokens[:, None] * C + k[None, :] % C, mask=mask, other=0.0)
            grad_x += pre * grad_y.to(tl.float32)
        tl.store(grad_x_ptr + tokens[:, None] * D + k[None, :], grad_x.to(grad_x_ptr.dtype.element_ty), mask=mask)


# --- launchers and torch implementations ------------------------------------------------------------------------


def _coeffs_forward_triton(streams, fn, base, scale, iters, eps, norm_eps, head, residual_map=DEFAULT_RESIDUAL_MAP,
                           post_magnitude=POST_MAGNITUDE):
    n, hidden = streams.shape[-2:]
    x = streams.reshape(-1, n * hidden).contiguous()
    tokens = x.shape[0]
    n_mix = fn.shape[0]
    n_perms = mhc_reference.map_sizes(n, residual_map)[2] if residual_map == "permutations" else 0
    lead = streams.shape[:-2]

    def per_token(*shape):  # allocated in the final shape: the results are not views (FSDP2 units, autograd)
        return torch.empty(*lead, *shape, device=x.device, dtype=torch.float32)

    mix, rstd, pre = per_token(n_mix), per_token(), per_token(n)
    post = x.new_empty(0, dtype=torch.float32) if head else per_token(n)
    comb = x.new_empty(0, dtype=torch.float32) if head or residual_map == "identity" else per_token(n, n)
    if n_perms:
        perms = mhc_reference.permutation_matrices(n, x.device).flatten(1).contiguous()
    else:
        perms = x.new_empty(0, dtype=torch.float32)
    grid, block = launch_grid(tokens, COEFFS_BLOCK_T)
    _mhc_coeffs_fwd_kernel[grid](
        x, fn.contiguous(), base.float().contiguous(), scale.float().contiguous(), perms, mix, rstd, pre, post, comb,
        tokens, n * hidden, norm_eps, eps, float(post_magnitude),
        N=n, NV=_vector_width(n), NP=padded_streams(n), N_MIX=n_mix, ITERS=iters, HEAD=head,
        MAP=MAP_CODES[residual_map], NF=max(16, triton.next_power_of_2(max(n_perms, 1))), N_PERMS=n_perms,
        BLOCK_T=block, BLOCK_K=_block_k(n_mix),
    )
    if head:
        return pre, mix, rstd
    return pre, post, comb, mix, rstd


def _mix_torch(streams, fn, norm_eps):
    """``mix = (flat * rstd) @ fn.T`` and ``rstd``, a chunk of tokens at a time (``token_slices``). The streams are
    normalised before the product, in the reference's order of operations (so the two round alike)."""
    flat = streams.reshape(-1, streams.shape[-2] * streams.shape[-1])
    fn32 = fn.float()
    mix = flat.new_empty(flat.shape[0], fn.shape[0], dtype=torch.float32)
    rstd = flat.new_empty(flat.shape[0], dtype=torch.float32)
    for part_slice in token_slices(flat.shape[0], 4 * flat.shape[1]):
        part = flat[part_slice].float()
        part_rstd = torch.rsqrt(part.square().mean(-1) + norm_eps)
        torch.matmul(part * part_rstd.unsqueeze(-1), fn32.T, out=mix[part_slice])
        rstd[part_slice] = part_rstd
    lead = streams.shape[:-2]
    return mix.view(*lead, fn.shape[0]), rstd.view(lead)


def _column_groups(n: int, head: bool, residual_map: str = DEFAULT_RESIDUAL_MAP) -> list[int]:
    """Column groups of ``mix``, one per entry of ``scale``: ``[n]`` for the head, ``[n, n, n*n]`` (pre, post, comb)
    for an mHC sublayer, ``[n, n]`` for the identity map, ``[n, n, n!]`` for permutations."""
    return [n] if head else [size for size in mhc_reference.map_sizes(n, residual_map) if size]


def _grad_z_torch(mix, base, scale, grads, iters, eps, head, residual_map=DEFAULT_RESIDUAL_MAP,
                  post_magnitude=POST_MAGNITUDE):
    """Gradient w.r.t. the pre-activations ``z = mix * scale + base`` (layout of ``mix``), in plain torch, for the
    maps that are functions of ``z`` (all but ``"unconstrained"``)."""
    n = grads[0].shape[-1]
    z_parts = (mix * _per_column(scale, n, head, residual_map) + base.float()).split(
        _column_groups(n, head, residual_map), dim=-1)
    sig = torch.sigmoid(z_parts[0])
    grad_z = [grads[0].float() * sig * (1 - sig)]
    if not head:
        sig = torch.sigmoid(z_parts[1])
        magnitude = post_magnitude if residual_map == "identity" else 2.0
        grad_z.append(magnitude * grads[1].float() * sig * (1 - sig))
        if residual_map == "sinkhorn":
            logits = z_parts[2].unflatten(-1, (n, n))
            grad_z.append(sinkhorn_backward_torch(logits, grads[2], iters, eps).flatten(-2))
        elif residual_map == "permutations":  # comb = w @ P, w = softmax(z): d w = d comb @ P^T, then softmax's
            weights = torch.softmax(z_parts[2], dim=-1)
            grad_weights = grads[2].float().flatten(-2) @ mhc_reference.permutation_matrices(n, mix.device).flatten(1).T
            grad_z.append(weights * (grad_weights - (grad_weights * weights).sum(-1, keepdim=True)))
    return torch.cat(grad_z, dim=-1)


def _grad_z_triton(mix, base, scale, grads, iters, eps, head, residual_map=DEFAULT_RESIDUAL_MAP,
                   post_magnitude=POST_MAGNITUDE):
    n_mix = mix.shape[-1]
    n = grads[0].shape[-1]
    mix2d = mix.reshape(-1, n_mix).contiguous()
    tokens = mix2d.shape[0]
    grad_z = torch.empty_like(mix2d)
    empty = torch.empty(0, device=mix.device, dtype=torch.float32)
    grad_pre = grads[0].reshape(tokens, n).float().contiguous()
    grad_post = empty if head else grads[1].reshape(tokens, n).float().contiguous()
    has_comb = not head and residual_map != "identity"
    grad_comb = grads[2].reshape(tokens, n * n).float().contiguous() if has_comb else empty
    n_perms = n_mix - 2 * n if residual_map == "permutations" and not head else 0
    perms = mhc_reference.permutation_matrices(n, mix.device).flatten(1).contiguous() if n_perms else empty
    grid, block = launch_grid(tokens, COEFFS_BLOCK_T)
    _mhc_coeffs_bwd_maps_kernel[grid](
        mix2d, base.float().contiguous(), scale.float().contiguous(), perms, grad_pre, grad_post, grad_comb, grad_z,
        tokens, eps, float(post_magnitude), N=n, NV=_vector_width(n), NP=padded_streams(n), N_MIX=n_mix,
        ITERS=iters, HEAD=head, MAP=MAP_CODES[residual_map], NF=max(16, triton.next_power_of_2(max(n_perms, 1))),
        N_PERMS=n_perms, BLOCK_T=block,
    )
    return grad_z.view(mix.shape)


def _per_column(scale, n, head, residual_map=DEFAULT_RESIDUAL_MAP):
    """``scale`` broadcast over the columns of ``mix`` (one scale per map group)."""
    sizes = torch.tensor(_column_groups(n, head, residual_map), device=scale.device)
    return torch.repeat_interleave(scale.float(), sizes)


def _streams_and_fn_grad_torch(streams, fn, grad_raw, correction, collapse):
    """``(d streams, d fn)``: per token ``d flat = grad_raw @ fn + correction · flat`` (plus ``pre[i] · d y`` with
    ``collapse``), and ``d fn = grad_raw^T @ flat`` summed over the tokens (``map_token_chunks``)."""
    n, hidden = streams.shape[-2:]
    fn32 = fn.float()
    grad_fn = fn32.new_zeros(fn.shape)

    def chunk_grads(x, raw, corr, *pre_and_grad_y):
        x32 = x.float()
        grad = torch.empty(x.shape, dtype=torch.float32, device=x.device)  # [..., n, C], written whole below
        torch.matmul(raw, fn32, out=grad.view(*x.shape[:-2], n * hidden))
        grad.addcmul_(corr[..., None, None], x32)
        if pre_and_grad_y:
            pre, grad_y = pre_and_grad_y
            grad.addcmul_(pre.float().unsqueeze(-1), grad_y.float().unsqueeze(-2))
        flat, raw2d = x32.reshape(-1, n * hidden), raw.reshape(-1, raw.shape[-1])
        grad_fn.add_((flat.T @ raw2d).T)  # raw.T @ flat, in the operand order that BLAS runs faster on CPU
        return (grad,)

    inputs = (streams, grad_raw, correction, *(collapse or ()))
    return map_token_chunks(chunk_grads, inputs, (streams.dtype,), 4 * 2 * n * hidden)[0], grad_fn


def _streams_and_fn_grad_triton(streams, fn, grad_raw, correction, collapse):
    n, hidden = streams.shape[-2:]
    x = streams.reshape(-1, n * hidden).contiguous()
    tokens, n_mix = x.shape[0], grad_raw.shape[-1]
    grad_x = torch.empty(streams.shape, device=x.device, dtype=x.dtype)  # not a view: see map_token_chunks
    if collapse is None:
        pre, grad_y = x.new_empty(0, dtype=torch.float32), x.new_empty(0)
    else:
        pre = collapse[0].reshape(tokens, n).float().contiguous()
        grad_y = collapse[1].reshape(tokens, hidden).contiguous()
    grid, block = launch_grid(tokens, COEFFS_BLOCK_T)
    _mhc_coeffs_bwd_streams_kernel[grid](
        x, fn.float().contiguous(), grad_raw.reshape(tokens, n_mix).contiguous(),
        correction.reshape(tokens).contiguous(), pre, grad_y, grad_x, tokens, n * hidden, hidden,
        N_MIX=n_mix, N_MIX_P=max(16, triton.next_power_of_2(n_mix)), BLOCK_T=block, BLOCK_K=_block_k(n_mix),
        COLLAPSE=collapse is not None,
    )
    grad_fn = (x.float().T @ grad_raw.reshape(tokens, n_mix)).T
    return grad_x, grad_fn


@without_autocast
def coeffs_backward(streams, fn, base, scale, mix, rstd, grads, iters, eps, backend, head, collapse=None,
                    residual_map=DEFAULT_RESIDUAL_MAP, post_magnitude=POST_MAGNITUDE):
    """``(d streams, d fn, d base, d scale)`` from the gradients of the maps (``pre[, post, comb]``). ``collapse =
    (pre, d y)`` adds the ``pre`` collapse's own stream gradient ``pre[i] · d y`` in the same pass.

    Every map is ``act(mix) · scale + base`` followed by a function of it: ``grad_z`` is the gradient w.r.t. that
    sum (``act`` is the identity and the function sigmoid / softmax / Sinkhorn, except for ``"unconstrained"``, where
    ``act = tanh`` and nothing follows, so ``grad_z`` is the maps' own gradient)."""
    n, hidden = streams.shape[-2:]
    sizes = _column_groups(n, head, residual_map)
    per_column = _per_column(scale, n, head, residual_map)
    if residual_map == "unconstrained" and not head:
        grad_z = torch.cat([grads[0].float(), grads[1].float(), grads[2].float().flatten(-2)], dim=-1)
        act = torch.tanh(mix)
        grad_mix = grad_z * per_column * (1 - act.square())
    else:
        grad_z = (_grad_z_triton if backend == "triton" else _grad_z_torch)(mix, base, scale, grads, iters, eps, head,
                                                                            residual_map, post_magnitude)
        act = mix
        grad_mix = grad_z * per_column
    grad_base = grad_z.reshape(-1, mix.shape[-1]).sum(0)
    grad_scale = torch.stack([part.sum() for part in (grad_z * act).split(sizes, dim=-1)])
    grad_raw = grad_mix * rstd.unsqueeze(-1)
    correction = -(rstd.square() / (n * hidden)) * (grad_mix * mix).sum(-1)
    grad_streams, grad_fn = (_streams_and_fn_grad_triton if backend == "triton" else _streams_and_fn_grad_torch)(
        streams, fn, grad_raw, correction, collapse
    )
    return grad_streams, grad_fn.to(fn.dtype), grad_base.to(base.dtype), grad_scale.to(scale.dtype)


@without_autocast
def coeffs_forward(streams, fn, base, scale, iters, eps, norm_eps, backend, head, residual_map=DEFAULT_RESIDUAL_MAP,
                   post_magnitude=POST_MAGNITUDE):
    """``(pre, post, comb, mix, rstd)`` for a sublayer (``comb`` empty for the identity map), ``(pre_h, mix, rstd)``
    for the head: one fused Triton kernel for every residual map on ``backend="triton"``."""
    if backend == "triton":
        return _coeffs_forward_triton(streams, fn, base, scale, iters, eps, norm_eps, head, residual_map,
                                      post_magnitude)
    mix, rstd = _mix_torch(streams, fn, norm_eps)
    if head:
        return mhc_reference.mhc_head_weights(mix, base, scale, eps=eps), mix, rstd
    pre, post, comb = mhc_reference.mhc_maps(
        mix, base, scale, sinkhorn_iters=iters, eps=eps, residual_map=residual_map, post_magnitude=post_magnitude,
        sinkhorn_fn=sinkhorn_forward_torch,
    )
    if residual_map == "identity":
        comb = mix.new_empty(0)
    return pre, post, comb, mix, rstd


# --- the ops: one autograd definition each, two kernel backends ---------------------------------------------------


@torch.library.custom_op("hf_mhc::mhc_coeffs_fwd", mutates_args=())
def mhc_coeffs_fwd_op(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
    eps: float, norm_eps: float, backend: str, residual_map: str, post_magnitude: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return coeffs_forward(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, backend, False, residual_map,
                          post_magnitude)


def fake_comb(streams: torch.Tensor, residual_map: str) -> torch.Tensor:
    """The ``comb`` an op returns: ``[..., n, n]`` float32, empty for the identity map."""
    if residual_map == "identity":
        return streams.new_empty(0, dtype=torch.float32)
    return streams.new_empty(*streams.shape[:-1], streams.shape[-2], dtype=torch.float32)


@mhc_coeffs_fwd_op.register_fake
def _(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, backend, residual_map, post_magnitude):
    lead, n = streams.shape[:-2], streams.shape[-2]
    new = streams.new_empty
    f32 = torch.float32
    return (new(*lead, n, dtype=f32), new(*lead, n, dtype=f32), fake_comb(streams, residual_map),
            new(*lead, fn.shape[0], dtype=f32), new(lead, dtype=f32))


@torch.library.custom_op("hf_mhc::mhc_coeffs_bwd", mutates_args=())
def mhc_coeffs_bwd_op(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, mix: torch.Tensor,
    rstd: torch.Tensor, grad_pre: torch.Tensor, grad_post: torch.Tensor, grad_comb: torch.Tensor,
    sinkhorn_iters: int, eps: float, backend: str, residual_map: str, post_magnitude: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return coeffs_backward(streams, fn, base, scale, mix, rstd, (grad_pre, grad_post, grad_comb), sinkhorn_iters,
                           eps, backend, head=False, residual_map=residual_map, post_magnitude=post_magnitude)


@mhc_coeffs_bwd_op.register_fake
def _(streams, fn, base, scale, mix, rstd, grad_pre, grad_post, grad_comb, sinkhorn_iters, eps, backend,
      residual_map, post_magnitude):
    return torch.empty_like(streams), torch.empty_like(fn), torch.empty_like(base), torch.empty_like(scale)


def _coeffs_setup_context(ctx, inputs, output):
    streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, backend, residual_map, post_magnitude = inputs
    *_, mix, rstd = output
    ctx.save_for_backward(streams, fn, base, scale, mix, rstd)
    ctx.mark_non_differentiable(mix, rstd)
    ctx.sinkhorn_iters, ctx.eps, ctx.backend = sinkhorn_iters, eps, backend
    ctx.residual_map, ctx.post_magnitude = residual_map, post_magnitude


def _coeffs_backward(ctx, grad_pre, grad_post, grad_comb, grad_mix, grad_rstd):
    streams, fn, base, scale, mix, rstd = ctx.saved_tensors
    lead, n = streams.shape[:-2], streams.shape[-2]
    like = streams.new_empty(*lead, n, dtype=torch.float32)
    comb_like = fake_comb(streams, ctx.residual_map)
    grads = mhc_coeffs_bwd_op(
        streams, fn, base, scale, mix, rstd, zeros_if_none(grad_pre, like), zeros_if_none(grad_post, like),
        zeros_if_none(grad_comb, comb_like), ctx.sinkhorn_iters, ctx.eps, ctx.backend, ctx.residual_map,
        ctx.post_magnitude,
    )
    return (*grads, None, None, None, None, None, None)


mhc_coeffs_fwd_op.register_autograd(_coeffs_backward, setup_context=_coeffs_setup_context)
