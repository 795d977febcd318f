"""Stability diagnostics of mHC models: the mHC paper's gain measures, Sinkhorn residuals and stream collapse.

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
:class:`MHCStabilityCallback` logs the report through ``Trainer.log`` every N steps; :func:`inspect_main` is the
``hf-mhc inspect`` command.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

SUBLAYER_NAMES: tuple[str, ...] = ("attn", "ffn")
HC_SITE_CLASS = "MHCHyperConnection"
HC_HEAD_CLASS = "MHCHyperHead"
SCALAR_PREFIX = "mhc/"
DEFAULT_RESIDUAL_MAP = "sinkhorn"

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

    Args:
        model: an mHC model (``MHCForCausalLM``, ``MHCModel``, a PEFT model around one, ...). Run in eval mode
            without gradients; its training mode is restored afterwards.
        input_ids: ``[B, T]`` (or ``[T]``) token ids.
        attention_mask: ``[B, T]``, optional; statistics cover only the tokens it keeps.

    Returns:
        A dict with

        - ``"hc_residual_map"`` (the variant measured, see :func:`residual_map_of`), ``"hc_mult"`` (n),
          ``"num_layers"``, ``"num_tokens"`` (tokens measured);
        - ``"sites"``: one dict per HC site in depth order, with ``"layer"``, ``"sublayer"`` (``"attn"`` / ``"ffn"``),
          the scalars of :data:`SITE_SCALARS` and, for plots, ``"comb_token_mean"`` (``n x n`` nested list),
          ``"pre_stream_mean"`` / ``"post_stream_mean"`` (``n`` lists). Gains are those of the map as applied,
          ``M = comb^T`` (per token; ``_max`` / ``_mean`` over tokens; not bounded by 1 for ``"unconstrained"``
          maps); ``cumulative_*`` are the gains of the product
          ``M_s ... M_1 M_0`` of the maps from the embedding through this site; ``comb_*_sum_max_deviation`` is the
          largest ``|sum - 1|`` over tokens of ``comb``'s rows / columns and ``comb_{row|col}_sum_{min|max}`` the range
          of those sums; ``stream_cosine_*`` is the mean pairwise
          cosine similarity of the streams entering the site (mean / max over tokens; ``None`` for n = 1);
        - ``"composite"``: ``forward_gain_max``, ``forward_gain_mean``, ``backward_gain_max``, ``backward_gain_mean``
          of the product over the whole depth (float64);
        - ``"summary"``: flat scalars over all sites (composite gains, the largest site gains and deviations, stream
          similarity, the ``pre`` / ``post`` range), the keys :func:`report_scalars` logs.
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


PLOT_MIN_HALF_SPAN = 0.05  # y-axes of values near 1 span at least 1 ± this, so float noise stays flat
PLOT_LOG_GAIN_ABOVE = 10.0  # the gains panel turns logarithmic when a gain exceeds this (unconstrained maps)


def _set_y_limits(axis, values: list[float], center: float | None = 1.0, half_span: float = PLOT_MIN_HALF_SPAN) -> None:
    """Set ``axis``'s y-range to cover ``values`` plus a 5 % margin and at least ``center ± half_span`` (around the
    values' middle when ``center`` is None): differences of 1e-6 then draw as a flat line, not as a cliff."""
    finite = [value for value in values if value is not None and math.isfinite(value)]
    if not finite:
        return
    low, high = min(finite), max(finite)
    margin = 0.05 * (high - low)
    middle = (low + high) / 2 if center is None else center
    axis.set_ylim(min(low - margin, middle - half_span), max(high + margin, middle + half_span))


def _reference_line(axis, value: float, label: str) -> None:
    axis.axhline(value, color="0.4", linestyle="--", linewidth=1.0, label=label, zorder=1)


