"""The mHC formulas in plain torch: the one place this math is written, and the oracle every kernel is tested against.

Shapes: streams ``X`` are ``[..., n, C]`` (usually ``[B, T, n, C]``) in the model dtype. Every formula computes in
``compute_dtype``: float32 by default (a model's coefficients are float32 whatever its dtype); the tests run them in
float64. Stream-sized results are returned in the streams' dtype, coefficients in ``compute_dtype``. This file ships
flat beside ``modeling_mhc.py`` in every saved checkpoint, so it imports nothing but torch and the standard library.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Literal, get_args

import torch
import torch.nn.functional as F

# The residual maps (MHCConfig.hc_residual_map): written once, as the type; the tuple is derived from it.
ResidualMap = Literal["sinkhorn", "unconstrained", "identity", "permutations"]
RESIDUAL_MAPS: tuple[str, ...] = get_args(ResidualMap)
# MHCConfig's defaults (hc_residual_map, hc_post_magnitude), which it takes from here: this file ships flat beside
# modeling_mhc.py and imports nothing of the package. post = POST_MAGNITUDE·σ(...) for every map; only the identity
# map takes another magnitude (HY-V4's hc_magnitude).
DEFAULT_RESIDUAL_MAP: ResidualMap = "sinkhorn"
POST_MAGNITUDE = 2.0
MAX_PERMUTATION_STREAMS = 4  # the most streams "permutations" takes: see check_permutation_streams


def check_permutation_streams(n: int, name: str, map_setting: str = "residual_map") -> None:
    """``ValueError`` (one line) unless the ``"permutations"`` map can run on ``n`` streams: ``n <=
    MAX_PERMUTATION_STREAMS``. ``name`` is what the caller calls ``n`` (``"hc_mult"``, ``"n"``) and ``map_setting`` its
    residual-map setting (``"hc_residual_map"``, ``"residual_map"``); the message names both."""
    if n > MAX_PERMUTATION_STREAMS:
        raise ValueError(f"{map_setting}='permutations' supports {name} <= {MAX_PERMUTATION_STREAMS}: it mixes all n! "
                         f"permutation matrices, a cost that grows as n! (24 at n=4, 120 at n=5); got {name}={n}.")


def map_sizes(n: int, residual_map: ResidualMap = DEFAULT_RESIDUAL_MAP) -> tuple[int, int, int]:
    """Columns of ``mix`` (rows of ``fn``, entries of ``base``) for ``pre``, ``post`` and ``comb``: ``comb`` has
    ``n*n`` for sinkhorn and unconstrained, none for identity and ``n!`` (one weight per permutation) for
    permutations."""
    comb = {"sinkhorn": n * n, "unconstrained": n * n, "identity": 0, "permutations": math.factorial(n)}
    if residual_map not in comb:
        raise ValueError(f"Unknown residual map {residual_map!r}; available maps: {', '.join(RESIDUAL_MAPS)}.")
    return n, n, comb[residual_map]


def scale_size(residual_map: ResidualMap = DEFAULT_RESIDUAL_MAP) -> int:
    """Entries of ``scale``: one per map group (pre, post[, comb])."""
    return 2 if residual_map == "identity" else 3


def streams_of(base: torch.Tensor, residual_map: str) -> int:
    """``n`` from the length of ``base`` (``sum(map_sizes(n, residual_map))``)."""
    for n in range(1, base.shape[0] + 1):
        if sum(map_sizes(n, residual_map)) == base.shape[0]:
            return n
    raise ValueError(f"A base of {base.shape[0]} entries fits no stream count for residual_map={residual_map!r}.")


def permutation_matrices(n: int, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``n!`` permutation matrices ``[n!, n, n]`` in ``itertools.permutations`` order, which is lexicographic and
    starts with the identity: ``P_k[i, j] = 1`` where ``j = perm_k[i]``."""
    order = torch.tensor(list(itertools.permutations(range(n))), device=device)  # [n!, n]
    return torch.eye(n, device=device, dtype=dtype)[order]


