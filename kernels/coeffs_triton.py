"""The mHC coefficients in Triton: ``streams -> pre, post, comb`` for a sublayer, ``streams -> pre_h`` for the head,
fused, and their backward.

Forward, one pass over the streams per token block: ``flat @ fn.T`` and the sum of squares together (the reordered
RMSNorm: ``RMSNorm(flat) @ fn.T == (flat @ fn.T) * rstd``), then the maps per token in registers, in float32:
sigmoid / 2·sigmoid / softmax + Sinkhorn for mHC, or another residual map (``residual_map``: scaled tanh for
``"unconstrained"``, no comb for ``"identity"``, a softmax over the ``n!`` permutation matrices for
``"permutations"``; see ``hf_mhc.mhc_reference.mhc_maps``). Saved for backward: the streams, ``mix`` and ``rstd``.

Backward: ``coeffs_torch.maps_backward`` with two kernels, the maps' gradient w.r.t. ``mix`` (Sinkhorn recomputed in
registers, see ``sinkhorn_triton``) and ``d flat = (d mix · rstd) @ fn - (rstd² / D) · <d mix, mix> · flat``. The
reference for all of it is ``hf_mhc.mhc_reference.mhc_coeffs`` / ``mhc_head``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hf_mhc import mhc_reference
from hf_mhc.mhc_reference import DEFAULT_RESIDUAL_MAP, POST_MAGNITUDE

from .coeffs_torch import maps_backward
from .common import MAP_CODES, without_autocast
from .sinkhorn_triton import sinkhorn_tile_backward, sinkhorn_tile_forward
from .triton_launch import launch_grid, padded_streams

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


# --- launchers ----------------------------------------------------------------------------------------------------


@without_autocast
def coeffs_forward(streams, fn, base, scale, iters, eps, norm_eps, head, residual_map=DEFAULT_RESIDUAL_MAP,
                   post_magnitude=POST_MAGNITUDE):
    """``(pre, post, comb, mix, rstd)`` for a sublayer (``comb`` empty for the identity map), ``(pre_h, mix, rstd)``
    for the head: one fused kernel for every residual map."""
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


def _grad_z(mix, base, scale, grads, iters, eps, head, residual_map=DEFAULT_RESIDUAL_MAP,
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


def _streams_and_fn_grad(streams, fn, grad_raw, correction, collapse):
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
def coeffs_backward(streams, fn, base, scale, mix, rstd, grads, iters, eps, head, collapse=None,
                    residual_map=DEFAULT_RESIDUAL_MAP, post_magnitude=POST_MAGNITUDE):
    """``coeffs_torch.maps_backward`` with the Triton pieces."""
    return maps_backward(_grad_z, _streams_and_fn_grad, streams, fn, base, scale, mix, rstd, grads, iters, eps, head,
                         collapse, residual_map, post_magnitude)