def overview_figure(report: dict[str, Any]):
    """The ``matplotlib.figure.Figure`` of ``overview.png`` (see :func:`plot_report`): four panels over the HC sites.

    Gains (per site and cumulative) and ``comb``'s row / column sums have a dashed reference line at 1 (the
    doubly stochastic value) and a y-range of at least ``1 ± PLOT_MIN_HALF_SPAN``; so has the stream similarity (1 =
    collapsed streams). Every panel labels its y-axis.
    """
    from matplotlib.figure import Figure

    sites = report["sites"]
    positions = list(range(len(sites)))
    labels = [f"{site['layer']}{site['sublayer'][0]}" for site in sites]

    figure = Figure(figsize=(12, 8))
    axes = figure.subplots(2, 2)
    figure.subplots_adjust(left=0.08, right=0.98, top=0.91, bottom=0.08, hspace=0.4, wspace=0.3)
    gains = axes[0, 0]
    gain_keys = (
        ("forward_gain_max", "site forward"),
        ("backward_gain_max", "site backward"),
        ("cumulative_forward_gain_max", "cumulative forward"),
        ("cumulative_backward_gain_max", "cumulative backward"),
    )
    for key, label in gain_keys:
        gains.plot(positions, [site[key] for site in sites], marker="o", label=label)
    _reference_line(gains, 1.0, "1 (doubly stochastic)")
    gain_values = [site[key] for site in sites for key, _ in gain_keys]
    if max(gain_values) > PLOT_LOG_GAIN_ABOVE:
        gains.set_yscale("log")
    else:
        _set_y_limits(gains, gain_values)
    gains.set_title("gain of the residual mixing (max over tokens)")
    gains.set_ylabel("gain (max |row| / |column| sum)")
    sums = axes[0, 1]
    for name, label in (("row", "rows"), ("col", "columns")):
        low = [site[f"comb_{name}_sum_min"] for site in sites]
        high = [site[f"comb_{name}_sum_max"] for site in sites]
        sums.fill_between(positions, low, high, alpha=0.3, label=f"{label} (min-max)")
        sums.plot(positions, high, marker="o", markersize=3, linewidth=0.8)
    _reference_line(sums, 1.0, "1")
    _set_y_limits(sums, [site[f"comb_{name}_sum_{end}"] for site in sites for name in ("row", "col")
                         for end in ("min", "max")])
    sums.set_title("comb: row and column sums (over tokens)")
    sums.set_ylabel("sum of a row / column of comb")
    cosine = axes[1, 0]
    if sites[0]["stream_cosine_mean"] is not None:
        cosine.plot(positions, [site["stream_cosine_mean"] for site in sites], marker="o", label="mean")
        cosine.plot(positions, [site["stream_cosine_max"] for site in sites], marker="o", label="max")
        _reference_line(cosine, 1.0, "1 (collapsed)")
        _set_y_limits(cosine, [site[key] for site in sites for key in ("stream_cosine_mean", "stream_cosine_max")])
    cosine.set_title("stream similarity entering the site")
    cosine.set_ylabel("mean pairwise cosine similarity")
    maps = axes[1, 1]
    for name in ("pre", "post"):
        maps.plot(positions, [site[f"{name}_mean"] for site in sites], marker="o", label=f"{name} mean")
        maps.fill_between(positions, [site[f"{name}_min"] for site in sites], [site[f"{name}_max"] for site in sites],
                          alpha=0.2, label=f"{name} min-max")
    _set_y_limits(maps, [site[f"{name}_{end}"] for site in sites for name in ("pre", "post") for end in ("min", "max")],
                  center=None)
    maps.set_title("pre / post (over tokens and streams)")
    maps.set_ylabel("coefficient")
    for axis in axes.flat:
        if axis.get_yscale() == "linear":
            axis.ticklabel_format(axis="y", useOffset=False)
        axis.set_xticks(positions, labels, fontsize=7)
        axis.set_xlabel("HC site (layer, a = attention, f = FFN)")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    figure.suptitle(f"mHC stability ({report['hc_residual_map']} residual maps), n = {report['hc_mult']}, "
                    f"{report['num_tokens']} tokens")
    return figure


