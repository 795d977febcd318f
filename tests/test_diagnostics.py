"""Stability diagnostics: gains against float64 references, Sinkhorn properties, the Trainer callback, the CLI."""

from __future__ import annotations

import itertools
import json
import sys

import pytest
import torch
from conftest import STORIES260K, VOCAB, tiny_backbone_config
from datasets import Dataset
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_mhc import MHCConfig, MHCForCausalLM
from hf_mhc.diagnostics import (
    SITE_SCALARS,
    MHCStabilityCallback,
    add_inspect_arguments,
    capture_hc_maps,
    format_report,
    inspect_main,
    report_scalars,
    run_inspect,
    stability_report,
)


def mhc_model(hc_mult=4, hc_init="function_preserving", **hc_options):
    config = MHCConfig(
        backbone_config=tiny_backbone_config("llama", num_hidden_layers=3), hc_mult=hc_mult, hc_init=hc_init,
        **hc_options,
    )
    return MHCForCausalLM(config).eval()


def randomize_hc(model, fn_std=0.3, base_std=1.0):
    """Strongly token-dependent maps: random fn and base, unit scales."""
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "MHCHyperConnection":
                module.fn.normal_(0.0, fn_std)
                module.base.normal_(0.0, base_std)
                module.scale.fill_(1.0)
    return model


RESIDUAL_MAPS = ("sinkhorn", "unconstrained", "identity", "permutations")


def reference_comb(streams, hc, residual_map="sinkhorn"):
    """float64 ``comb [..., n, n]`` of one HC site from the streams entering it, written out from the formula of
    ``residual_map``."""
    n = streams.shape[-2]
    if residual_map == "identity":
        return torch.eye(n, dtype=torch.float64).expand(*streams.shape[:-2], n, n)
    flat = streams.flatten(-2).double()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + hc.norm_eps)
    comb_w, comb_b = (flat @ hc.fn.double().T)[..., 2 * n:], hc.base.double()[2 * n:]
    comb_scale = hc.scale.double()[2]
    if residual_map == "unconstrained":  # static plus scaled-tanh dynamic, no projection
        return (comb_scale * torch.tanh(comb_w) + comb_b).unflatten(-1, (n, n))
    if residual_map == "permutations":  # sum_k w_k P_k, P_k[i, perm_k[i]] = 1, perms in lexicographic order
        weights = torch.softmax(comb_scale * comb_w + comb_b, dim=-1)
        comb = torch.zeros(*streams.shape[:-2], n, n, dtype=torch.float64)
        for k, perm in enumerate(itertools.permutations(range(n))):
            for i, j in enumerate(perm):
                comb[..., i, j] += weights[..., k]
        return comb
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_scale + comb_b.view(n, n), dim=-1) + hc.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc.hc_eps)
    for _ in range(hc.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc.hc_eps)
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
    model = mhc_model(hc_mult=4)
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
    model = randomize_hc(mhc_model(hc_mult=4, hc_sinkhorn_iters=2, hc_residual_map=residual_map))
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
    model = mhc_model(hc_mult=4, hc_residual_map=residual_map)
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


def known_signed_maps(model, monkeypatch, shape, scale, seed=0):
    """Give every HC site of ``model`` known token-dependent maps: ``comb = scale * (I + 0.5 R)`` with ``R`` standard
    normal per token (entries of both signs, rows and columns far from summing to 1), returned by the site's ``maps``
    (what the report reads). Returns the float32 ``comb [B, T, n, n]`` of every site in depth order."""
    generator = torch.Generator().manual_seed(seed)
    n = model.config.hc_mult
    combs = []
    for layer in model.model.layers:
        for site in (layer.attn_hc, layer.ffn_hc):
            comb = scale * (torch.eye(n) + 0.5 * torch.randn(*shape, n, n, generator=generator))
            pre, post = torch.rand(*shape, n, generator=generator), 2 * torch.rand(*shape, n, generator=generator)
            monkeypatch.setattr(site, "maps", lambda streams, maps=(pre, post, comb): maps)
            combs.append(comb)
    return combs


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
    model = mhc_model(hc_mult=4)
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
    converged = randomize_hc(mhc_model(hc_mult=4, hc_sinkhorn_iters=100), fn_std=0.1)
    one_round = mhc_model(hc_mult=4, hc_sinkhorn_iters=1)
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
    report = stability_report(randomize_hc(mhc_model(hc_mult=1)), torch.randint(3, VOCAB, (1, 6)))
    assert report["composite"]["forward_gain_max"] == pytest.approx(1.0, abs=1e-5)
    assert report["sites"][0]["stream_cosine_mean"] is None
    assert "mhc/stream_cosine_mean" not in report_scalars(report)
    assert "layer 2 ffn" in format_report(report)


