"""The stability report of mHC models: the mHC paper's gain measures, Sinkhorn residuals and stream collapse.

Every HC site (the attention and the FFN sublayer of each layer) mixes the ``n`` residual streams with
``X' = comb^T X`` (plus the sublayer output). Per token, the residual path through the network is the product of
those mixing maps; the paper measures it by its *forward gain* (max absolute row sum ``max_i sum_j |M_ij|``, how much
a signal can grow on the way up) and *backward gain* (max absolute column sum ``max_j sum_i |M_ij|``, how much a
gradient can grow on the way down). The maps measured are those the model's residual-map variant
(``config.hc_residual_map``) applies, whatever their signs and sums: for doubly stochastic ``comb`` (``"sinkhorn"``,
``"permutations"``) both gains are 1 however deep the network, for ``"identity"`` exactly 1, while unconstrained
hyper-connections (``"unconstrained"``) are not bounded and reach thousands in the paper.

:func:`stability_report` measures, per site and for the composite over depth, those gains (max and mean over
tokens), how far ``comb``'s row and column sums are from 1, how alike the streams are (mean pairwise cosine
similarity, where 1 means the streams have collapsed into one), and the range of ``pre`` / ``post``. The maps are
captured with forward hooks on the HC modules, so any mHC model (also PEFT-wrapped or loaded as remote code) works.
:func:`report_scalars` flattens the report for loggers and :func:`format_report` prints it as a table.

"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..mhc_reference import DEFAULT_RESIDUAL_MAP

SUBLAYER_NAMES: tuple[str, ...] = ("attn", "ffn")
HC_SITE_CLASS = "MHCHyperConnection"
HC_HEAD_CLASS = "MHCHyperHead"
SCALAR_PREFIX = "mhc/"

# Per-site scalars of the report, in table order.
SITE_SCALARS: tuple[str, ...] = (
    "forward_gain_max",
    "forward_gain_mean",
    "backward_gain_max",
    "backward_gain_mean",
    "cumulative_forward_gain_max",
    "cumulative_backward_gain_max",
    "comb_row_sum_max_deviation",
    "comb_col_sum_max_deviation",
    "stream_cosine_mean",
    "stream_cosine_max",
    "pre_mean",
    "pre_min",
    "pre_max",
    "post_mean",
    "post_min",
    "post_max",
)


@dataclass
class HCSiteMaps:
    """What one HC site computed in a forward pass (float32, detached).

    ``pre``, ``post``: ``[B, T, n]``; ``comb``: ``[B, T, n, n]`` (applied as ``X' = comb^T X``);
    ``stream_cosine``: ``[B, T]`` mean pairwise cosine similarity of the streams entering the site (``None`` for n = 1).
    """

    pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    stream_cosine: torch.Tensor | None


@dataclass
class HCCapture:
    """The maps of every HC site, keyed by ``sublayer_index`` (``2 * layer`` attention, ``2 * layer + 1`` FFN), and the
    stream similarity entering the final read-out (``[B, T]``, ``None`` for n = 1 or before a forward pass)."""

    sites: dict[int, HCSiteMaps]
    final_stream_cosine: torch.Tensor | None = None


def mean_pairwise_stream_cosine(streams: torch.Tensor) -> torch.Tensor | None:
    """Mean cosine similarity over the ``n (n - 1) / 2`` pairs of streams: ``[..., n, C] -> [...]`` (float32).

    1 means the streams have collapsed into one direction; ``None`` for a single stream (no pairs).
    """
    n = streams.shape[-2]
    if n < 2:
        return None
    unit = nn.functional.normalize(streams.detach().float(), dim=-1)
    gram = unit @ unit.transpose(-1, -2)
    off_diagonal_sum = gram.sum(dim=(-1, -2)) - gram.diagonal(dim1=-2, dim2=-1).sum(-1)
    return off_diagonal_sum / (n * (n - 1))


def _modules_of_class(model: nn.Module, class_name: str) -> list[nn.Module]:
    # Matched by class name so that the classes of a checkpoint loaded as remote code count too.
    return [module for module in model.modules() if type(module).__name__ == class_name]


@contextmanager
def capture_hc_maps(model: nn.Module) -> Iterator[HCCapture]:
    """Record ``pre``, ``post``, ``comb`` and the stream similarity of every HC site during forward passes.

    Forward hooks on the model's ``MHCHyperConnection`` / ``MHCHyperHead`` modules, removed on exit. A site that runs
    several times (e.g. during ``generate``) keeps its last call.

    Example::

        with capture_hc_maps(model) as capture:
            model(input_ids)
        comb_of_layer_0_ffn = capture.sites[1].comb  # [B, T, n, n]
    """
    sites = _modules_of_class(model, HC_SITE_CLASS)
    if not sites:
        raise ValueError(f"{type(model).__name__} has no {HC_SITE_CLASS} modules: not an mHC model.")
    capture = HCCapture(sites={})

    def record_site(module: nn.Module, args: tuple[Any, ...], output: tuple[torch.Tensor, ...]) -> None:
        with torch.no_grad():
            pre, post, comb = module.maps(args[0])  # the site's forward returns the collapsed input, not pre
        capture.sites[module.sublayer_index] = HCSiteMaps(
            pre=pre.detach().float(),
            post=post.detach().float(),
            comb=comb.detach().float(),
            stream_cosine=mean_pairwise_stream_cosine(args[0]),
        )

    def record_head(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        capture.final_stream_cosine = mean_pairwise_stream_cosine(args[0])

    handles = [module.register_forward_hook(record_site) for module in sites]
    handles += [module.register_forward_hook(record_head) for module in _modules_of_class(model, HC_HEAD_CLASS)]
    try:
        yield capture
    finally:
        for handle in handles:
            handle.remove()


def residual_map_of(model: nn.Module) -> str:
    """The residual-map variant (``config.hc_residual_map``: ``"sinkhorn"``, ``"unconstrained"``, ...) the HC sites of
    ``model`` apply, read from their config (so PEFT-wrapped and remote-code models work)."""
    sites = _modules_of_class(model, HC_SITE_CLASS)
    if not sites:
        raise ValueError(f"{type(model).__name__} has no {HC_SITE_CLASS} modules: not an mHC model.")
    # A config from before the option existed has no such field: its maps are Sinkhorn ones, the only kind then.
    return getattr(sites[0].config, "hc_residual_map", DEFAULT_RESIDUAL_MAP)


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _token_mask(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    if attention_mask is None:
        return torch.ones(input_ids.shape, dtype=torch.bool)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}."
        )
    mask = attention_mask.bool().cpu()
    if not mask.any():
        raise ValueError("attention_mask masks every token: nothing to measure.")
    return mask


def _gains(applied: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token forward gain (max absolute row sum, ``max_i sum_j |M_ij|``) and backward gain (max absolute column
    sum, ``max_j sum_i |M_ij|``) of ``applied [N, n, n]``; signed entries count with their magnitudes."""
    magnitude = applied.abs()
    return magnitude.sum(-1).amax(-1), magnitude.sum(-2).amax(-1)


def _min_mean_max(values: torch.Tensor) -> tuple[float, float, float]:
    return values.min().item(), values.double().mean().item(), values.max().item()


def _site_name(sublayer_index: int) -> tuple[int, str]:
    return sublayer_index // 2, SUBLAYER_NAMES[sublayer_index % 2]


@torch.no_grad()
def stability_report(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> dict[str, Any]:
    """Run ``model`` on ``input_ids`` and measure the stability of its mHC residual mixing.

    The report is a dict with these keys:

    - ``"hc_residual_map"`` (the variant measured, see :func:`residual_map_of`), ``"hc_mult"`` (n), ``"num_layers"``,
      ``"num_tokens"`` (tokens measured);
    - ``"sites"``: one dict per HC site in depth order, with ``"layer"``, ``"sublayer"`` (``"attn"`` / ``"ffn"``), the
      scalars of :data:`SITE_SCALARS` and, for plots, ``"comb_token_mean"`` (``n x n`` nested list),
      ``"pre_stream_mean"`` / ``"post_stream_mean"`` (``n`` lists). Gains are those of the map as applied,
      ``M = comb^T`` (per token; ``_max`` / ``_mean`` over tokens; not bounded by 1 for ``"unconstrained"`` maps);
      ``cumulative_*`` are the gains of the product ``M_s ... M_1 M_0`` of the maps from the embedding through this
      site; ``comb_*_sum_max_deviation`` is the largest ``|sum - 1|`` over tokens of ``comb``'s rows / columns and
      ``comb_{row|col}_sum_{min|max}`` the range of those sums; ``stream_cosine_*`` is the mean pairwise cosine
      similarity of the streams entering the site (mean / max over tokens; ``None`` for n = 1);
    - ``"composite"``: ``forward_gain_max``, ``forward_gain_mean``, ``backward_gain_max``, ``backward_gain_mean`` of
      the product over the whole depth (float64);
    - ``"summary"``: flat scalars over all sites (composite gains, the largest site gains and deviations, stream
      similarity, the ``pre`` / ``post`` range), the keys :func:`report_scalars` logs.

    Args:
        model: an mHC model (``MHCForCausalLM``, ``MHCModel``, a PEFT model around one, ...). Run in eval mode
            without gradients; its training mode is restored afterwards.
        input_ids: ``[B, T]`` (or ``[T]``) token ids.
        attention_mask: ``[B, T]``, optional; statistics cover only the tokens it keeps.

    Returns:
        The report described above.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError("input_ids must be an integer torch.Tensor of token ids, shape [B, T] or [T].")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
        attention_mask = attention_mask.unsqueeze(0) if attention_mask is not None else None
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must have shape [B, T] with at least one token, got {tuple(input_ids.shape)}.")
    token_mask = _token_mask(input_ids, attention_mask)

    residual_map = residual_map_of(model)
    was_training = model.training
    model.eval()
    device = _model_device(model)
    try:
        with capture_hc_maps(model) as capture:
            model(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device) if attention_mask is not None else None,
                use_cache=False,
            )
    finally:
        model.train(was_training)

    expected_sites = {module.sublayer_index for module in _modules_of_class(model, HC_SITE_CLASS)}
    if set(capture.sites) != expected_sites or expected_sites != set(range(len(expected_sites))):
        raise RuntimeError(
            f"HC sites {sorted(capture.sites)} ran in the forward pass; expected 0 to {len(expected_sites) - 1}."
        )
    num_sites = len(expected_sites)
    n = capture.sites[0].comb.shape[-1]

    sites: list[dict[str, Any]] = []
    cumulative = torch.eye(n, dtype=torch.float64).expand(int(token_mask.sum()), n, n)
    for index in range(num_sites):
        maps = capture.sites[index]
        comb = maps.comb.cpu()[token_mask]  # [N, n, n]
        pre, post = maps.pre.cpu()[token_mask], maps.post.cpu()[token_mask]  # [N, n]
        applied = comb.double().transpose(-1, -2)
        cumulative = applied @ cumulative
        forward, backward = _gains(applied)
        row_sums, col_sums = comb.double().sum(-1), comb.double().sum(-2)  # [N, n] each
        cumulative_forward, cumulative_backward = _gains(cumulative)
        layer, sublayer = _site_name(index)
        site: dict[str, Any] = {
            "layer": layer,
            "sublayer": sublayer,
            "forward_gain_max": forward.max().item(),
            "forward_gain_mean": forward.mean().item(),
            "backward_gain_max": backward.max().item(),
            "backward_gain_mean": backward.mean().item(),
            "cumulative_forward_gain_max": cumulative_forward.max().item(),
            "cumulative_backward_gain_max": cumulative_backward.max().item(),
            "comb_row_sum_max_deviation": (row_sums - 1).abs().max().item(),
            "comb_col_sum_max_deviation": (col_sums - 1).abs().max().item(),
            "comb_row_sum_min": row_sums.min().item(),
            "comb_row_sum_max": row_sums.max().item(),
            "comb_col_sum_min": col_sums.min().item(),
            "comb_col_sum_max": col_sums.max().item(),
            "stream_cosine_mean": None,
            "stream_cosine_max": None,
        }
        if maps.stream_cosine is not None:
            cosine = maps.stream_cosine.cpu()[token_mask]
            site["stream_cosine_mean"] = cosine.double().mean().item()
            site["stream_cosine_max"] = cosine.max().item()
        site["pre_min"], site["pre_mean"], site["pre_max"] = _min_mean_max(pre)
        site["post_min"], site["post_mean"], site["post_max"] = _min_mean_max(post)
        site["comb_token_mean"] = comb.double().mean(0).tolist()
        site["pre_stream_mean"] = pre.double().mean(0).tolist()
        site["post_stream_mean"] = post.double().mean(0).tolist()
        sites.append(site)

    composite_forward, composite_backward = _gains(cumulative)
    composite = {
        "forward_gain_max": composite_forward.max().item(),
        "forward_gain_mean": composite_forward.mean().item(),
        "backward_gain_max": composite_backward.max().item(),
        "backward_gain_mean": composite_backward.mean().item(),
    }
    final_cosine = None
    if capture.final_stream_cosine is not None:
        final_cosine = capture.final_stream_cosine.cpu()[token_mask].double().mean().item()
    return {
        "hc_residual_map": residual_map,
        "hc_mult": n,
        "num_layers": (num_sites + 1) // 2,
        "num_tokens": int(token_mask.sum()),
        "sites": sites,
        "composite": composite,
        "summary": _summary(sites, composite, final_cosine),
    }


def _summary(sites: list[dict[str, Any]], composite: dict[str, float], final_cosine: float | None) -> dict[str, float]:
    summary = {
        "composite_forward_gain": composite["forward_gain_max"],
        "composite_forward_gain_mean": composite["forward_gain_mean"],
        "composite_backward_gain": composite["backward_gain_max"],
        "composite_backward_gain_mean": composite["backward_gain_mean"],
        "max_site_forward_gain": max(site["forward_gain_max"] for site in sites),
        "max_site_backward_gain": max(site["backward_gain_max"] for site in sites),
        "max_comb_row_sum_deviation": max(site["comb_row_sum_max_deviation"] for site in sites),
        "max_comb_col_sum_deviation": max(site["comb_col_sum_max_deviation"] for site in sites),
        "pre_min": min(site["pre_min"] for site in sites),
        "pre_max": max(site["pre_max"] for site in sites),
        "post_min": min(site["post_min"] for site in sites),
        "post_max": max(site["post_max"] for site in sites),
    }
    if sites[0]["stream_cosine_mean"] is not None:
        summary["stream_cosine_mean"] = sum(site["stream_cosine_mean"] for site in sites) / len(sites)
        summary["stream_cosine_max"] = max(site["stream_cosine_max"] for site in sites)
    if final_cosine is not None:
        summary["final_stream_cosine_mean"] = final_cosine
    return summary


def report_scalars(report: dict[str, Any], per_site: bool = False, prefix: str = SCALAR_PREFIX) -> dict[str, float]:
    """Flat ``{name: float}`` of a :func:`stability_report`, for ``Trainer.log`` / TensorBoard / W&B.

    Always the summary (``mhc/composite_forward_gain``, ``mhc/max_comb_row_sum_deviation``, ...); with ``per_site``
    also every site's scalars as ``mhc/layer_{i}/{attn|ffn}/{scalar}``.
    """
    scalars = {f"{prefix}{name}": float(value) for name, value in report["summary"].items()}
    if per_site:
        for site in report["sites"]:
            for name in SITE_SCALARS:
                if site[name] is not None:
                    scalars[f"{prefix}layer_{site['layer']}/{site['sublayer']}/{name}"] = float(site[name])
    return scalars


def _format_value(value: float | None, width: int, digits: int) -> str:
    if value is None:
        return "-".rjust(width)
    text = f"{value:.{digits}f}"
    if value != 0 and (abs(value) < 10 ** -(digits - 1) or len(text) > width - 1):
        text = f"{value:.2e}"
    return text.rjust(width)


def _gain_text(value: float) -> str:
    return f"{value:.6f}" if abs(value) < 1e6 else f"{value:.4e}"


def format_report(report: dict[str, Any]) -> str:
    """A :func:`stability_report` as a fixed-width text table: one row per HC site, then the composite."""
    gain_columns = (
        ("fwd max", "forward_gain_max"),
        ("fwd mean", "forward_gain_mean"),
        ("bwd max", "backward_gain_max"),
        ("bwd mean", "backward_gain_mean"),
        ("cum fwd", "cumulative_forward_gain_max"),
        ("cum bwd", "cumulative_backward_gain_max"),
    )
    other_columns = (
        ("|row-1|", "comb_row_sum_max_deviation"),
        ("|col-1|", "comb_col_sum_max_deviation"),
        ("cos mean", "stream_cosine_mean"),
        ("cos max", "stream_cosine_max"),
        ("pre min", "pre_min"),
        ("pre mean", "pre_mean"),
        ("pre max", "pre_max"),
        ("post min", "post_min"),
        ("post mean", "post_mean"),
        ("post max", "post_max"),
    )
    columns = [(title, key, 6) for title, key in gain_columns] + [(title, key, 4) for title, key in other_columns]
    width = 10
    lines = [
        f"mHC stability report ({report['hc_residual_map']} residual maps): n = {report['hc_mult']} streams, "
        f"{report['num_layers']} layers, {report['num_tokens']} tokens",
        "gains of the residual mixing X' = comb^T X per token (fwd: max_i sum_j |M_ij|, bwd: max_j sum_i |M_ij|; "
        "max / mean over tokens); cum: product from the embedding through the site; |row-1|, |col-1|: largest "
        "deviation of comb's row / column sums from 1; cos: mean pairwise cosine similarity of the streams entering "
        "the site (1 = collapsed)",
        "site".ljust(14) + "".join(title.rjust(width) for title, _, _ in columns),
    ]
    for site in report["sites"]:
        label = f"layer {site['layer']} {site['sublayer']}".ljust(14)
        lines.append(label + "".join(_format_value(site[key], width, digits) for _, key, digits in columns))
    composite = report["composite"]
    lines.append(
        f"composite over depth: forward gain max {_gain_text(composite['forward_gain_max'])} "
        f"mean {_gain_text(composite['forward_gain_mean'])}; backward gain max "
        f"{_gain_text(composite['backward_gain_max'])} mean {_gain_text(composite['backward_gain_mean'])}"
    )
    final_cosine = report["summary"].get("final_stream_cosine_mean")
    if final_cosine is not None:
        lines.append(f"streams entering the read-out: mean pairwise cosine similarity {final_cosine:.4f}")
    return "\n".join(lines)


__all__ = [
    "SITE_SCALARS",
    "HCCapture",
    "HCSiteMaps",
    "capture_hc_maps",
    "format_report",
    "mean_pairwise_stream_cosine",
    "report_scalars",
    "residual_map_of",
    "stability_report",
]