def layer_figure(report: dict[str, Any], layer: int):
    """The ``matplotlib.figure.Figure`` of ``layer_{layer}.png`` (see :func:`plot_report`)."""
    from matplotlib.figure import Figure

    n = report["hc_mult"]
    streams = list(range(n))
    layer_sites = [site for site in report["sites"] if site["layer"] == layer]
    figure = Figure(figsize=(4 * (len(layer_sites) + 1), 3.6))
    axes = figure.subplots(1, len(layer_sites) + 1)
    figure.subplots_adjust(left=0.06, right=0.98, top=0.82, bottom=0.17, wspace=0.45)
    entries = [value for site in layer_sites for row in site["comb_token_mean"] for value in row]
    if min(entries) < 0:  # signed (unconstrained) maps: a diverging scale centred on 0 that holds every entry
        bound = max(1.0, max(abs(value) for value in entries))
        color_range = dict(vmin=-bound, vmax=bound, cmap="RdBu_r")
    else:
        color_range = dict(vmin=0.0, vmax=max(1.0, max(entries)), cmap="viridis")
    for axis, site in zip(axes[:-1], layer_sites, strict=True):
        image = axis.imshow(site["comb_token_mean"], **color_range)
        axis.set_title(f"{site['sublayer']} comb (token mean)")
        axis.set_xlabel("to stream i (X'_i = sum_j comb_ji X_j)")
        axis.set_ylabel("from stream j")
        axis.set_xticks(streams)
        axis.set_yticks(streams)
        figure.colorbar(image, ax=axis, shrink=0.8)
    bars = axes[-1]
    bar_width = 0.8 / (2 * len(layer_sites))
    for offset, (site, name) in enumerate(itertools.product(layer_sites, ("pre", "post"))):
        bars.bar([s + (offset - len(layer_sites) + 0.5) * bar_width for s in streams], site[f"{name}_stream_mean"],
                 width=bar_width, label=f"{site['sublayer']} {name}")
    bars.set_xticks(streams)
    bars.set_xlabel("stream")
    bars.set_ylabel("coefficient (token mean)")
    bars.set_title("pre / post (token mean)")
    coefficients = [value for site in layer_sites for value in site["post_stream_mean"] + site["pre_stream_mean"]]
    bars.set_ylim(1.4 * min(0.0, min(coefficients)), 1.4 * max(0.0, max(coefficients)))
    bars.legend(fontsize=7, loc="upper center", ncols=2)
    figure.suptitle(f"layer {layer} ({report['hc_residual_map']} residual maps)")
    return figure