def test_report_scalars_are_flat_floats_with_per_site_keys():
    report = stability_report(mhc_model(hc_mult=2), torch.randint(3, VOCAB, (1, 5)))
    summary_only = report_scalars(report)
    assert summary_only["mhc/composite_forward_gain"] == report["composite"]["forward_gain_max"]
    assert not any("layer_" in key for key in summary_only)
    full = report_scalars(report, per_site=True)
    assert all(isinstance(value, float) for value in full.values())
    assert {f"mhc/layer_2/ffn/{name}" for name in SITE_SCALARS} <= set(full)


def test_capture_restores_training_mode_and_removes_hooks():
    model = mhc_model().train()
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


class LogRecorder(TrainerCallback):
    """Stands in for a reporting integration (TensorBoard, W&B): records what on_log hands it."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs)))


def test_callback_logs_the_scalars_through_trainer_every_n_steps(tmp_path):
    model = mhc_model(hc_mult=4).train()
    blocks = torch.randint(3, VOCAB, (16, 12))
    train_set = Dataset.from_dict({"input_ids": blocks.tolist(), "labels": blocks.tolist()})
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=2,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
    )
    recorder = LogRecorder()
    trainer = Trainer(model=model, args=args, train_dataset=train_set, callbacks=[recorder])
    before = report_scalars(stability_report(model, blocks[:3]))
    trainer.add_callback(MHCStabilityCallback(every_n_steps=2, trainer=trainer, num_samples=3))
    trainer.train()

    stability_steps = [step for step, logs in recorder.logs if "mhc/composite_forward_gain" in logs]
    assert stability_steps == [0, 2, 4]
    loss_steps = [step for step, logs in recorder.logs if "loss" in logs]
    assert loss_steps == [2, 4]  # the trainer's own logs still happen at the logging steps
    history = [entry for entry in trainer.state.log_history if "mhc/composite_forward_gain" in entry]
    assert [entry["step"] for entry in history] == [0, 2, 4]
    assert history[0]["mhc/max_comb_row_sum_deviation"] == pytest.approx(before["mhc/max_comb_row_sum_deviation"])
    assert history[0]["mhc/stream_cosine_mean"] == pytest.approx(before["mhc/stream_cosine_mean"])
    # Training moved the HC maps, and the logged report follows them.
    assert history[-1]["mhc/pre_max"] != history[0]["mhc/pre_max"]
    # The first report names the variant it measured (once: a string is text, not a scalar, to the integrations).
    assert [entry.get("mhc/hc_residual_map") for entry in history] == ["sinkhorn", None, None]
    assert [logs.get("mhc/hc_residual_map") for step, logs in recorder.logs if step == 0] == ["sinkhorn"]


def test_callback_rejects_bad_arguments():
    trainer = Trainer(model=mhc_model(), args=TrainingArguments(output_dir="unused", report_to=[], use_cpu=True))
    with pytest.raises(ValueError, match="every_n_steps"):
        MHCStabilityCallback(every_n_steps=0, trainer=trainer)
    with pytest.raises(TypeError, match="Trainer"):
        MHCStabilityCallback(every_n_steps=5, trainer=object())


def test_inspect_cli_prints_the_table_for_a_checkpoint_without_tokenizer(tmp_path, capsys):
    randomize_hc(mhc_model(hc_mult=3)).save_pretrained(tmp_path / "mhc")
    assert inspect_main([str(tmp_path / "mhc"), "--json", str(tmp_path / "report.json")]) == 0
    printed = capsys.readouterr().out
    assert "random token ids" in printed and "layer 2 ffn" in printed and "composite over depth" in printed
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["hc_mult"] == 3 and len(report["sites"]) == 6 and report["num_tokens"] == 64
    assert report["non_finite_parameters"] == [] and report["non_finite_values"] == {}


def refuse_constant(name):
    raise ValueError(f"{name} is not JSON")


def test_inspect_writes_strict_json_and_fails_on_non_finite_parameters(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    model = mhc_model(hc_mult=2)
    with torch.no_grad():
        model.model.layers[0].attn_hc.fn.fill_(float("nan"))
    model.save_pretrained(tmp_path / "mhc")
    capsys.readouterr()
    json_path, plots = tmp_path / "report.json", tmp_path / "plots"
    assert inspect_main([str(tmp_path / "mhc"), "--json", str(json_path), "--plot", str(plots)]) == 1
    captured = capsys.readouterr()  # stderr: the loading progress bar, then the error
    assert captured.err.splitlines()[-1] == (
        "hf-mhc inspect: error: non-finite parameters: model.layers.0.attn_hc.fn; the report's non-finite values are "
        "null in --json (its non_finite_values lists them); no plots written") and "Traceback" not in captured.err
    assert f"report written to {json_path}" in captured.out and not plots.exists()
    report = json.loads(json_path.read_text(), parse_constant=refuse_constant)
    assert report["non_finite_parameters"] == ["model.layers.0.attn_hc.fn"]
    assert report["sites"][0]["forward_gain_max"] is None
    assert report["non_finite_values"]["sites[0].forward_gain_max"] == "nan"
    assert report["non_finite_values"]["summary.composite_forward_gain"] == "nan"
    assert all(value in ("nan", "inf", "-inf") for value in report["non_finite_values"].values())
    assert inspect_main([str(tmp_path / "mhc")]) == 1  # without --json too
    assert capsys.readouterr().err.endswith("the report's non-finite values are nan / inf in the table\n")


def test_inspect_refuses_empty_text(tmp_path, capsys):
    mhc_model(hc_mult=2).save_pretrained(tmp_path / "mhc")
    capsys.readouterr()
    for text in ("", "  \n"):
        assert inspect_main([str(tmp_path / "mhc"), "--text", text]) == 1
        assert capsys.readouterr().err == ("hf-mhc inspect: error: --text is empty; give text to run the model on, or "
                                           "leave --text out for the default passage\n")


def test_inspect_cli_names_the_variant_of_a_saved_checkpoint(tmp_path, capsys):
    randomize_hc(mhc_model(hc_mult=2, hc_residual_map="unconstrained")).save_pretrained(tmp_path / "hc")
    assert inspect_main([str(tmp_path / "hc"), "--json", str(tmp_path / "report.json")]) == 0
    assert "mHC stability report (unconstrained residual maps): n = 2 streams" in capsys.readouterr().out
    assert json.loads((tmp_path / "report.json").read_text())["hc_residual_map"] == "unconstrained"


def test_inspect_arguments_plug_into_a_subcommand_parser(tmp_path, capsys):
    import argparse

    mhc_model(hc_mult=2).save_pretrained(tmp_path / "mhc")
    parser = argparse.ArgumentParser(prog="hf-mhc")
    subcommands = parser.add_subparsers(dest="command", required=True)
    add_inspect_arguments(subcommands.add_parser("inspect")).set_defaults(run=run_inspect)
    args = parser.parse_args(["inspect", str(tmp_path / "mhc"), "--device", "cpu"])
    assert args.run(args) == 0
    assert "n = 2 streams, 3 layers" in capsys.readouterr().out


def test_inspect_cli_errors_are_one_line(tmp_path, capsys, monkeypatch):
    assert inspect_main([str(tmp_path / "missing")]) == 1
    assert capsys.readouterr().err == f"hf-mhc inspect: error: no such folder: {tmp_path / 'missing'}\n"
    for local in ("./missing", "~/missing-hf-mhc-model", "outputs/finetune/mergd"):  # never a Hub repo-id error
        assert inspect_main([local]) == 1
        assert capsys.readouterr().err == f"hf-mhc inspect: error: no such folder: {local}\n"
    LlamaForCausalLM(tiny_backbone_config("llama")).save_pretrained(tmp_path / "llama")
    mhc_model().save_pretrained(tmp_path / "mhc")
    capsys.readouterr()  # drop the save progress bars
    assert inspect_main([str(tmp_path / "llama")]) == 1
    message = capsys.readouterr().err
    assert message.startswith("hf-mhc inspect: error: ") and "not an mHC" in message and message.count("\n") == 1
    assert inspect_main([str(tmp_path / "mhc"), "--text", "hello"]) == 1
    assert "no tokenizer" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert inspect_main([str(tmp_path / "mhc"), "--plot", str(tmp_path / "plots")]) == 1
    assert "needs matplotlib" in capsys.readouterr().err


def test_inspect_cli_writes_an_overview_and_one_plot_per_layer(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    randomize_hc(mhc_model(hc_mult=2)).save_pretrained(tmp_path / "mhc")
    assert inspect_main([str(tmp_path / "mhc"), "--plot", str(tmp_path / "plots")]) == 0
    assert "4 plots written" in capsys.readouterr().out
    names = sorted(path.name for path in (tmp_path / "plots").iterdir())
    assert names == ["layer_0.png", "layer_1.png", "layer_2.png", "overview.png"]
    assert all((tmp_path / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for name in names)


@pytest.mark.skipif(not STORIES260K.is_dir(), reason="../shared/assets/stories260K is not present")
def test_inspect_cli_on_the_upcycled_real_llama_with_its_tokenizer(tmp_path, capsys):
    from transformers import AutoTokenizer

    import hf_mhc

    model = hf_mhc.upcycle(AutoModelForCausalLM.from_pretrained(STORIES260K), hc_mult=4)
    model.save_pretrained(tmp_path / "mhc")
    AutoTokenizer.from_pretrained(STORIES260K).save_pretrained(tmp_path / "mhc")
    text = "Once upon a time, there was a little girl named Lily."
    assert inspect_main([str(tmp_path / "mhc"), "--text", text, "--json", str(tmp_path / "report.json")]) == 0
    printed = capsys.readouterr().out
    assert "n = 4 streams, 5 layers" in printed
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["num_tokens"] == len(AutoTokenizer.from_pretrained(STORIES260K)(text)["input_ids"])
    # Upcycled: the residual mixing is the identity up to hc_eps at every site and over the depth.
    assert abs(report["summary"]["composite_backward_gain"] - 1) < 1e-4


def test_inspect_checks_the_plot_and_json_paths_before_it_loads_anything(tmp_path, capsys, monkeypatch):
    import hf_mhc.diagnostics as diagnostics

    pytest.importorskip("matplotlib")
    mhc_model(hc_mult=2).save_pretrained(tmp_path / "mhc")
    (tmp_path / "file.txt").write_text("mine")
    (tmp_path / "folder").mkdir()

    def no_loading(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded before the output paths were checked")

    monkeypatch.setattr(diagnostics, "_load_for_inspection", no_loading)
    file, folder = tmp_path / "file.txt", tmp_path / "folder"
    cases = [
        (["--plot", str(file)], f"--plot {file}: {file} is a file, not a folder"),
        (["--plot", str(file / "p")], f"--plot {file / 'p'}: cannot create {file / 'p'}: {file} is a file"),
        (["--json", str(folder)], f"--json {folder}: {folder} is a folder, not a file"),
        (["--json", str(file / "a")], f"--json {file / 'a'}: cannot create {file / 'a'}: {file} is a file"),
        (["--json", ""], "--json : empty path"),
    ]
    capsys.readouterr()
    for options, expected in cases:
        assert inspect_main([str(tmp_path / "mhc"), *options]) == 1, options
        assert capsys.readouterr().err == f"hf-mhc inspect: error: {expected}\n"
    assert (tmp_path / "file.txt").read_text() == "mine"


def overview_and_layer_figures(report, tmp_path, monkeypatch):
    """The matplotlib figures plot_report draws, caught at savefig (nothing is rendered)."""
    from matplotlib.figure import Figure

    from hf_mhc.diagnostics import plot_report

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, *args, **kwargs: figures.append(figure))
    plot_report(report, tmp_path / "plots")
    return figures[0], figures[1:]


def horizontal_lines_at(axis, value):
    return [line for line in axis.get_lines() if len(set(line.get_ydata())) == 1 and line.get_ydata()[0] == value]


def test_plots_label_their_y_axes_mark_1_and_draw_float_noise_flat(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    # Function-preserving init: every gain and comb sum is 1 up to hc_eps and float rounding (about 1e-6).
    report = stability_report(mhc_model(hc_mult=4), torch.randint(3, VOCAB, (2, 9)))
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
    loose = stability_report(randomize_hc(mhc_model(hc_mult=4, hc_sinkhorn_iters=1)), torch.randint(3, VOCAB, (2, 9)))
    gains = overview_and_layer_figures(loose, tmp_path, monkeypatch)[0].axes[0]
    largest = max(site["cumulative_backward_gain_max"] for site in loose["sites"])
    assert largest > 1.05 and gains.get_ylim()[1] >= largest and gains.get_ylim()[0] <= 0.95


@pytest.mark.parametrize("residual_map", RESIDUAL_MAPS)
def test_the_report_its_table_and_its_plots_name_the_variant_measured(residual_map, tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    model = randomize_hc(mhc_model(hc_mult=4, hc_residual_map=residual_map))
    report = stability_report(model, torch.randint(3, VOCAB, (1, 6)))
    assert report["hc_residual_map"] == model.config.hc_residual_map == residual_map
    assert format_report(report).startswith(f"mHC stability report ({residual_map} residual maps): n = 4 streams")
    overview, layers = overview_and_layer_figures(report, tmp_path, monkeypatch)
    assert all(f"({residual_map} residual maps)" in figure.get_suptitle() for figure in [overview, *layers])


def test_plots_of_signed_expanding_maps_are_not_clipped(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    model = mhc_model(hc_mult=4)
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
