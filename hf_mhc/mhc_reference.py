"""Plain-torch mHC maps: the reference formula (stated in the README, "The math"), the one place this math is written.

Shapes: streams ``X`` are ``[..., n, C]`` (usually ``[B, T, n, C]``) in the model dtype; every
coefficient is computed in float32 whatever that dtype is. This file ships flat beside
``modeling_mhc.py`` in every saved checkpoint, so it imports nothing but torch.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def normalized_flat_streams(streams: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """Unweighted RMSNorm of the flattened streams: ``[..., n, C] -> [..., n*C]`` in float32."""
    flat = streams.flatten(-2).float()
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn-Knopp projection of ``[..., n, n]`` logits towards the doubly stochastic matrices.

    ``softmax(logits, -1) + eps``, a column normalisation, then ``iters - 1`` rounds of row and column
    normalisation, each ``M / (sum + eps)``. The columns (the last normalisation) sum to 1 up to ``eps``;
    the rows only approximately after finitely many rounds. Returns float32.
    """
    comb = torch.softmax(logits.float(), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mhc_mix(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """``RMSNorm(flat) @ fn.T``: ``[..., n, C]`` streams and ``fn [m, n*C]`` -> float32 ``[..., m]`` (also under
    ``torch.autocast``, which would otherwise run the projection in bf16)."""
    with torch.autocast(device_type=streams.device.type, enabled=False):
        return F.linear(normalized_flat_streams(streams, norm_eps), fn.float())


def mhc_maps(
    mix: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    sinkhorn_iters: int,
    eps: float,
    sinkhorn_fn=sinkhorn,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pre``, ``post``, ``comb`` from the projected streams ``mix [..., (n+2)*n]`` (float32).

    ``sinkhorn_fn(logits, iters, eps)`` lets a caller swap in a memory-light Sinkhorn with the same numbers.
    """
    n = math.isqrt(1 + base.shape[0]) - 1  # base holds (n + 2) * n entries
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre_scale, post_scale, comb_scale = scale.float().unbind(0)
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    comb_logits = comb_w.unflatten(-1, (n, n)) * comb_scale + comb_b.view(n, n)
    return pre, post, sinkhorn_fn(comb_logits, sinkhorn_iters, eps)


def mhc_coeffs(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    sinkhorn_iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-dependent mHC maps of one sublayer.

    Args:
        streams: ``[..., n, C]``.
        fn: ``[(n+2)*n, n*C]``; base: ``[(n+2)*n]``; scale: ``[3]`` (pre, post, comb).

    Returns:
        ``pre [..., n]``, ``post [..., n]``, ``comb [..., n, n]``, all float32.
    """
    mix = mhc_mix(streams, fn, norm_eps)
    return mhc_maps(mix, base, scale, sinkhorn_iters=sinkhorn_iters, eps=eps)


def mhc_pre(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Collapse ``[..., n, C]`` streams with weights ``pre [..., n]`` into ``[..., C]`` (streams' dtype)."""
    return (pre.float().unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)


def mhc_coeffs_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    sinkhorn_iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A site's entry: the sublayer input ``y [..., C]`` (streams' dtype), ``post [..., n]`` and ``comb [..., n, n]``
    (float32), i.e. ``mhc_coeffs`` followed by ``mhc_pre``."""
    pre, post, comb = mhc_coeffs(streams, fn, base, scale, sinkhorn_iters=sinkhorn_iters, eps=eps, norm_eps=norm_eps)
    return mhc_pre(streams, pre), post, comb


def mhc_post_res(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams ``X'[i] = post[i] * y + sum_j comb[j, i] * X[j]`` (comb applied transposed).

    Args:
        streams: ``[..., n, C]``; y: the sublayer output ``[..., C]``; post: ``[..., n]``; comb: ``[..., n, n]``.

    Returns:
        ``[..., n, C]`` in the streams' dtype, computed in float32.
    """
    mixed = torch.matmul(comb.float().transpose(-1, -2), streams.float())
    return (post.float().unsqueeze(-1) * y.float().unsqueeze(-2) + mixed).to(streams.dtype)


def mhc_head(
    streams: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_base: torch.Tensor,
    hc_scale: torch.Tensor,
    *,
    eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """Final readout: ``sum_i pre_h[i] * X[i]`` with ``pre_h = sigmoid(hc_scale * (flat_n @ hc_fn.T) + hc_base) + eps``.

    Args:
        streams: ``[..., n, C]``; hc_fn: ``[n, n*C]``; hc_base: ``[n]``; hc_scale: ``[1]``.

    Returns:
        ``[..., C]`` in the streams' dtype.
    """
    return mhc_pre(streams, mhc_head_weights(mhc_mix(streams, hc_fn, norm_eps), hc_base, hc_scale, eps=eps))


def mhc_head_weights(mix: torch.Tensor, hc_base: torch.Tensor, hc_scale: torch.Tensor, *, eps: float) -> torch.Tensor:
    """The head's collapse weights ``pre_h [..., n]`` from ``mix = RMSNorm(flat) @ hc_fn.T`` (float32)."""
    return torch.sigmoid(mix * hc_scale.float() + hc_base.float()) + eps