def plot_report(report: dict[str, Any], out_dir: str | Path) -> list[Path]:
    """Write PNG plots of a :func:`stability_report` to ``out_dir`` (created) and return their paths.

    ``overview.png`` (:func:`overview_figure`): gains (per site and cumulative), ``comb``'s row / column sums, stream
    similarity and the ``pre`` / ``post`` ranges over depth. ``layer_{i}.png`` (:func:`layer_figure`), one per layer:
    the token-mean ``comb`` of its attention and FFN sites as heat maps and the per-stream mean ``pre`` / ``post``.
    Needs ``matplotlib`` (ImportError otherwise).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "overview.png"]
    overview_figure(report).savefig(written[0], dpi=100)
    for layer in range(report["num_layers"]):
        path = out_dir / f"layer_{layer}.png"
        layer_figure(report, layer).savefig(path, dpi=100)
        written.append(path)
    return written


class MHCStabilityCallback(TrainerCallback):
    """Log :func:`stability_report` scalars through ``Trainer.log`` at the start, every N steps and at the last step.

    The scalars (``mhc/composite_forward_gain``, ``mhc/max_comb_row_sum_deviation``, ... and with ``per_site`` also
    ``mhc/layer_{i}/{attn|ffn}/...``) reach every ``report_to`` integration (TensorBoard, W&B, ...) and
    ``trainer.state.log_history``. The first report also logs which variant was measured, ``mhc/hc_residual_map``
    (a string: TensorBoard records it as text; it is kept as ``hc_residual_map`` on the callback too), so runs of
    different variants share the scalar names and stay comparable on one chart. The report runs on every process
    (so sharded FSDP models work) on a fixed batch:
    ``input_ids`` / ``attention_mask`` when given, else the first ``num_samples`` examples of the trainer's training
    set, collated by its data collator.

    Example::

        trainer = Trainer(model=model, args=args, train_dataset=train_set)
        trainer.add_callback(MHCStabilityCallback(every_n_steps=50, trainer=trainer))
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        trainer: Trainer,
        num_samples: int = 4,
        per_site: bool = False,
    ):
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}.")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples!r}.")
        if attention_mask is not None and input_ids is None:
            raise ValueError("attention_mask given without input_ids.")
        if not isinstance(trainer, Trainer):
            raise TypeError(f"trainer must be a transformers Trainer, got {type(trainer).__name__}.")
        self.every_n_steps = every_n_steps
        self.input_ids = input_ids
        self.attention_mask = attention_mask
        self.trainer = trainer
        self.num_samples = num_samples
        self.per_site = per_site
        self.last_scalars: dict[str, float] = {}
        self.hc_residual_map: str | None = None

    def _sample_batch(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        dataset = self.trainer.train_dataset
        if dataset is None:
            raise ValueError("MHCStabilityCallback needs input_ids or a Trainer with a train_dataset.")
        examples = [
            {key: example[key] for key in ("input_ids", "attention_mask") if key in example}
            for example in itertools.islice(iter(dataset), self.num_samples)
        ]
        if not examples or "input_ids" not in examples[0]:
            raise ValueError("MHCStabilityCallback: the training set has no 'input_ids' column; pass input_ids.")
        batch = self.trainer.data_collator(examples)
        return torch.as_tensor(batch["input_ids"]), batch.get("attention_mask")

    def _log_report(self, control: TrainerControl) -> None:
        if self.input_ids is None:
            self.input_ids, self.attention_mask = self._sample_batch()
        # trainer.model: the model being trained (PEFT-wrapped, or sharded in place by FSDP2), not a DDP wrapper.
        report = stability_report(self.trainer.model, self.input_ids, self.attention_mask)
        self.last_scalars = report_scalars(report, per_site=self.per_site)
        logs: dict[str, float | str] = dict(self.last_scalars)
        if self.hc_residual_map is None:
            self.hc_residual_map = logs[f"{SCALAR_PREFIX}hc_residual_map"] = report["hc_residual_map"]
        pending_log = control.should_log  # Trainer.log clears it; the trainer's own log of this step must still run
        self.trainer.log(logs)
        control.should_log = pending_log

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs
    ) -> TrainerControl:
        self._log_report(control)
        return control

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs
    ) -> TrainerControl:
        if state.global_step % self.every_n_steps == 0 or state.global_step == state.max_steps:
            self._log_report(control)
        return control


