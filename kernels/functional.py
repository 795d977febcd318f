"""Public mHC kernel API: ``sinkhorn``, ``mhc_coeffs``, ``mhc_pre``, ``mhc_coeffs_pre``, ``mhc_post_res``,
``mhc_head``: each checks its arguments, then runs the op set the dispatch table (``dispatch.py``) gives for
``backend`` and its tensors.

Each op takes ``backend``:

- ``"torch"``: memory-light torch kernels (custom forward and backward that save only the streams, the sublayer
  output and per-token coefficients, and recompute Sinkhorn's iterates in backward); on CPU without gradient,
  ``mhc_coeffs_pre``, ``mhc_post_res`` and ``mhc_head`` run a call of at most ``cpu_decode.MAX_TOKENS`` tokens as one
  fused C++ call (``cpu_decode.py``: decoding), with the same numbers to float32 rounding;
- ``"triton"``: the fused Triton kernels, for CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``);
- ``None``: Triton for CUDA tensors, torch otherwise (``hc_implementation="auto"``).

The coefficient ops take ``residual_map`` (``"sinkhorn"``, mHC, the default; ``"unconstrained"``, ``"identity"``,
``"permutations"``: see ``hf_mhc.mhc_reference.mhc_maps``) and ``post_magnitude`` (the identity map's ``post``
scale). With ``"identity"``, ``mhc_coeffs_pre`` returns ``comb=None`` and ``mhc_post_res(..., comb=None)`` carries
the streams unmixed; ``mhc_coeffs`` returns the comb applied, the identity.

Every op is a ``torch.library`` custom op with its own backward, so ``torch.compile(fullgraph=True)`` traces through
it. The numbers are those of the plain formula in ``hf_mhc.mhc_reference`` whatever the backend; a failing Triton
launch raises, it never falls back silently. Streams with no tokens give empty results (and empty gradients); invalid
input (non-float tensors, tensors on two devices, negative or non-finite eps) raises one ``ValueError`` line from
``check_inputs``, before anything runs.
"""

from __future__ import annotations

import math

import torch

from hf_mhc import mhc_reference
from hf_mhc.mhc_reference import DEFAULT_RESIDUAL_MAP, POST_MAGNITUDE

from .dispatch import mhc_ops

RESIDUAL_MAPS = mhc_reference.RESIDUAL_MAPS

