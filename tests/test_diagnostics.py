"""``hf_mhc.diagnostics``: the stability report's gains against float64 references (every residual map, padded
tokens, known signed maps), Sinkhorn properties, its scalars and table, the hooks it leaves behind, and the names of
the other diagnostics modules that import from it."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import VOCAB, randomize_hc, tiny_backbone_config
from diagnostics_helpers import known_signed_maps, three_layer_mhc_model
from transformers import LlamaForCausalLM

import hf_mhc.diagnostics as diagnostics
from hf_mhc import mhc_reference
from hf_mhc.diagnostics import SITE_SCALARS, capture_hc_maps, format_report, report_scalars, stability_report
from hf_mhc.diagnostics import callback as diagnostics_callback
from hf_mhc.diagnostics import cli as diagnostics_cli
from hf_mhc.diagnostics import plots as diagnostics_plots
from hf_mhc.mhc_reference import RESIDUAL_MAPS


def reference_comb(streams, hc, residual_map="sinkhorn"):
    """float64 ``comb [..., n, n]`` (the one applied) of one HC site from the streams entering it: the reference
    formula, ``hf_mhc.mhc_reference``, computed in float64."""
    _, _, comb = mhc_reference.mhc_coeffs(
        streams.double(), hc.fn.double(), hc.base.double(), hc.scale.double(), sinkhorn_iters=hc.hc_sinkhorn_iters,
        eps=hc.hc_eps, norm_eps=hc.norm_eps, residual_map=residual_map, post_magnitude=hc.config.hc_post_magnitude,
        compute_dtype=torch.float64)
    return comb


def site_inputs(model, input_ids, attention_mask):
    """The streams entering every HC site, in depth order, captured by this test's own forward pre-hooks."""
    entering = []
    sites = [module for layer in model.model.layers for module in (layer.attn_hc, layer.ffn_hc)]
    handles = [site.register_forward_pre_hook(lambda module, args: entering.append(args[0].detach())) for site in sites]
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=attention_mask)
    for handle in handles:
        handle.remove()
    return sites, entering


def test_function_preserving_init_has_unit_gains_and_identical_streams_at_the_embedding():
    model = three_layer_mhc_model(hc_mult=4)
    eps = model.config.hc_eps
    report = stability_report(model, torch.randint(3, VOCAB, (2, 11)))
    assert [(site["layer"], site["sublayer"]) for site in report["sites"]] == [
        (layer, sublayer) for layer in range(3) for sublayer in ("attn", "ffn")
    ]
    for site in report["sites"]:
        for key in ("forward_gain_max", "forward_gain_mean", "backward_gain_max", "backward_gain_mean"):
            assert abs(site[key] - 1) <= 4 * eps, (site["layer"], site["sublayer"], key, site[key])
        assert site["comb_row_sum_max_deviation"] <= 4 * eps
        assert site["comb_col_sum_max_deviation"] <= 4 * eps
        assert site["pre_min"] == pytest.approx(0.25, abs=1e-6) and site["pre_max"] == pytest.approx(0.25, abs=1e-6)
        assert site["post_min"] < 1 < site["post_max"]  # the ±δ pairs
    for key, value in report["composite"].items():
        assert abs(value - 1) <= 4 * eps * len(report["sites"]), (key, value)
    # The embedding is copied into every stream: identical streams enter layer 0, then the post pairs split them.
    assert report["sites"][0]["stream_cosine_mean"] == pytest.approx(1.0, abs=1e-6)
    assert report["sites"][1]["stream_cosine_mean"] < 1 - 1e-5