def _load_for_inspection(checkpoint: str, device: torch.device, dtype: str) -> tuple[nn.Module, Any]:
    """The mHC model of ``checkpoint`` (a model folder / Hub id, or a PEFT adapter folder on an mHC base) and its
    tokenizer (``None`` when there is none)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_mhc  # noqa: F401  (registers model_type "mhc" with the Auto classes)

    from .configuration_mhc import load_pretrained_config

    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    is_adapter = (Path(checkpoint) / "adapter_config.json").is_file()
    base = checkpoint
    if is_adapter:
        if (Path(checkpoint) / "config.json").is_file():
            # transformers would load the model and silently apply the adapter beside it.
            raise ValueError(
                f"{checkpoint} holds both a model (config.json) and a PEFT adapter (adapter_config.json): move one of "
                "them to its own folder"
            )
        from .peft import adapter_base

        base = adapter_base(checkpoint)
    model_type = load_pretrained_config(base).model_type
    if model_type != "mhc":
        raise ValueError(f"{base} is a {model_type!r} model, not an mHC one: upcycle it first (hf_mhc.upcycle)")
    if is_adapter:
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(checkpoint, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch_dtype)
    tokenizer = None
    for source in dict.fromkeys((checkpoint, base)):
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            break
        except (OSError, ValueError):
            continue
    return model.to(device).eval(), tokenizer


DEFAULT_INSPECT_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families."
)


INSPECT_PROG = "hf-mhc inspect"
INSPECT_DESCRIPTION = (
    "Stability diagnostics of an mHC checkpoint: gains of the residual mixing per layer and over depth, Sinkhorn "
    "deviations, stream collapse, pre/post ranges."
)


def add_inspect_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``hf-mhc inspect`` arguments to ``parser`` (e.g. a subcommand parser) and return it."""
    parser.add_argument("checkpoint", help="mHC model folder or Hub id, or a PEFT adapter folder on an mHC model")
    parser.add_argument("--text", default=None, help="text to run the model on (default: a fixed English passage)")
    parser.add_argument("--plot", metavar="DIR", default=None, help="write overview.png and layer_{i}.png to DIR")
    parser.add_argument("--json", metavar="FILE", default=None, help="write the full report as JSON to FILE")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16", "float16"),
                        help="dtype of the backbone weights (HC weights stay float32; default float32)")
    return parser


def inspect_main(argv: list[str] | None = None) -> int:
    """``hf-mhc inspect CHECKPOINT [--text TEXT] [--plot DIR] [--json FILE]``: print an mHC checkpoint's stability.

    Parses ``argv`` (default ``sys.argv[1:]``) and runs :func:`run_inspect`; returns the exit status.
    """
    from .cli import BAD_INPUT_ERRORS, first_line

    parser = add_inspect_arguments(argparse.ArgumentParser(prog=INSPECT_PROG, description=INSPECT_DESCRIPTION))
    args = parser.parse_args(argv)
    try:
        return run_inspect(args)
    except BAD_INPUT_ERRORS as error:  # as hf-mhc's main: one line, no traceback
        print(f"{INSPECT_PROG}: error: {first_line(error)}", file=sys.stderr)
        return 1


