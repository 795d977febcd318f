"""``hf_mhc.diagnostics.plots``: the overview and per-layer figures label their axes, mark 1, draw float noise flat,
name the residual map measured and hold signed, expanding maps unclipped (caught at ``savefig``, nothing rendered)."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, randomize_hc
from diagnostics_helpers import known_signed_maps, three_layer_mhc_model

from hf_mhc.diagnostics import format_report, stability_report
from hf_mhc.diagnostics.plots import plot_report
from hf_mhc.mhc_reference import RESIDUAL_MAPS


def overview_and_layer_figures(report, tmp_path, monkeypatch):
    """The matplotlib figures plot_report draws, caught at savefig (nothing is rendered)."""
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, *args, **kwargs: figures.append(figure))
    plot_report(report, tmp_path / "plots")
    return figures[0], figures[1:]


def horizontal_lines_at(axis, value):
    return [line for line in axis.get_lines() if len(set(line.get_ydata())) == 1 and line.get_ydata()[0] == value]


def test_plots_label_their_y_axes_mark_1_and_draw_float_noise_flat(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    # Function-preserving init: every gain and comb sum is 1 up to hc_eps and float rounding (about 1e-6).
    report = stability_report(three_layer_mhc_model(hc_mult=4), torch.randint(3, VOCAB, (2, 9)))
    overview, layers = overview_and_layer_figures(report, tmp_path, monkeypatch)
    gains, sums, cosine, maps = overview.axes[:4]
    for axis in (gains, sums, cosine, maps):
        assert axis.get_ylabel(), axis.get_title()
    gain_keys = ("forward_gain_max", "backward_gain_max", "cumulative_forward_gain_max", "cumulative_backward_gain_max")
    for axis, keys in (
        (gains, gain_keys),
        (sums, ("comb_row_sum_min", "comb_row_sum_max", "comb_col_sum_min", "comb_col_sum_max")),
        (cosine, ("stream_cosine_mean", "stream_cosine_max")),
    ):
        assert horizontal_lines_at(axis, 1.0), axis.get_title()
        values = [site[key] for site in report["sites"] for key in keys]
        low, high = axis.get_ylim()
        assert low <= 0.95 and high >= 1.05, (axis.get_title(), low, high)
        assert low <= min(values) and max(values) <= high
    noise = max(abs(site[key] - 1) for site in report["sites"] for key in gain_keys)
    assert 0 < noise < 1e-4 and noise / (gains.get_ylim()[1] - gains.get_ylim()[0]) < 1e-3
    bars = [axis for figure in layers for axis in figure.axes if axis.get_xlabel() == "stream"]
    assert len(layers) == len(bars) == 3 and all(axis.get_ylabel() for axis in bars)

    # Gains far from 1 (one Sinkhorn round, random maps) widen the range to the data instead.
    one_round = randomize_hc(three_layer_mhc_model(hc_mult=4, hc_sinkhorn_iters=1))
    loose = stability_report(one_round, torch.randint(3, VOCAB, (2, 9)))
    gains = overview_and_layer_figures(loose, tmp_path, monkeypatch)[0].axes[0]
    largest = max(site["cumulative_backward_gain_max"] for site in loose["sites"])
    assert largest > 1.05 and gains.get_ylim()[1] >= largest and gains.get_ylim()[0] <= 0.95


@pytest.mark.parametrize("residual_map", RESIDUAL_MAPS)
def test_the_report_its_table_and_its_plots_name_the_variant_measured(residual_map, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    model = randomize_hc(three_layer_mhc_model(hc_mult=4, hc_residual_map=residual_map))
    report = stability_report(model, torch.randint(3, VOCAB, (1, 6)))
    assert report["hc_residual_map"] == model.config.hc_residual_map == residual_map
    assert format_report(report).startswith(f"mHC stability report ({residual_map} residual maps): n = 4 streams")
    overview, layers = overview_and_layer_figures(report, tmp_path, monkeypatch)
    assert all(f"({residual_map} residual maps)" in figure.get_suptitle() for figure in [overview, *layers])


def test_plots_of_signed_expanding_maps_are_not_clipped(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    model = three_layer_mhc_model(hc_mult=4)
    input_ids = torch.randint(3, VOCAB, (1, 6))
    known_signed_maps(model, monkeypatch, input_ids.shape, scale=1.5)
    report = stability_report(model, input_ids)
    overview, layers = overview_and_layer_figures(report, tmp_path, monkeypatch)
    gains = overview.axes[0]
    largest = max(site["cumulative_forward_gain_max"] for site in report["sites"])
    assert largest > 10 and gains.get_yscale() == "log" and gains.get_ylim()[1] >= largest
    for figure, layer in zip(layers, range(report["num_layers"]), strict=True):
        entries = torch.tensor([site["comb_token_mean"] for site in report["sites"] if site["layer"] == layer],
                               dtype=torch.float64)
        for image in (axis.get_images()[0] for axis in figure.axes if axis.get_images()):
            low, high = image.get_clim()
            assert low <= entries.min().item() < 0 and high >= entries.max().item(), (low, high)
        bars = next(axis for axis in figure.axes if axis.get_xlabel() == "stream")
        heights = [patch.get_height() for patch in bars.patches]
        assert bars.get_ylim()[0] <= min(heights) and bars.get_ylim()[1] >= max(heights)
