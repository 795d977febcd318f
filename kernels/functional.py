"""Public mHC kernel API: ``sinkhorn``, ``mhc_coeffs``, ``mhc_pre``, ``mhc_post_res``, ``mhc_head``.

Each op takes ``backend``: ``"torch"`` (the plain-torch formula of DESIGN §3, differentiable through
autograd) or ``None`` to pick the best backend available for the tensors' device. These names and
signatures are stable; faster backends change the speed, never the results.
"""

from __future__ import annotations

import torch

from hf_mhc import mhc_reference

BACKENDS: tuple[str, ...] = ("torch",)


def resolve_backend(backend: str | None, *tensors: torch.Tensor) -> str:
    """Return the backend to run on ``tensors``; raise ``ValueError`` for an unknown name."""
    if backend is None:
        return "torch"
    if backend not in BACKENDS:
        raise ValueError(f"Unknown mHC backend {backend!r}; available backends: {', '.join(BACKENDS)} (or None).")
    return backend


def sinkhorn(logits: torch.Tensor, iters: int, eps: float, *, backend: str | None = None) -> torch.Tensor:
    """Sinkhorn-Knopp projection of ``logits [..., n, n]``; returns float32 ``[..., n, n]``."""
    if iters < 1:
        raise ValueError(f"sinkhorn needs iters >= 1, got {iters}.")
    if logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn needs square [..., n, n] logits, got shape {tuple(logits.shape)}.")
    resolve_backend(backend, logits)
    return mhc_reference.sinkhorn(logits, iters, eps)


def mhc_coeffs(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    sinkhorn_iters: int,
    eps: float,
    norm_eps: float,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``streams [B, T, n, C]`` -> ``pre [B, T, n]``, ``post [B, T, n]``, ``comb [B, T, n, n]`` (float32)."""
    n, hidden = streams.shape[-2:]
    if fn.shape != ((n + 2) * n, n * hidden) or base.shape != ((n + 2) * n,) or scale.shape != (3,):
        raise ValueError(
            f"mhc_coeffs for n={n}, C={hidden} needs fn [{(n + 2) * n}, {n * hidden}], base [{(n + 2) * n}], "
            f"scale [3]; got {tuple(fn.shape)}, {tuple(base.shape)}, {tuple(scale.shape)}."
        )
    if sinkhorn_iters < 1:
        raise ValueError(f"mhc_coeffs needs sinkhorn_iters >= 1, got {sinkhorn_iters}.")
    resolve_backend(backend, streams)
    return mhc_reference.mhc_coeffs(
        streams, fn, base, scale, sinkhorn_iters=sinkhorn_iters, eps=eps, norm_eps=norm_eps
    )


def mhc_pre(streams: torch.Tensor, pre: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Collapse ``streams [B, T, n, C]`` with ``pre [B, T, n]`` into ``[B, T, C]`` (streams' dtype)."""
    if pre.shape != streams.shape[:-1]:
        raise ValueError(f"mhc_pre needs pre of shape {tuple(streams.shape[:-1])}, got {tuple(pre.shape)}.")
    resolve_backend(backend, streams)
    return mhc_reference.mhc_pre(streams, pre)


def mhc_post_res(
    streams: torch.Tensor,
    y: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``X'[i] = post[i] * y + sum_j comb[j, i] * X[j]``: ``[B, T, n, C]`` in the streams' dtype."""
    n = streams.shape[-2]
    if y.shape != streams.shape[:-2] + streams.shape[-1:]:
        raise ValueError(f"mhc_post_res needs y of shape {tuple(streams.shape[:-2] + streams.shape[-1:])}, "
                         f"got {tuple(y.shape)}.")
    if post.shape != streams.shape[:-1] or comb.shape != streams.shape[:-1] + (n,):
        raise ValueError(
            f"mhc_post_res needs post {tuple(streams.shape[:-1])} and comb {tuple(streams.shape[:-1] + (n,))}, "
            f"got {tuple(post.shape)} and {tuple(comb.shape)}."
        )
    resolve_backend(backend, streams)
    return mhc_reference.mhc_post_res(streams, y, post, comb)


def mhc_head(
    streams: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_base: torch.Tensor,
    hc_scale: torch.Tensor,
    *,
    eps: float,
    norm_eps: float,
    backend: str | None = None,
) -> torch.Tensor:
    """Final readout of ``streams [B, T, n, C]`` into ``[B, T, C]`` (streams' dtype)."""
    n, hidden = streams.shape[-2:]
    if hc_fn.shape != (n, n * hidden) or hc_base.shape != (n,) or hc_scale.shape != (1,):
        raise ValueError(
            f"mhc_head for n={n}, C={hidden} needs hc_fn [{n}, {n * hidden}], hc_base [{n}], hc_scale [1]; "
            f"got {tuple(hc_fn.shape)}, {tuple(hc_base.shape)}, {tuple(hc_scale.shape)}."
        )
    resolve_backend(backend, streams)
    return mhc_reference.mhc_head(streams, hc_fn, hc_base, hc_scale, eps=eps, norm_eps=norm_eps)