def run_inspect(args: argparse.Namespace) -> int:
    """Run ``hf-mhc inspect`` on parsed arguments (see :func:`add_inspect_arguments`).

    Loads the checkpoint (an mHC model, or a PEFT adapter whose base is one), runs :func:`stability_report` on the
    text (tokenised with the checkpoint's tokenizer; without one, 64 random token ids with seed 0), prints the table of
    :func:`format_report` and optionally writes the report as JSON and PNG plots (:func:`plot_report`, needs
    matplotlib). The JSON is strict: a NaN or infinite value is ``null``, and ``non_finite_values`` maps where it was
    to what it was (``{"sites[0].forward_gain_max": "nan"}``); ``non_finite_parameters`` names the model's parameters
    holding NaN or inf. Returns the exit status: 0 on success, 1 when the checkpoint or input cannot be used or the
    report is not finite (one ``hf-mhc inspect: error: ...`` line on stderr; no plots then).
    """

    from .cli import first_line, folder_error, output_path_error

    def fail(message: str) -> int:
        print(f"{INSPECT_PROG}: error: {' '.join(message.split())}", file=sys.stderr)
        return 1

    missing = folder_error(args.checkpoint)
    if missing is not None:
        return fail(missing)
    if args.text is not None and not args.text.strip():
        return fail("--text is empty; give text to run the model on, or leave --text out for the default passage")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return fail("--plot needs matplotlib: pip install matplotlib")
    for option, path, folder in (("--plot", args.plot, True), ("--json", args.json, False)):
        unusable = None if path is None else output_path_error(path, folder=folder)
        if unusable is not None:
            return fail(f"{option} {path}: {unusable}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        return fail(f"--device {args.device!r} is not a torch device")
    if device.type == "cuda" and not torch.cuda.is_available():
        return fail("--device cuda: CUDA is not available on this machine")
    try:
        model, tokenizer = _load_for_inspection(args.checkpoint, device, args.dtype)
    except (OSError, ValueError) as exc:
        return fail(f"cannot load {args.checkpoint}: {first_line(exc)}")

    if tokenizer is not None:
        text = DEFAULT_INSPECT_TEXT if args.text is None else args.text
        input_ids = tokenizer(text, return_tensors="pt")["input_ids"]
        if input_ids.numel() == 0:
            return fail("--text is empty after tokenisation.")
    elif args.text is not None:
        return fail(f"{args.checkpoint} has no tokenizer to encode --text.")
    else:
        print(f"{args.checkpoint} has no tokenizer: measuring on 64 random token ids (seed 0)")
        vocab_size = model.config.get_text_config().vocab_size
        input_ids = torch.randint(0, vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))

    report = stability_report(model, input_ids)
    print(format_report(report))
    non_finite_parameters = [name for name, parameter in model.named_parameters()
                             if not torch.isfinite(parameter).all()]
    finite_report, non_finite_values = _json_ready(report)
    if args.json is not None:
        json_path = Path(args.json).expanduser()
        json_path.parent.mkdir(parents=True, exist_ok=True)
        finite_report |= {"non_finite_parameters": non_finite_parameters, "non_finite_values": non_finite_values}
        json_path.write_text(json.dumps(finite_report, indent=2, allow_nan=False), encoding="utf-8")
        print(f"report written to {args.json}")
    if non_finite_parameters or non_finite_values:
        what = (f"non-finite parameters: {_first_names(non_finite_parameters)}" if non_finite_parameters else
                f"non-finite report values: {_first_names(list(non_finite_values))}")
        written = ("null in --json (its non_finite_values lists them)" if args.json is not None
                   else "nan / inf in the table")
        return fail(f"{what}; the report's non-finite values are {written}{'; no plots written' if args.plot else ''}")
    if args.plot is not None:
        paths = plot_report(report, Path(args.plot).expanduser())
        print(f"{len(paths)} plots written to {args.plot}")
    return 0


def _json_ready(value: Any, path: str = "") -> tuple[Any, dict[str, str]]:
    """``value`` (a :func:`stability_report` or part of it) with every NaN / infinite float replaced by ``None``, and
    where those were: ``{"sites[0].forward_gain_max": "nan", ...}`` (strict JSON has no NaN or Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None, {path: repr(value)}
    found: dict[str, str] = {}
    if isinstance(value, dict):
        ready = {}
        for key, item in value.items():
            ready[key], where = _json_ready(item, f"{path}.{key}" if path else key)
            found |= where
        return ready, found
    if isinstance(value, list):
        ready = []
        for index, item in enumerate(value):
            item, where = _json_ready(item, f"{path}[{index}]")
            ready.append(item)
            found |= where
        return ready, found
    return value, found


def _first_names(names: list[str], shown: int = 3) -> str:
    """``a, b, c and 4 more``."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


__all__ = [
    "SITE_SCALARS",
    "HCCapture",
    "HCSiteMaps",
    "MHCStabilityCallback",
    "add_inspect_arguments",
    "capture_hc_maps",
    "format_report",
    "inspect_main",
    "layer_figure",
    "mean_pairwise_stream_cosine",
    "overview_figure",
    "plot_report",
    "report_scalars",
    "residual_map_of",
    "run_inspect",
    "stability_report",
]
