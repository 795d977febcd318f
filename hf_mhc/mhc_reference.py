"""Plain-torch mHC maps: the reference formula (stated in the README, "The math"), the one place this math is written.

Shapes: streams ``X`` are ``[..., n, C]`` (usually ``[B, T, n, C]``) in the model dtype; every
coefficient is computed in float32 whatever that dtype is. This file ships flat beside
``modeling_mhc.py`` in every saved checkpoint, so it imports nothing but torch.
"""

from __future__ import annotations

import itertools
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


RESIDUAL_MAPS: tuple[str, ...] = ("sinkhorn", "unconstrained", "identity", "permutations")
MAX_PERMUTATION_STREAMS = 4  # permutations mixes all n! permutation matrices: 24 at n = 4, 120 at n = 5


def map_sizes(n: int, residual_map: str = "sinkhorn") -> tuple[int, int, int]:
    """Columns of ``mix`` (rows of ``fn``, entries of ``base``) for ``pre``, ``post`` and ``comb``: ``comb`` has
    ``n*n`` for sinkhorn and unconstrained, none for identity and ``n!`` (one weight per permutation) for
    permutations."""
    comb = {"sinkhorn": n * n, "unconstrained": n * n, "identity": 0, "permutations": math.factorial(n)}
    if residual_map not in comb:
        raise ValueError(f"Unknown residual map {residual_map!r}; available maps: {', '.join(RESIDUAL_MAPS)}.")
    return n, n, comb[residual_map]


def scale_size(residual_map: str = "sinkhorn") -> int:
    """Entries of ``scale``: one per map group (pre, post[, comb])."""
    return 2 if residual_map == "identity" else 3


def streams_of(base: torch.Tensor, residual_map: str) -> int:
    """``n`` from the length of ``base`` (``sum(map_sizes(n, residual_map))``)."""
    for n in range(1, base.shape[0] + 1):
        if sum(map_sizes(n, residual_map)) == base.shape[0]:
            return n
    raise ValueError(f"A base of {base.shape[0]} entries fits no stream count for residual_map={residual_map!r}.")


def permutation_matrices(n: int, device=None) -> torch.Tensor:
    """The ``n!`` permutation matrices ``[n!, n, n]`` (float32) in ``itertools.permutations`` order, which is
    lexicographic and starts with the identity: ``P_k[i, j] = 1`` where ``j = perm_k[i]``."""
    order = torch.tensor(list(itertools.permutations(range(n))), device=device)  # [n!, n]
    return torch.eye(n, device=device)[order]


