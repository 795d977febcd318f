"""Residual-map variants beside mHC (``hc_residual_map``): the models built on them (training, saving, remote code,
``hc_implementation``, conversion, compile, recomputation). The ops of every map are tested in ``test_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    VOCAB,
    assert_logits_close,
    assert_one_line_error,
    assert_same_weights,
    convert,
    remote_code_logits,
    save_source,
    tiny_backbone_config,
)

from hf_mhc import MHCConfig, MHCForCausalLM
from hf_mhc.mhc_reference import map_sizes

VARIANTS = ["unconstrained", "identity", "permutations"]


# --- models -------------------------------------------------------------------------------------------------------


def variant_model(residual_map, hc_mult=3, **options):
    config = MHCConfig(backbone_config=tiny_backbone_config("llama"), hc_mult=hc_mult, hc_residual_map=residual_map,
                       hc_init="deepseek_v4", **options)
    return MHCForCausalLM(config)


@pytest.mark.parametrize("residual_map", VARIANTS)
def test_model_trains_saves_and_reloads_with_its_map(residual_map, tmp_path):
    torch.set_default_device("cpu")
    model = variant_model(residual_map, **({"hc_post_magnitude": 3.0} if residual_map == "identity" else {}))
    rows = sum(map_sizes(3, residual_map))
    assert model.model.layers[0].attn_hc.fn.shape == (rows, 3 * 32)
    ids = torch.randint(0, VOCAB, (2, 7))
    out = model(ids, labels=ids)
    out.loss.backward()
    for site in (model.model.layers[1].attn_hc, model.model.layers[0].ffn_hc):
        for parameter in (site.fn, site.base, site.scale):
            grad = parameter.grad
            assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    model.save_pretrained(tmp_path)
    reloaded = MHCForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.hc_residual_map == residual_map
    assert reloaded.config.hc_post_magnitude == (3.0 if residual_map == "identity" else 2.0)
    assert_same_weights(reloaded, model)
    with torch.no_grad():
        assert_logits_close(reloaded(ids).logits, model.eval()(ids).logits)


def test_maps_give_the_comb_applied():
    """Diagnostics read ``maps()``: for the identity map its comb is the identity, and the merge of the site's forward
    equals the merge with that comb."""
    torch.set_default_device("cpu")
    model = variant_model("identity")
    site = model.model.layers[0].attn_hc
    streams = torch.randn(2, 5, 3, 32)
    pre, post, comb = site.maps(streams)
    torch.testing.assert_close(comb, torch.eye(3).expand(2, 5, 3, 3), atol=0, rtol=0)  # built, not computed
    y, post_forward, none = site(streams)
    assert none is None
    # Bit-exact: with gradients wanted both run the same coefficient code on the same tensors.
    torch.testing.assert_close(post_forward, post, atol=0, rtol=0)
    torch.testing.assert_close(site.ops.post_res(streams, y, post, None), site.ops.post_res(streams, y, post, comb))


def test_permutations_checkpoint_loads_as_remote_code_without_the_plugin(tmp_path):
    torch.set_default_device("cpu")
    model = variant_model("permutations", hc_mult=4).eval()
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    ids = torch.randint(0, VOCAB, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(remote_code_logits(folder, ids, tmp_path), model(ids).logits, atol=1e-5, rtol=1e-5)


# --- hc_implementation --------------------------------------------------------------------------------------------


def logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.mark.parametrize("residual_map", ["sinkhorn", "identity", "permutations"])
def test_every_hc_implementation_gives_the_same_logits_and_gradients(residual_map):
    """``reference`` (the plain formula), ``torch``, ``triton`` (the interpreter here) and ``auto`` (torch for CPU
    tensors) agree to float32 rounding, scaled to the values: per module, as a ``scale`` gradient is a sum over every
    token and column that cancels to far below its module's other gradients."""
    torch.set_default_device("cpu")
    model = variant_model(residual_map)
    assert model.model.layers[0].attn_hc.ops.implementation == "auto"
    ids = torch.randint(0, VOCAB, (2, 6))
    model.set_hc_implementation("reference")
    assert model.config.hc_implementation == "reference"
    ref_logits, ref_grads = logits_and_grads(model, ids)
    for implementation in ("torch", "triton", "auto"):
        model.set_hc_implementation(implementation)
        assert {m.ops.implementation for m in model.modules() if hasattr(m, "ops")} == {implementation}
        logits, grads = logits_and_grads(model, ids)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5 * ref_logits.abs().max().item(), rtol=1e-5)
        assert grads.keys() == ref_grads.keys()
        module_scale: dict[str, float] = {}
        for name, ref in ref_grads.items():
            module = name.rsplit(".", 1)[0]
            module_scale[module] = max(module_scale.get(module, 0.0), ref.abs().max().item())
        for name, grad in grads.items():
            atol = 1e-4 * module_scale[name.rsplit(".", 1)[0]]
            torch.testing.assert_close(grad, ref_grads[name], atol=atol, rtol=1e-4, msg=name)