@pytest.mark.parametrize("residual_map", RESIDUAL_MAPS)
def test_gains_match_a_float64_product_of_the_mixing_maps_over_the_unmasked_tokens(residual_map):
    model = randomize_hc(three_layer_mhc_model(hc_mult=4, hc_sinkhorn_iters=2, hc_residual_map=residual_map))
    input_ids = torch.randint(3, VOCAB, (2, 9))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, 5:] = 0  # right padding: those tokens must not count
    report = stability_report(model, input_ids, attention_mask)
    assert report["hc_residual_map"] == residual_map

    sites, entering = site_inputs(model, input_ids, attention_mask)
    keep = attention_mask.bool()
    composite = torch.eye(4, dtype=torch.float64).expand(int(keep.sum()), 4, 4)
    for hc, streams, site in zip(sites, entering, report["sites"], strict=True):
        applied = reference_comb(streams, hc, residual_map)[keep].transpose(-1, -2)  # X' = comb^T X
        composite = applied @ composite
        row_sums, col_sums = applied.abs().sum(-1), applied.abs().sum(-2)
        assert site["forward_gain_max"] == pytest.approx(row_sums.amax(-1).max().item(), rel=1e-5)
        assert site["forward_gain_mean"] == pytest.approx(row_sums.amax(-1).mean().item(), rel=1e-5)
        assert site["backward_gain_max"] == pytest.approx(col_sums.amax(-1).max().item(), rel=1e-5)
        assert site["backward_gain_mean"] == pytest.approx(col_sums.amax(-1).mean().item(), rel=1e-5)
        assert site["cumulative_backward_gain_max"] == pytest.approx(
            composite.abs().sum(-2).amax(-1).max().item(), rel=1e-5
        )
    expected = {
        "forward_gain_max": composite.abs().sum(-1).amax(-1).max(),
        "forward_gain_mean": composite.abs().sum(-1).amax(-1).mean(),
        "backward_gain_max": composite.abs().sum(-2).amax(-1).max(),
        "backward_gain_mean": composite.abs().sum(-2).amax(-1).mean(),
    }
    for key, value in expected.items():
        assert report["composite"][key] == pytest.approx(value.item(), rel=1e-5), key
    assert report["num_tokens"] == int(keep.sum())
    backward = report["composite"]["backward_gain_max"]
    if residual_map == "sinkhorn":  # two Sinkhorn rounds leave comb's rows visibly off: measured, not assumed 1
        assert backward > 1.001
    elif residual_map == "unconstrained":  # random signed maps, nothing projects them: far from 1
        assert backward > 2
    elif residual_map == "identity":
        assert all(value == 1.0 for value in report["composite"].values())
    else:  # exactly doubly stochastic at any cost
        assert backward == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("residual_map", RESIDUAL_MAPS)
def test_hand_built_static_maps_give_the_closed_form_composite_gain(residual_map):
    """fn = 0 leaves only the static part of each map. Unconstrained comb = comb_b = 1.2 I at each of the 6 sites
    (gain 1.2^6); identity: exactly 1; permutations: comb_b picking the cyclic shift (an exact permutation, gain 1);
    sinkhorn: comb_b = c I, the function-preserving init (gain 1 up to hc_eps)."""
    model = three_layer_mhc_model(hc_mult=4, hc_residual_map=residual_map)
    n, sites = 4, 6
    if residual_map == "unconstrained":
        with torch.no_grad():
            for layer in model.model.layers:
                for hc in (layer.attn_hc, layer.ffn_hc):
                    hc.fn.zero_()
                    hc.base[2 * n:] = (1.2 * torch.eye(n)).flatten()
    if residual_map == "permutations":
        shift = list(itertools.permutations(range(n))).index((1, 2, 3, 0))
        with torch.no_grad():
            for layer in model.model.layers:
                for hc in (layer.attn_hc, layer.ffn_hc):
                    hc.fn.zero_()
                    hc.base[2 * n:] = -1e4
                    hc.base[2 * n + shift] = 0.0
    report = stability_report(model, torch.randint(3, VOCAB, (2, 5)))
    composite = report["composite"]
    if residual_map == "unconstrained":
        assert composite["forward_gain_max"] == pytest.approx(1.2**sites, rel=1e-6)
        assert composite["backward_gain_max"] == pytest.approx(1.2**sites, rel=1e-6)
        assert report["sites"][2]["cumulative_forward_gain_max"] == pytest.approx(1.2**3, rel=1e-6)
    elif residual_map == "identity":
        assert all(value == 1.0 for value in composite.values())
        assert all(site[key] == 1.0 for site in report["sites"] for key in SITE_SCALARS if "gain" in key)
    else:
        for value in composite.values():
            assert value == pytest.approx(1.0, abs=4 * sites * model.config.hc_eps)


def product_gains(combs, keep):
    """Forward / backward gain (max absolute row / column sum) of ``comb_last^T ... comb_0^T`` per kept token, each
    product formed on its own with numpy in float64."""
    import numpy as np

    forward, backward = [], []
    for b, t in keep.nonzero().tolist():
        product = np.eye(combs[0].shape[-1])
        for comb in combs:
            product = comb[b, t].double().numpy().T @ product
        forward.append(np.abs(product).sum(axis=1).max())
        backward.append(np.abs(product).sum(axis=0).max())
    return np.array(forward), np.array(backward)