BACKENDS: tuple[str, ...] = ("torch", "triton")
STREAM_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_inputs(
    op: str,
    tensors: dict[str, torch.Tensor],
    *,
    iters: tuple[str, int] | None = None,
    eps: float | None = None,
    norm_eps: float | None = None,
) -> None:
    """What every op refuses, with a one-line ``ValueError``: a tensor that is not float32 / bfloat16 / float16 /
    float64 (integer, bool and complex tensors would otherwise be cast silently), tensors on more than one device,
    ``iters = (name, value)`` that is not an integer >= 1, and an ``eps`` or ``norm_eps`` that is not a finite number
    >= 0. ``tensors`` maps argument names to tensors, the streams (or logits) first; streams need ``[..., T, n, C]``
    with ``n, C >= 1``."""
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{op} needs {name} as a torch.Tensor, got {type(tensor).__name__}.")
        if tensor.dtype not in STREAM_DTYPES:
            raise ValueError(f"{op} needs floating-point {name} (float32, bfloat16, float16 or float64), "
                             f"got {tensor.dtype}.")
    first_name, first = next(iter(tensors.items()))
    elsewhere = [(name, tensor.device) for name, tensor in tensors.items() if tensor.device != first.device]
    if elsewhere:
        others = ", ".join(f"{name} on {device}" for name, device in elsewhere)
        raise ValueError(f"{op} needs all its tensors on one device: {first_name} is on {first.device}, {others}.")
    if first_name == "streams" and (first.dim() < 3 or first.shape[-1] < 1 or first.shape[-2] < 1):
        raise ValueError(f"{op} needs streams of shape [..., T, n, C] with n >= 1 and C >= 1, "
                         f"got {tuple(first.shape)}.")
    if iters is not None:
        name, value = iters
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{op} needs an integer {name} >= 1, got {value!r}.")
    for name, value in (("eps", eps), ("norm_eps", norm_eps)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{op} needs {name} as a finite number >= 0, got {value!r}.")


def backend_implementation(backend: str | None) -> str:
    """The ``hc_implementation`` of ``backend`` (``None`` is ``"auto"``); ``ValueError`` for an unknown name."""
    if backend is None:
        return "auto"
    if backend not in BACKENDS:
        raise ValueError(f"Unknown mHC backend {backend!r}; available backends: {', '.join(BACKENDS)} (or None).")
    return backend


def sinkhorn(logits: torch.Tensor, iters: int, eps: float, *, backend: str | None = None) -> torch.Tensor:
    """Sinkhorn-Knopp projection of ``logits [..., n, n]``; returns float32 ``[..., n, n]``."""
    check_inputs("sinkhorn", {"logits": logits}, iters=("iters", iters), eps=eps)
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn needs square [..., n, n] logits, got shape {tuple(logits.shape)}.")
    return mhc_ops(backend_implementation(backend), logits).sinkhorn(logits, iters, eps)


def _check_coeffs_args(op: str, streams, fn, base, scale, sinkhorn_iters: int, eps: float, norm_eps: float,
                       residual_map: str, post_magnitude: float) -> None:
    check_inputs(op, {"streams": streams, "fn": fn, "base": base, "scale": scale},
                 iters=("sinkhorn_iters", sinkhorn_iters), eps=eps, norm_eps=norm_eps)
    if residual_map not in RESIDUAL_MAPS:
        raise ValueError(f"{op} got residual_map={residual_map!r}; available maps: {', '.join(RESIDUAL_MAPS)}.")
    if isinstance(post_magnitude, bool) or not isinstance(post_magnitude, (int, float)) or not post_magnitude > 0:
        raise ValueError(f"{op} needs post_magnitude as a number > 0, got {post_magnitude!r}.")
    n, hidden = streams.shape[-2:]
    if residual_map == "permutations":
        mhc_reference.check_permutation_streams(n, "n")
    rows, scales = sum(mhc_reference.map_sizes(n, residual_map)), mhc_reference.scale_size(residual_map)
    if fn.shape != (rows, n * hidden) or base.shape != (rows,) or scale.shape != (scales,):
        raise ValueError(
            f"{op} for n={n}, C={hidden}, residual_map={residual_map!r} needs fn [{rows}, {n * hidden}], "
            f"base [{rows}], scale [{scales}]; got {tuple(fn.shape)}, {tuple(base.shape)}, {tuple(scale.shape)}."
        )


def mhc_coeffs(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, sinkhorn_iters: int,
    eps: float, norm_eps: float, backend: str | None = None, residual_map: str = DEFAULT_RESIDUAL_MAP,
    post_magnitude: float = POST_MAGNITUDE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``streams [B, T, n, C]`` -> ``pre [B, T, n]``, ``post [B, T, n]``, ``comb [B, T, n, n]`` (float32; the comb
    applied, an expanded identity for ``residual_map="identity"``)."""
    _check_coeffs_args("mhc_coeffs", streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, residual_map,
                       post_magnitude)
    return mhc_ops(backend_implementation(backend), streams, fn, base, scale).mhc_coeffs(
        streams, fn, base, scale, sinkhorn_iters=sinkhorn_iters, eps=eps, norm_eps=norm_eps, residual_map=residual_map,
        post_magnitude=post_magnitude)


def mhc_coeffs_pre(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, sinkhorn_iters: int,
    eps: float, norm_eps: float, backend: str | None = None, residual_map: str = DEFAULT_RESIDUAL_MAP,
    post_magnitude: float = POST_MAGNITUDE,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A site's entry in one op: ``streams [B, T, n, C]`` -> the sublayer input ``y [B, T, C]`` (streams' dtype),
    ``post [B, T, n]`` and ``comb [B, T, n, n]`` (float32; ``None`` for the identity map). The same numbers as
    ``mhc_coeffs`` then ``mhc_pre``, with one backward node that writes the stream gradient once."""
    _check_coeffs_args("mhc_coeffs_pre", streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, residual_map,
                       post_magnitude)
    return mhc_ops(backend_implementation(backend), streams, fn, base, scale).mhc_coeffs_pre(
        streams, fn, base, scale, sinkhorn_iters=sinkhorn_iters, eps=eps, norm_eps=norm_eps, residual_map=residual_map,
        post_magnitude=post_magnitude)


def mhc_pre(streams: torch.Tensor, pre: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """Collapse ``streams [B, T, n, C]`` with ``pre [B, T, n]`` into ``[B, T, C]`` (streams' dtype)."""
    check_inputs("mhc_pre", {"streams": streams, "pre": pre})
    if pre.shape != streams.shape[:-1]:
        raise ValueError(f"mhc_pre needs pre of shape {tuple(streams.shape[:-1])}, got {tuple(pre.shape)}.")
    return mhc_ops(backend_implementation(backend), streams, pre).mhc_pre(streams, pre)


def mhc_post_res(
    streams: torch.Tensor,
    y: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor | None,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """``X'[i] = post[i] * y + sum_j comb[j, i] * X[j]``: ``[B, T, n, C]`` in the streams' dtype. ``comb=None`` is the
    identity map: ``X'[i] = post[i] * y + X[i]``, without the mixing work."""
    check_inputs("mhc_post_res", {"streams": streams, "y": y, "post": post,
                                  **({} if comb is None else {"comb": comb})})
    n = streams.shape[-2]
    if y.shape != streams.shape[:-2] + streams.shape[-1:]:
        raise ValueError(f"mhc_post_res needs y of shape {tuple(streams.shape[:-2] + streams.shape[-1:])}, "
                         f"got {tuple(y.shape)}.")
    if post.shape != streams.shape[:-1] or (comb is not None and comb.shape != streams.shape[:-1] + (n,)):
        raise ValueError(
            f"mhc_post_res needs post {tuple(streams.shape[:-1])} and comb {tuple(streams.shape[:-1] + (n,))} "
            f"(or None), got {tuple(post.shape)} and {None if comb is None else tuple(comb.shape)}."
        )
    weights = (y, post) if comb is None else (y, post, comb)
    return mhc_ops(backend_implementation(backend), streams, *weights).mhc_post_res(streams, y, post, comb)


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
    check_inputs("mhc_head", {"streams": streams, "hc_fn": hc_fn, "hc_base": hc_base, "hc_scale": hc_scale},
                 eps=eps, norm_eps=norm_eps)
    n, hidden = streams.shape[-2:]
    if hc_fn.shape != (n, n * hidden) or hc_base.shape != (n,) or hc_scale.shape != (1,):
        raise ValueError(
            f"mhc_head for n={n}, C={hidden} needs hc_fn [{n}, {n * hidden}], hc_base [{n}], hc_scale [1]; "
            f"got {tuple(hc_fn.shape)}, {tuple(hc_base.shape)}, {tuple(hc_scale.shape)}."
        )
    return mhc_ops(backend_implementation(backend), streams, hc_fn, hc_base, hc_scale).mhc_head(
        streams, hc_fn, hc_base, hc_scale, eps=eps, norm_eps=norm_eps)
