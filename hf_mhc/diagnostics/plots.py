"""PNG plots of a :func:`hf_mhc.diagnostics.stability_report` with matplotlib (imported on use: ``pip install
hf-mhc[plot]``): an overview of every HC site over depth, and one figure per layer."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

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


__all__ = ["layer_figure", "overview_figure", "plot_report"]