def mhc_maps(
    mix: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    *,
    sinkhorn_iters: int,
    eps: float,
    residual_map: str = "sinkhorn",
    post_magnitude: float = 2.0,
    sinkhorn_fn=sinkhorn,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pre [..., n]``, ``post [..., n]``, ``comb [..., n, n]`` (float32) from the projected streams ``mix`` (the
    columns of ``map_sizes(n, residual_map)``), with ``w = mix`` split into ``pre_w, post_w, comb_w``, ``base`` into
    ``pre_b, post_b, comb_b`` and ``scale`` into ``s0, s1[, s2]``:

    - ``"sinkhorn"`` (mHC): ``pre = σ(s0·pre_w + pre_b) + eps``, ``post = 2σ(s1·post_w + post_b)``,
      ``comb = Sinkhorn(s2·comb_w + comb_b)`` (``sinkhorn``).
    - ``"unconstrained"`` (Hyper-Connections): ``pre = s0·tanh(pre_w) + pre_b``, ``post = s1·tanh(post_w) + post_b``,
      ``comb = s2·tanh(comb_w) + comb_b``: static plus scaled-tanh dynamic maps, no projection, so ``comb`` may be
      negative and its rows and columns need not sum to 1.
    - ``"identity"`` (HY-V4): ``pre`` as mHC, ``post = post_magnitude·σ(s1·post_w + post_b) + eps``, ``comb = I``
      (no comb columns, ``scale`` has 2 entries).
    - ``"permutations"`` (mHC-lite): ``pre`` and ``post`` as mHC, ``comb = Σ_k w_k P_k`` over the ``n!`` permutation
      matrices (``permutation_matrices``) with ``w = softmax(s2·comb_w + comb_b)``: exactly doubly stochastic.

    ``sinkhorn_fn(logits, iters, eps)`` lets a caller swap in a memory-light Sinkhorn with the same numbers.
    """
    n = streams_of(base, residual_map)
    sizes = map_sizes(n, residual_map)
    pre_w, post_w, comb_w = mix.split(sizes, dim=-1)
    pre_b, post_b, comb_b = base.float().split(sizes)
    pre_scale, post_scale, *comb_scale = scale.float().unbind(0)
    if residual_map == "unconstrained":
        pre = pre_scale * torch.tanh(pre_w) + pre_b
        post = post_scale * torch.tanh(post_w) + post_b
        comb = comb_scale[0] * torch.tanh(comb_w.unflatten(-1, (n, n))) + comb_b.view(n, n)
        return pre, post, comb
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + eps
    if residual_map == "identity":
        post = post_magnitude * torch.sigmoid(post_w * post_scale + post_b) + eps
        return pre, post, torch.eye(n, device=mix.device).expand(*mix.shape[:-1], n, n)
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    if residual_map == "permutations":
        weights = torch.softmax(comb_w * comb_scale[0] + comb_b, dim=-1)
        comb = weights @ permutation_matrices(n, mix.device).flatten(1)  # [..., n!] @ [n!, n*n]
        return pre, post, comb.unflatten(-1, (n, n))
    comb_logits = comb_w.unflatten(-1, (n, n)) * comb_scale[0] + comb_b.view(n, n)
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
    residual_map: str = "sinkhorn",
    post_magnitude: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-dependent maps of one sublayer (``mhc_maps`` of ``mhc_mix``).

    Args:
        streams: ``[..., n, C]``.
        fn: ``[m, n*C]``, base: ``[m]`` with ``m = sum(map_sizes(n, residual_map))`` (``(n+2)*n`` for mHC);
        scale: ``[scale_size(residual_map)]``.

    Returns:
        ``pre [..., n]``, ``post [..., n]``, ``comb [..., n, n]`` (the comb applied: the identity for
        ``"identity"``), all float32.
    """
    mix = mhc_mix(streams, fn, norm_eps)
    return mhc_maps(mix, base, scale, sinkhorn_iters=sinkhorn_iters, eps=eps, residual_map=residual_map,
                    post_magnitude=post_magnitude)


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
    residual_map: str = "sinkhorn",
    post_magnitude: float = 2.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A site's entry: the sublayer input ``y [..., C]`` (streams' dtype), ``post [..., n]`` and ``comb [..., n, n]``
    (float32; ``None`` for the identity map, which has nothing to mix), i.e. ``mhc_coeffs`` then ``mhc_pre``."""
    pre, post, comb = mhc_coeffs(streams, fn, base, scale, sinkhorn_iters=sinkhorn_iters, eps=eps, norm_eps=norm_eps,
                                 residual_map=residual_map, post_magnitude=post_magnitude)
    return mhc_pre(streams, pre), post, None if residual_map == "identity" else comb


def mhc_post_res(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor,
                 comb: torch.Tensor | None) -> torch.Tensor:
    """New streams ``X'[i] = post[i] * y + sum_j comb[j, i] * X[j]`` (comb applied transposed).

    Args:
        streams: ``[..., n, C]``; y: the sublayer output ``[..., C]``; post: ``[..., n]``; comb: ``[..., n, n]``, or
            ``None`` for the identity (``X'[i] = post[i] * y + X[i]``, no mixing).

    Returns:
        ``[..., n, C]`` in the streams' dtype, computed in float32.
    """
    mixed = streams.float() if comb is None else torch.matmul(comb.float().transpose(-1, -2), streams.float())
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


# Function-preserving initialisation. `config` is an MHCConfig (read by attribute: hc_mult, hc_eps, hc_residual_map,
# hc_init_post_delta, hc_init_comb_diag, hc_sinkhorn_iters, hc_post_magnitude), so this file imports nothing but torch.

def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def function_preserving_hc_base(config, sublayer_index: int) -> torch.Tensor:
    """``base`` (the ``map_sizes`` layout of ``config.hc_residual_map``) of the function-preserving initialisation,
    with ``fn = 0`` (so every map equals its static part).

    Why the stream mean ``m = mean_i X[i]`` then follows the residual network, ``m <- m + F(m)``: the merge gives
    ``mean_i X'[i] = mean(post) · y + (1/n) Σ_j (Σ_i comb[j, i]) X[j]``, and the collapse ``y = F(Σ_i pre[i] X[i])``.
    With ``pre = 1/n`` the sublayer sees ``F(m)``; with ``mean(post) = 1`` and every row of ``comb`` summing to 1
    the new mean is ``m + F(m)``. The streams start as copies of the embedding and the head averages them, so the
    model computes its backbone. Per map:

    - ``"sinkhorn"``: ``pre = 1/n`` exactly and ``comb_b = c·I``. A symmetric ``comb`` has equal row and column sums
      ``s``, which the ``hc_eps`` terms of Sinkhorn make ``1 - O(hc_eps)``, so each site scales the stream mean by
      ``s``. The ``post`` values of site ``k`` are ``s^(k+1) · 2σ(±j·δ)`` in pairs (``j = 1, 2, ...``; ``s^(k+1)``
      alone for odd n): their mean ``s^(k+1)`` scales the sublayer output like the residual, so the stream mean after
      site ``k`` is exactly ``s^(k+1)`` times the residual network's hidden state. Pre-norm sublayers and the final
      norm cancel that uniform scale, so the model reproduces its backbone to float32 rounding rather than to
      ``hc_eps · depth``.
    - ``"unconstrained"``: ``pre_b = 1/n``, ``post_b = 2σ(±j·δ)`` (mean 1), ``comb_b = I``: exact.
    - ``"identity"``: ``pre = 1/n`` as mHC, ``post = m·σ(post_b) + hc_eps = 2σ(±j·δ)`` (``m = hc_post_magnitude``),
      ``comb = I``: exact.
    - ``"permutations"``: ``pre`` and ``post`` as mHC (``post_b = ±j·δ``), ``comb_b`` zero but for the identity
      permutation's weight, chosen so that ``comb``'s diagonal is that of ``softmax(c·I)`` (the mHC start); ``comb``
      is a convex combination of permutation matrices, so its rows sum to 1 exactly: exact.

    Distinct ``j·δ`` keep every stream different (identical streams would get identical gradients forever).
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
    """``comb_b [n!]`` of the permutations map: ``b`` on the identity (the first permutation), 0 elsewhere. Then
    ``comb = w·I + (1 - w)/(n! - 1) · ((n-1)!·J - I)`` (each entry is 1 in ``(n-1)!`` permutations) with
    ``w = e^b / (e^b + n! - 1)``; ``b`` makes its diagonal ``d = e^c / (e^c + n - 1)``, the diagonal of mHC's start
    ``softmax(c·I)`` (``c = hc_init_comb_diag``): ``w = (d - r) / (1 - r)`` with ``r = ((n-1)! - 1) / (n! - 1)``."""
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