@pytest.mark.parametrize("scale", [1.0, 1.5])
def test_composite_gain_of_known_signed_maps_is_their_float64_product(scale, monkeypatch):
    model = three_layer_mhc_model(hc_mult=4)
    input_ids = torch.randint(3, VOCAB, (2, 7))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :2] = 0  # left padding: not measured
    combs = known_signed_maps(model, monkeypatch, input_ids.shape, scale)
    report = stability_report(model, input_ids, attention_mask)

    forward, backward = product_gains(combs, attention_mask.bool())
    composite = report["composite"]
    assert composite["forward_gain_max"] == pytest.approx(forward.max(), rel=1e-12)
    assert composite["forward_gain_mean"] == pytest.approx(forward.mean(), rel=1e-12)
    assert composite["backward_gain_max"] == pytest.approx(backward.max(), rel=1e-12)
    assert composite["backward_gain_mean"] == pytest.approx(backward.mean(), rel=1e-12)
    for depth, site in enumerate(report["sites"]):
        forward, backward = product_gains(combs[: depth + 1], attention_mask.bool())
        assert site["cumulative_forward_gain_max"] == pytest.approx(forward.max(), rel=1e-12)
        assert site["cumulative_backward_gain_max"] == pytest.approx(backward.max(), rel=1e-12)
    # Nothing bounds unconstrained maps: 6 sites scaled by 1.5 grow the signal far beyond 1.
    if scale > 1:
        assert composite["forward_gain_max"] > 10 and composite["backward_gain_max"] > 10
    assert min(site["comb_row_sum_min"] for site in report["sites"]) < 0  # signed sums are reported as they are


def test_doubly_stochastic_comb_is_non_expansive_and_one_sinkhorn_round_is_not():
    converged = randomize_hc(three_layer_mhc_model(hc_mult=4, hc_sinkhorn_iters=100), fn_std=0.1)
    one_round = three_layer_mhc_model(hc_mult=4, hc_sinkhorn_iters=1)
    one_round.load_state_dict(converged.state_dict())
    input_ids = torch.randint(3, VOCAB, (2, 10))

    report = stability_report(converged, input_ids)
    summary = report["summary"]
    assert summary["max_comb_row_sum_deviation"] < 1e-5 and summary["max_comb_col_sum_deviation"] < 1e-5
    tolerance = 1e-5
    for site in report["sites"]:
        assert site["forward_gain_max"] <= 1 + tolerance and site["backward_gain_max"] <= 1 + tolerance
    assert summary["composite_forward_gain"] <= 1 + tolerance
    assert summary["composite_backward_gain"] <= 1 + tolerance

    loose = stability_report(one_round, input_ids)["summary"]
    assert loose["composite_forward_gain"] <= 1 + tolerance  # the columns are normalised last: rows of comb^T
    assert loose["max_comb_row_sum_deviation"] > 0.05
    assert loose["max_site_backward_gain"] > 1.05
    assert loose["composite_backward_gain"] > 1.05


def test_single_stream_has_unit_gains_and_no_stream_similarity():
    report = stability_report(randomize_hc(three_layer_mhc_model(hc_mult=1)), torch.randint(3, VOCAB, (1, 6)))
    assert report["composite"]["forward_gain_max"] == pytest.approx(1.0, abs=1e-5)
    assert report["sites"][0]["stream_cosine_mean"] is None
    assert "mhc/stream_cosine_mean" not in report_scalars(report)
    assert "layer 2 ffn" in format_report(report)


def test_report_scalars_are_flat_floats_with_per_site_keys():
    report = stability_report(three_layer_mhc_model(hc_mult=2), torch.randint(3, VOCAB, (1, 5)))
    summary_only = report_scalars(report)
    assert summary_only["mhc/composite_forward_gain"] == report["composite"]["forward_gain_max"]
    assert not any("layer_" in key for key in summary_only)
    full = report_scalars(report, per_site=True)
    assert all(isinstance(value, float) for value in full.values())
    assert {f"mhc/layer_2/ffn/{name}" for name in SITE_SCALARS} <= set(full)


def test_capture_restores_training_mode_and_removes_hooks():
    model = three_layer_mhc_model().train()
    stability_report(model, torch.randint(3, VOCAB, (1, 4)))
    assert model.training
    assert all(not module._forward_hooks for module in model.modules())
    with pytest.raises(ValueError, match="not an mHC model"):
        with capture_hc_maps(LlamaForCausalLM(tiny_backbone_config("llama"))):
            pass
    with pytest.raises(ValueError, match="masks every token"):
        stability_report(model, torch.ones(1, 3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        stability_report(model, torch.ones(1, 3))


def test_the_names_of_the_other_diagnostics_modules_import_from_here():
    """``from hf_mhc.diagnostics import ...`` (README, examples) keeps working for the plots, the callback and the
    ``hf-mhc inspect`` command, each the object of its own module; an unknown name is an AttributeError."""
    for module in (diagnostics_plots, diagnostics_callback, diagnostics_cli):
        for name in module.__all__:
            if name in diagnostics.__all__:
                assert getattr(diagnostics, name) is getattr(module, name), name
    moved = {"plot_report", "overview_figure", "layer_figure", "MHCStabilityCallback", "inspect_main", "run_inspect",
             "add_inspect_arguments"}
    assert moved <= set(diagnostics.__all__) and moved <= set(dir(diagnostics))
    with pytest.raises(AttributeError, match="no attribute 'plot_reports'"):
        diagnostics.plot_reports  # noqa: B018
