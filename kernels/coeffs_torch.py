"""The mHC coefficients in torch: ``streams -> pre, post, comb`` for a sublayer, ``streams -> pre_h`` for the head,
and their backward.

Forward: ``mix = RMSNorm(flat) @ fn.T`` and ``rstd`` a token chunk at a time, then the maps of
``hf_mhc.mhc_reference.mhc_maps`` on ``mix`` with this folder's memory-light Sinkhorn (``sinkhorn_torch``). Saved for
backward: the streams (shared with the other ops of the site), ``mix`` (``(n+2)·n`` floats per token for mHC) and
``rstd`` (one float per token).

Backward (``maps_backward``, shared with ``coeffs_triton``): the maps' gradient w.r.t. ``mix`` (Sinkhorn recomputed;
elementwise for ``"unconstrained"``), then ``d flat = (d mix · rstd) @ fn - (rstd² / D) · <d mix, mix> · flat`` and
``d fn = (d mix · rstd)^T @ flat``. The reference for all of it is ``hf_mhc.mhc_reference.mhc_coeffs`` /
``mhc_head``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_mhc import mhc_reference
from hf_mhc.mhc_reference import DEFAULT_RESIDUAL_MAP, POST_MAGNITUDE

from .common import map_token_chunks, token_slices, without_autocast
from .sinkhorn_torch import sinkhorn_backward, sinkhorn_forward


def _mix(streams, fn, norm_eps):
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


def _grad_z(mix, base, scale, grads, iters, eps, head, residual_map=DEFAULT_RESIDUAL_MAP,
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
            grad_z.append(sinkhorn_backward(logits, grads[2], iters, eps).flatten(-2))
        elif residual_map == "permutations":  # comb = w @ P, w = softmax(z): d w = d comb @ P^T, then softmax's
            weights = torch.softmax(z_parts[2], dim=-1)
            grad_weights = grads[2].float().flatten(-2) @ mhc_reference.permutation_matrices(n, mix.device).flatten(1).T
            grad_z.append(weights * (grad_weights - (grad_weights * weights).sum(-1, keepdim=True)))
    return torch.cat(grad_z, dim=-1)


def _per_column(scale, n, head, residual_map=DEFAULT_RESIDUAL_MAP):
    """``scale`` broadcast over the columns of ``mix`` (one scale per map group)."""
    sizes = torch.tensor(_column_groups(n, head, residual_map), device=scale.device)
    return torch.repeat_interleave(scale.float(), sizes)


def _streams_and_fn_grad(streams, fn, grad_raw, correction, collapse):
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


def maps_backward(grad_z_of: Callable, streams_and_fn_grad: Callable, streams, fn, base, scale, mix, rstd, grads,
                  iters, eps, head, collapse=None, residual_map=DEFAULT_RESIDUAL_MAP, post_magnitude=POST_MAGNITUDE):
    """``(d streams, d fn, d base, d scale)`` from the gradients of the maps (``pre[, post, comb]``), with a
    backend's ``grad_z_of`` (below) and ``streams_and_fn_grad``. ``collapse = (pre, d y)`` adds the ``pre`` collapse's
    own stream gradient ``pre[i] · d y`` in the same pass.

    Every map is ``act(mix) · scale + base`` followed by a function of it: ``grad_z`` is the gradient w.r.t. that
    sum (``act`` is the identity and the function sigmoid / softmax / Sinkhorn, except for ``"unconstrained"``, where
    ``act = tanh`` and nothing follows, so ``grad_z`` is the maps' own gradient)."""
    n, hidden = streams.shape[-2:]
    sizes = _column_groups(n, head, residual_map)
    scales = _per_column(scale, n, head, residual_map)
    if residual_map == "unconstrained" and not head:
        grad_z = torch.cat([grads[0].float(), grads[1].float(), grads[2].float().flatten(-2)], dim=-1)
        act = torch.tanh(mix)
        grad_mix = grad_z * scales * (1 - act.square())
    else:
        grad_z = grad_z_of(mix, base, scale, grads, iters, eps, head, residual_map, post_magnitude)
        act = mix
        grad_mix = grad_z * scales
    grad_base = grad_z.reshape(-1, mix.shape[-1]).sum(0)
    grad_scale = torch.stack([part.sum() for part in (grad_z * act).split(sizes, dim=-1)])
    grad_raw = grad_mix * rstd.unsqueeze(-1)
    correction = -(rstd.square() / (n * hidden)) * (grad_mix * mix).sum(-1)
    grad_streams, grad_fn = streams_and_fn_grad(streams, fn, grad_raw, correction, collapse)
    return grad_streams, grad_fn.to(fn.dtype), grad_base.to(base.dtype), grad_scale.to(scale.dtype)


@without_autocast
def coeffs_backward(streams, fn, base, scale, mix, rstd, grads, iters, eps, head, collapse=None,
                    residual_map=DEFAULT_RESIDUAL_MAP, post_magnitude=POST_MAGNITUDE):
    """``maps_backward`` with the torch pieces."""
    return maps_backward(_grad_z, _streams_and_fn_grad, streams, fn, base, scale, mix, rstd, grads, iters, eps, head,
                         collapse, residual_map, post_magnitude)


@without_autocast
def coeffs_forward(streams, fn, base, scale, iters, eps, norm_eps, head, residual_map=DEFAULT_RESIDUAL_MAP,
                   post_magnitude=POST_MAGNITUDE):
    """``(pre, post, comb, mix, rstd)`` for a sublayer (``comb`` empty for the identity map), ``(pre_h, mix, rstd)``
    for the head."""
    mix, rstd = _mix(streams, fn, norm_eps)
    if head:
        return mhc_reference.mhc_head_weights(mix, base, scale, eps=eps), mix, rstd
    pre, post, comb = mhc_reference.mhc_maps(
        mix, base, scale, sinkhorn_iters=iters, eps=eps, residual_map=residual_map, post_magnitude=post_magnitude,
        sinkhorn_fn=sinkhorn_forward,
    )
    if residual_map == "identity":
        comb = mix.new_empty(0)
    return pre, post, comb, mix, rstd