def test_hc_implementation_is_read_when_the_model_is_built(tmp_path):
    torch.set_default_device("cpu")
    variant_model("unconstrained").save_pretrained(tmp_path)
    model = MHCForCausalLM.from_pretrained(tmp_path, hc_implementation="reference")
    assert {m.ops.implementation for m in model.modules() if hasattr(m, "ops")} == {"reference"}


def test_triton_on_cpu_tensors_without_the_interpreter_is_a_one_line_error(monkeypatch):
    torch.set_default_device("cpu")
    model = variant_model("identity", hc_implementation="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' runs on CUDA tensors; set TRITON_INTERPRET=1") as error:
        model(torch.randint(0, VOCAB, (1, 4)))
    assert "\n" not in str(error.value) and "hc_implementation='torch'" in str(error.value)


def test_a_failed_kernels_import_warns_once_and_runs_the_reference(monkeypatch, caplog):
    import sys

    from hf_mhc import modeling_mhc

    torch.set_default_device("cpu")
    monkeypatch.setitem(sys.modules, "hf_mhc.kernels", None)  # `import hf_mhc.kernels` now raises ImportError
    modeling_mhc.resolve_hc_ops.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            models = [variant_model("permutations"), variant_model("sinkhorn")]
        warnings = [r.getMessage() for r in caplog.records if "hf_mhc.kernels failed to import" in r.getMessage()]
        assert len(warnings) == 1 and "run the plain reference formula" in warnings[0]
        for model in models:
            assert {m.ops.implementation for m in model.modules() if hasattr(m, "ops")} == {"reference"}
        with pytest.raises(ImportError, match=r"hc_implementation='torch' needs hf_mhc.kernels, which failed to "
                                              r"import .*use hc_implementation='reference'"):
            variant_model("identity", hc_implementation="torch")
    finally:
        modeling_mhc.resolve_hc_ops.cache_clear()


# --- conversion ---------------------------------------------------------------------------------------------------


def test_convert_with_a_residual_map_writes_it_and_verifies(tmp_path, capsys):
    """``hf-mhc convert --residual-map identity``: config.json keeps the map, the folder loads, verification passes
    (the map's function-preserving start reproduces the source), and the model card names the map."""

    torch.set_default_device("cpu")
    source = save_source(tmp_path / "src", "qwen2")
    status, stdout, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--hc-mult", "3", "--residual-map",
                                  "identity")
    assert status == 0, err
    converted = MHCForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert converted.config.hc_residual_map == "identity"
    assert converted.model.layers[0].attn_hc.fn.shape == (6, 3 * 32)
    assert "residual map `identity`" in (tmp_path / "out" / "README.md").read_text()
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, source(ids).logits, atol=1e-4, rtol=0)


def test_convert_refuses_permutations_of_five_streams_in_one_line(tmp_path, capsys):

    torch.set_default_device("cpu")
    save_source(tmp_path / "src", "llama")
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--hc-mult", "5", "--residual-map",
                             "permutations")
    assert_one_line_error(status, err, "hc_residual_map='permutations' supports hc_mult <= 4")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("residual_map", ["identity", "permutations"])
def test_model_with_a_residual_map_compiles_with_fullgraph(residual_map):
    torch.set_default_device("cpu")
    model = variant_model(residual_map)
    ids = torch.randint(0, VOCAB, (1, 6))
    expected = model(ids).logits
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(ids).logits, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("residual_map", ["identity", "unconstrained"])
def test_selective_recomputation_gives_the_same_gradients(residual_map):
    torch.set_default_device("cpu")
    model = variant_model(residual_map)
    ids = torch.randint(0, VOCAB, (2, 6))
    logits, grads = logits_and_grads(model, ids)
    model.config.hc_recompute = True
    recomputed_logits, recomputed = logits_and_grads(model, ids)
    # Bit-exact: the checkpointed regions run the same ops, in the same order, on the same tensors.
    torch.testing.assert_close(recomputed_logits, logits, atol=0, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(recomputed[name], grad, atol=1e-6, rtol=1e-5, msg=name)