def normalized_flat_streams(streams: torch.Tensor, norm_eps: float, *,
                            compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unweighted RMSNorm of the flattened streams: ``[..., n, C] -> [..., n*C]`` in ``compute_dtype``."""
    flat = streams.flatten(-2).to(compute_dtype)
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)


def mhc_mix(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float, *,
            compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``RMSNorm(flat) @ fn.T``: ``[..., n, C]`` streams and ``fn [m, n*C]`` -> ``[..., m]`` in ``compute_dtype``, also
    under ``torch.autocast`` (which would otherwise run the projection in a 16-bit dtype)."""
    with torch.autocast(device_type=streams.device.type, enabled=False):
        flat_n = normalized_flat_streams(streams, norm_eps, compute_dtype=compute_dtype)
        return F.linear(flat_n, fn.to(compute_dtype))


def sinkhorn(logits: torch.Tensor, iters: int, eps: float, *,
             compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sinkhorn-Knopp projection of ``[..., n, n]`` logits towards the doubly stochastic matrices, in
    ``compute_dtype``.

    ``softmax(logits, -1) + eps``, a column normalisation, then ``iters - 1`` rounds of row and column
    normalisation, each ``M / (sum + eps)``. The columns (the last normalisation) sum to 1 up to ``eps``;
    the rows only approximately after finitely many rounds.
    """
    comb = torch.softmax(logits.to(compute_dtype), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def mhc_maps(
    mix: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    sinkhorn_iters: int,
    eps: float,
    residual_map: ResidualMap = DEFAULT_RESIDUAL_MAP,
    post_magnitude: float = POST_MAGNITUDE,
    sinkhorn_fn: Callable[[torch.Tensor, int, float], torch.Tensor] | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pre [..., n]``, ``post [..., n]``, ``comb [..., n, n]`` (``compute_dtype``) from the projected streams ``mix``
    (the columns of ``map_sizes(n, residual_map)``), with ``w = mix`` split into ``pre_w, post_w, comb_w``, ``base``
    into ``pre_b, post_b, comb_b`` and ``scale`` into ``s0, s1[, s2]``:

    - ``"sinkhorn"`` (mHC): ``pre = σ(s0·pre_w + pre_b) + eps``, ``post = 2σ(s1·post_w + post_b)``,
      ``comb = Sinkhorn(s2·comb_w + comb_b)`` (``sinkhorn``).
    - ``"unconstrained"`` (Hyper-Connections): ``pre = s0·tanh(pre_w) + pre_b``, ``post = s1·tanh(post_w) + post_b``,
      ``comb = s2·tanh(comb_w) + comb_b``: static plus scaled-tanh dynamic maps, no projection, so ``comb`` may be
      negative and its rows and columns need not sum to 1.
    - ``"identity"`` (HY-V4): ``pre`` as mHC, ``post = post_magnitude·σ(s1·post_w + post_b) + eps``, ``comb = I``
      (no comb columns, ``scale`` has 2 entries).
    - ``"permutations"`` (mHC-lite): ``pre`` and ``post`` as mHC, ``comb = Σ_k w_k P_k`` over the ``n!`` permutation
      matrices (``permutation_matrices``) with ``w = softmax(s2·comb_w + comb_b)``: exactly doubly stochastic.

    ``sinkhorn_fn(logits, iters, eps)`` replaces ``sinkhorn`` (a memory-light one with the same numbers).
    """
    n = streams_of(base, residual_map)
    sizes = map_sizes(n, residual_map)
    pre_w, post_w, comb_w = mix.to(compute_dtype).split(sizes, dim=-1)
    pre_b, post_b, comb_b = base.to(compute_dtype).split(sizes)
    pre_scale, post_scale, *comb_scale = scale.to(compute_dtype).unbind(0)
    if residual_map == "unconstrained":
        pre = pre_scale * torch.tanh(pre_w) + pre_b
        post = post_scale * torch.tanh(post_w) + post_b
        comb = comb_scale[0] * torch.tanh(comb_w.unflatten(-1, (n, n))) + comb_b.view(n, n)
        return pre, post, comb
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + eps
    if residual_map == "identity":
        post = post_magnitude * torch.sigmoid(post_w * post_scale + post_b) + eps
        return pre, post, torch.eye(n, device=mix.device, dtype=compute_dtype).expand(*mix.shape[:-1], n, n)
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    comb_logits = comb_w * comb_scale[0] + comb_b
    if residual_map == "permutations":
        weights = torch.softmax(comb_logits, dim=-1)
        comb = weights @ permutation_matrices(n, mix.device, compute_dtype).flatten(1)  # [..., n!] @ [n!, n*n]
        return pre, post, comb.unflatten(-1, (n, n))
    project = sinkhorn_fn or functools.partial(sinkhorn, compute_dtype=compute_dtype)
    return pre, post, project(comb_logits.unflatten(-1, (n, n)), sinkhorn_iters, eps)


def mhc_coeffs(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, sinkhorn_iters: int,
    eps: float, norm_eps: float, residual_map: ResidualMap = DEFAULT_RESIDUAL_MAP,
    post_magnitude: float = POST_MAGNITUDE, compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-dependent maps of one sublayer: ``mhc_maps`` of ``mhc_mix``.

    Args:
        streams: ``[..., n, C]``.
        fn: ``[m, n*C]``, base: ``[m]`` with ``m = sum(map_sizes(n, residual_map))`` (``(n+2)*n`` for mHC);
        scale: ``[scale_size(residual_map)]``.

    Returns:
        ``pre [..., n]``, ``post [..., n]``, ``comb [..., n, n]`` (the comb applied: the identity for
        ``"identity"``), all in ``compute_dtype``.
    """
    mix = mhc_mix(streams, fn, norm_eps, compute_dtype=compute_dtype)
    return mhc_maps(mix, base, scale, sinkhorn_iters=sinkhorn_iters, eps=eps, residual_map=residual_map,
                    post_magnitude=post_magnitude, compute_dtype=compute_dtype)


def mhc_pre(streams: torch.Tensor, pre: torch.Tensor, *, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Collapse: ``y = sum_i pre[i] * X[i]``, ``[..., n, C]`` streams and ``pre [..., n]`` -> ``[..., C]`` in the
    streams' dtype."""
    return (pre.to(compute_dtype).unsqueeze(-1) * streams.to(compute_dtype)).sum(dim=-2).to(streams.dtype)


def mhc_coeffs_pre(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *, sinkhorn_iters: int,
    eps: float, norm_eps: float, residual_map: ResidualMap = DEFAULT_RESIDUAL_MAP,
    post_magnitude: float = POST_MAGNITUDE, compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A site's entry: the sublayer input ``y [..., C]`` (streams' dtype), ``post [..., n]`` and ``comb [..., n, n]``
    (``compute_dtype``; ``None`` for the identity map, which has nothing to mix), i.e. ``mhc_coeffs`` then
    ``mhc_pre``."""
    pre, post, comb = mhc_coeffs(streams, fn, base, scale, sinkhorn_iters=sinkhorn_iters, eps=eps, norm_eps=norm_eps,
                                 residual_map=residual_map, post_magnitude=post_magnitude, compute_dtype=compute_dtype)
    return mhc_pre(streams, pre, compute_dtype=compute_dtype), post, None if residual_map == "identity" else comb


def mhc_post_res(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor | None, *,
                 compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Merge: new streams ``X'[i] = post[i] * y + sum_j comb[j, i] * X[j]`` (comb applied transposed).

    Args:
        streams: ``[..., n, C]``; y: the sublayer output ``[..., C]``; post: ``[..., n]``; comb: ``[..., n, n]``, or
            ``None`` for the identity (``X'[i] = post[i] * y + X[i]``, no mixing).

    Returns:
        ``[..., n, C]`` in the streams' dtype.
    """
    x = streams.to(compute_dtype)
    mixed = x if comb is None else torch.matmul(comb.to(compute_dtype).transpose(-1, -2), x)
    return (post.to(compute_dtype).unsqueeze(-1) * y.to(compute_dtype).unsqueeze(-2) + mixed).to(streams.dtype)


def mhc_head_weights(mix: torch.Tensor, hc_base: torch.Tensor, hc_scale: torch.Tensor, *, eps: float,
                     compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The head's collapse weights ``pre_h = sigmoid(hc_scale * mix + hc_base) + eps`` ``[..., n]`` from
    ``mix = RMSNorm(flat) @ hc_fn.T``, in ``compute_dtype``."""
    return torch.sigmoid(mix.to(compute_dtype) * hc_scale.to(compute_dtype) + hc_base.to(compute_dtype)) + eps


def mhc_head(
    streams: torch.Tensor, hc_fn: torch.Tensor, hc_base: torch.Tensor, hc_scale: torch.Tensor, *, eps: float,
    norm_eps: float, compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Final readout: ``sum_i pre_h[i] * X[i]`` with ``pre_h = sigmoid(hc_scale * (flat_n @ hc_fn.T) + hc_base) + eps``.

    Args:
        streams: ``[..., n, C]``; hc_fn: ``[n, n*C]``; hc_base: ``[n]``; hc_scale: ``[1]``.

    Returns:
        ``[..., C]`` in the streams' dtype.
    """
    mix = mhc_mix(streams, hc_fn, norm_eps, compute_dtype=compute_dtype)
    pre_h = mhc_head_weights(mix, hc_base, hc_scale, eps=eps, compute_dtype=compute_dtype)
    return mhc_pre(streams, pre_h, compute_dtype=compute_dtype)


# Function-preserving initialisation. `config` is an MHCConfig (read by attribute: hc_mult, hc_eps, hc_residual_map,
# hc_init_post_delta, hc_init_comb_diag, hc_sinkhorn_iters, hc_post_magnitude), so this file imports nothing but torch.

def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def function_preserving_hc_base(config, sublayer_index: int) -> torch.Tensor:
    """``base`` (the ``map_sizes`` layout of ``config.hc_residual_map``, float32) of the function-preserving
    initialisation of site ``sublayer_index`` (attention of layer ``l`` is ``2l``, its MLP ``2l + 1``), with ``fn = 0``:
    ``pre = 1/n``, ``post`` in pairs ``2σ(±j·δ)`` of mean 1 (``s^(k+1)`` for ``"sinkhorn"``, whose ``comb_b = c·I``
    has row sums ``s = 1 - O(hc_eps)``), and a ``comb`` whose rows sum to 1: the stream mean then follows the residual
    network (the derivation is in the docs' math page). ``ValueError`` when ``hc_post_magnitude`` or
    ``hc_init_comb_diag`` cannot give these values.
    """
    n, eps, residual_map = config.hc_mult, config.hc_eps, config.hc_residual_map
    half_post = torch.full((n,), 0.5, dtype=torch.float64)  # σ(±j·δ) in pairs, 0.5 for the odd one: mean 1/2
    for pair in range(n // 2):
        half_post[2 * pair] = torch.sigmoid(torch.tensor((pair + 1) * config.hc_init_post_delta, dtype=torch.float64))
        half_post[2 * pair + 1] = 1.0 - half_post[2 * pair]
    sigmoid_pre_b = torch.full((n,), _logit(1.0 / n - eps), dtype=torch.float64)
    if residual_map == "unconstrained":
        parts = [torch.full((n,), 1.0 / n, dtype=torch.float64), 2 * half_post, torch.eye(n, dtype=torch.float64)]
    elif residual_map == "identity":
        magnitude = config.hc_post_magnitude
        sigmoid_post = (2 * half_post - eps) / magnitude
        if not bool(((sigmoid_post > 0) & (sigmoid_post < 1)).all()):
            raise ValueError(f"hc_post_magnitude={magnitude!r} cannot give the function-preserving post values "
                             f"(up to {2 * half_post.max().item():.4f}); use a larger hc_post_magnitude or a smaller "
                             f"hc_init_post_delta.")
        parts = [sigmoid_pre_b, torch.logit(sigmoid_post)]
    elif residual_map == "permutations":
        parts = [sigmoid_pre_b, torch.logit(half_post), _identity_permutation_bias(config)]
    else:
        comb_b = config.hc_init_comb_diag * torch.eye(n, dtype=torch.float64)
        row_sum = sinkhorn(comb_b.float(), config.hc_sinkhorn_iters, eps).double().sum(-1).mean()
        post_mean = row_sum ** (sublayer_index + 1)
        parts = [sigmoid_pre_b, torch.logit(post_mean * half_post), comb_b]
    return torch.cat([part.flatten() for part in parts]).float()


def _identity_permutation_bias(config) -> torch.Tensor:
    """``comb_b [n!]`` of the permutations map: ``b`` on the identity (the first permutation), 0 elsewhere, ``b``
    chosen so that ``comb``'s diagonal is that of mHC's start ``softmax(c·I)`` (``c = hc_init_comb_diag``; the
    derivation is in the docs' math page)."""
    n, c = config.hc_mult, config.hc_init_comb_diag
    bias = torch.zeros(math.factorial(n), dtype=torch.float64)
    if n == 1:
        return bias
    diagonal = math.exp(c) / (math.exp(c) + n - 1)
    others = (math.factorial(n - 1) - 1) / (math.factorial(n) - 1)
    weight = (diagonal - others) / (1 - others)
    if not 0 < weight < 1:
        raise ValueError(f"hc_init_comb_diag={c!r} is too small for hc_residual_map='permutations': comb's diagonal "
                         f"{diagonal:.4f} would need a negative weight; use hc_init_comb_diag >= 0.")
    bias[0] = math.log(weight * (math.factorial(n) - 1) / (1 - weight))
    return bias


def function_preserving_head_base(config) -> torch.Tensor:
    """``hc_base [n]`` making the head average the streams: ``pre_h = 1/n`` exactly (with ``hc_fn = 0``)."""
    return torch.full((config.hc_mult,), _logit(1.0 / config.hc_mult - config.hc_eps), dtype=torch.float32)
