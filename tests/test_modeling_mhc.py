"""Hugging Face behaviour of the mHC models: Auto classes, save/load, generation, attention backends, training."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import (
    FAMILIES,
    FLOAT32_TOLERANCES,
    TEST_DEVICE,
    VOCAB,
    assert_logits_close,
    assert_same_weights,
    loss_gradients,
    random_mhc,
    tiny_backbone_config,
    token_ids,
)
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from hf_mhc import MHCConfig, MHCForCausalLM, MHCForSequenceClassification, MHCModel, mhc_reference, modeling_mhc
from hf_mhc.mhc_reference import map_sizes
from hf_mhc.modeling_mhc import MHCDecoderLayer, hc_ops


def test_auto_classes_are_registered():
    config = MHCConfig(backbone_config=tiny_backbone_config("llama"))
    assert isinstance(AutoConfig.for_model("mhc", backbone_config=tiny_backbone_config("qwen2")), MHCConfig)
    assert type(AutoModel.from_config(config)) is MHCModel
    assert type(AutoModelForCausalLM.from_config(config)) is MHCForCausalLM
    assert type(AutoModelForSequenceClassification.from_config(config)) is MHCForSequenceClassification


@pytest.mark.parametrize("family", FAMILIES)
def test_backbone_tensor_names_and_hc_tensor_names(family):
    model = random_mhc(family)
    names = set(model.state_dict())
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert "model.layers.1.mlp.down_proj.weight" in names
    for site in ("attn_hc", "ffn_hc"):
        assert {f"model.layers.1.{site}.{p}" for p in ("fn", "base", "scale")} <= names
    assert {"model.hc_head.hc_fn", "model.hc_head.hc_base", "model.hc_head.hc_scale"} <= names
    n, hidden = 3, 32
    assert model.model.layers[0].attn_hc.fn.shape == ((n + 2) * n, n * hidden)
    if family == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in names
    if family == "qwen3":
        assert "model.layers.0.self_attn.q_norm.weight" in names


@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_load_gives_identical_logits(family, tmp_path):
    model = random_mhc(family)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "mhc" and saved["backbone_config"]["model_type"] == family
    assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_mhc.MHCForCausalLM"
    assert {"modeling_mhc.py", "configuration_mhc.py", "mhc_reference.py", "model.safetensors"} <= {
        p.name for p in tmp_path.iterdir()
    }
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is MHCForCausalLM
    assert_same_weights(reloaded, model)
    ids = token_ids()
    with torch.no_grad():
        assert_logits_close(reloaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_forward_with_cache_matches_full_forward(family):
    model = random_mhc(family)
    ids = token_ids(2, 12)
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :8], use_cache=True)
        rest = model(ids[:, 8:], cache=first.cache, use_cache=True)
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], 1), full, **FLOAT32_TOLERANCES["logits"])


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_and_sdpa_agree(family, tmp_path):
    random_mhc(family).save_pretrained(tmp_path)
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    sdpa = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    assert eager.model.layers[0].self_attn.config._attn_implementation == "eager"
    assert sdpa.model.layers[0].self_attn.config._attn_implementation == "sdpa"
    ids = token_ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding exercises the mask path
    with torch.no_grad():
        eager_logits, sdpa_logits = eager(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits
    real = mask.bool()  # fully masked (padding) rows are undefined and differ between backends, as in transformers
    torch.testing.assert_close(eager_logits[real], sdpa_logits[real], **FLOAT32_TOLERANCES["logits"])


def test_an_attention_set_on_the_text_config_reaches_the_backbones_attention():
    """What vLLM's Transformers backend does: set ``_attn_implementation`` on ``config.get_text_config()`` to an
    attention function it registered, then build the model from the config; every layer's attention must call it."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def recording_attention(module, *args, **kwargs):
        calls.append(module.layer_idx)
        return sdpa_attention_forward(module, *args, **kwargs)

    AttentionInterface.register("hf_mhc_test_recording", recording_attention)
    config = random_mhc("llama").config
    config.get_text_config()._attn_implementation = "hf_mhc_test_recording"
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model(token_ids())
    assert calls == list(range(config.num_hidden_layers))


def test_gradient_checkpointing_gives_the_same_gradients():
    model = random_mhc("qwen3").train()
    ids = token_ids()

    plain = loss_gradients(model, ids)
    model.activation_checkpointing_enable()
    assert model.model.layers[0].gradient_checkpointing
    checkpointed = loss_gradients(model, ids)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], **FLOAT32_TOLERANCES["gradients"], msg=name)


def test_hidden_states_attentions_and_loss():
    model = random_mhc("llama", hc_mult=4)
    model.set_attn_implementation("eager")
    ids = token_ids(2, 6)
    out = model(ids, labels=ids, output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == 2 + 1
    assert all(h.shape == (2, 6, 4, 32) for h in out.hidden_states)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (2, 4, 6, 6)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, expected)
    assert model(ids, return_dict=False)[0].shape == (2, 6, VOCAB)


def test_bfloat16_loading_keeps_hc_parameters_in_float32(tmp_path):
    random_mhc("qwen2").save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name, param in model.named_parameters():
        is_hc = ".attn_hc." in name or ".ffn_hc." in name or ".hc_head." in name
        assert param.dtype == (torch.float32 if is_hc else torch.bfloat16), name
    logits = model(token_ids()).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_no_split_modules_names_the_decoder_layer():
    model = random_mhc()
    assert set(model._no_split_modules) == {"MHCDecoderLayer", "MHCHyperConnection", "MHCHyperHead"}
    assert type(model.model.layers[0]).__name__ == "MHCDecoderLayer"


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings(tied, tmp_path):
    model = random_mhc("llama", tie_word_embeddings=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert (reloaded.lm_head.weight is reloaded.model.embed_tokens.weight) == tied
    torch.testing.assert_close(reloaded.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("family", FAMILIES)
def test_causality(family):
    model = random_mhc(family)
    ids = token_ids(1, 12)
    changed = ids.clone()
    changed[0, 7] = (ids[0, 7] + 5) % VOCAB
    with torch.no_grad():
        before, after = model(ids).logits, model(changed).logits
    # Bit-exact: one model, the same code on the same weights; the earlier positions' inputs are the same.
    torch.testing.assert_close(after[:, :7], before[:, :7], atol=0, rtol=0)
    assert not torch.allclose(after[:, 7:], before[:, 7:])


def test_streams_really_mix_and_comb_is_applied():
    """Guards against community defects: streams re-expanded each layer, or H_res computed but never applied."""
    model = random_mhc("llama", hc_mult=4)
    ids = token_ids(1, 5)
    with torch.no_grad():
        streams = model(ids, output_hidden_states=True).hidden_states
        assert not torch.allclose(streams[1][:, :, 0], streams[1][:, :, 1])  # streams differ after a layer
        reference = model(ids).logits
        model.model.layers[1].ffn_hc.base[2 * 4 :] += torch.randn(16) * 3  # change only comb's bias
        assert not torch.allclose(model(ids).logits, reference)


def test_hc_parameters_get_gradients_at_the_function_preserving_init():
    config = MHCConfig(backbone_config=tiny_backbone_config("llama"), hc_mult=4)
    model = MHCForCausalLM(config)
    assert torch.count_nonzero(model.model.layers[0].attn_hc.fn) == 0
    ids = token_ids()
    model(ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        if name.endswith((".fn", ".base", "hc_fn", "hc_base")):
            assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_sequence_classification():
    config = MHCConfig(backbone_config=tiny_backbone_config("qwen3"), hc_mult=2, num_labels=3)
    model = AutoModelForSequenceClassification.from_config(config).eval()
    ids = token_ids(2, 6)
    ids[1, 4:] = 0  # right padding with pad_token_id=0
    out = model(ids, labels=torch.tensor([0, 2]))
    assert out.logits.shape == (2, 3) and out.loss.ndim == 0
    with torch.no_grad():
        alone = model(ids[1:, :4]).logits
    torch.testing.assert_close(out.logits[1:], alone, **FLOAT32_TOLERANCES["logits"])


def test_selective_recomputation_gives_the_same_gradients_and_saves_less():
    from hf_mhc.profiling import saved_bytes_for_backward

    model = random_mhc("llama", hc_mult=4).train()
    ids = token_ids()

    def loss_and_grads():
        model.zero_grad()
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    def saved_per_token():
        """Bytes held for backward per added token: what each checkpoint holds whatever the length (a copy of the
        random state, 5,056 bytes) cancels."""
        short, long = token_ids(2, 8), token_ids(2, 40)
        held = [saved_bytes_for_backward(lambda ids=ids: model(ids, labels=ids, use_cache=False).loss,
                                         exclude=tuple(model.parameters())) for ids in (short, long)]
        return (held[1] - held[0]) / (long.numel() - short.numel())

    plain_loss, plain_grads = loss_and_grads()
    plain_saved = saved_per_token()
    for layer in model.model.layers:
        layer.hc_recompute = True
    loss, grads = loss_and_grads()
    # Bit-exact: the checkpointed regions run the same ops, in the same order, on the same tensors.
    torch.testing.assert_close(loss, plain_loss, atol=0, rtol=0)
    for name in plain_grads:
        torch.testing.assert_close(grads[name], plain_grads[name], **FLOAT32_TOLERANCES["gradients"], msg=name)
    assert saved_per_token() < 0.8 * plain_saved
    model.activation_checkpointing_enable()  # composes with gradient checkpointing
    _, checkpointed_grads = loss_and_grads()
    for name in plain_grads:
        torch.testing.assert_close(checkpointed_grads[name], plain_grads[name], **FLOAT32_TOLERANCES["gradients"],
                                   msg=name)


def test_mhc_settings_changed_on_a_built_model_take_effect_and_save_as_they_run(tmp_path):
    """The sites read ``hc_sinkhorn_iters``, ``hc_eps`` and ``hc_recompute`` from the config at each call: a model
    whose config was changed computes what its saved checkpoint computes after reloading."""
    model, ids = random_mhc(), token_ids()
    with torch.no_grad():
        before = model(ids).logits
        model.config.hc_sinkhorn_iters, model.config.hc_eps = 1, 1e-3
        after = model(ids).logits
    assert not torch.allclose(after, before, atol=1e-6)
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert_same_weights(reloaded, model)
    with torch.no_grad():
        assert_logits_close(reloaded(ids).logits, after)
    model.config.hc_recompute = True
    assert all(layer.hc_recompute for layer in model.model.layers)
    model.model.layers[0].hc_recompute = False  # one layer's own choice
    assert [layer.hc_recompute for layer in model.model.layers] == [False, True]


WITHOUT_TRITON = textwrap.dedent(
    """
    import sys
    sys.modules["triton"] = None  # as on a platform without Triton: `import triton` raises ImportError
    import torch
    import hf_mhc
    from transformers import LlamaConfig, LlamaForCausalLM
    source = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                          num_attention_heads=4, vocab_size=50))
    model = hf_mhc.upcycle(source, hc_mult=4)
    model.set_hc_implementation("torch")
    ids = torch.randint(0, 50, (1, 80))  # past the C++ decode kernels' token limit: the torch kernels' custom ops
    model(ids, labels=ids).loss.backward()
    assert model.model.layers[0].attn_hc.fn.grad is not None
    with torch.no_grad():  # a few tokens without gradient: the C++ decode kernels
        logits, expected = model(ids[:, :3]).logits, source(ids[:, :3]).logits
    torch.testing.assert_close(logits, expected, atol=1e-5 * expected.abs().max().item(), rtol=1e-5)
    try:
        hf_mhc.apply_mhc_kernels(model)
    except ValueError as error:  # the monkey patches import too; an mHC model has nothing for them to patch
        print("apply_mhc_kernels:", error)
    print(sorted(name for name, module in sys.modules.items() if "triton" in name and module is not None
                 and name.startswith("hf_mhc")))
    """
)


def test_the_plugin_imports_and_trains_without_triton(tmp_path):
    """``hc_implementation="torch"`` (forward, backward and the C++ decode kernels) and the monkey patches with
    ``import triton`` failing: only the Triton backend's modules import Triton, and none of them was imported."""
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    *_, patched, triton_modules = result.stdout.splitlines()
    assert patched.startswith("apply_mhc_kernels: apply_mhc_kernels found no hyper-connection module")
    assert triton_modules == "[]"


# --- residual maps and hc_implementation ---------------------------------------------------------------------


def variant_model(residual_map, hc_mult=3, **options):
    config = MHCConfig(backbone_config=tiny_backbone_config("llama"), hc_mult=hc_mult, hc_residual_map=residual_map,
                       hc_init="deepseek_v4", **options)
    return MHCForCausalLM(config)


@pytest.mark.parametrize("residual_map", ["unconstrained", "identity", "permutations"])
def test_model_trains_saves_and_reloads_with_its_map(residual_map, tmp_path):
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
    model = variant_model("identity")
    site = model.model.layers[0].attn_hc
    streams = torch.randn(2, 5, 3, 32)
    pre, post, comb = site.maps(streams)
    torch.testing.assert_close(comb, torch.eye(3).expand(2, 5, 3, 3), atol=0, rtol=0)  # built, not computed
    y, post_forward, none = site(streams)
    assert none is None
    # Bit-exact: with gradients wanted both run the same coefficient code on the same tensors.
    torch.testing.assert_close(post_forward, post, atol=0, rtol=0)
    ops = hc_ops(model.config.hc_implementation, streams)
    torch.testing.assert_close(ops.mhc_post_res(streams, y, post, None), ops.mhc_post_res(streams, y, post, comb))


def op_sets_used(monkeypatch) -> set:
    """Collects the names of the op sets that ``hc_ops`` returns to the model (``"reference"`` for
    ``mhc_reference``) while the test runs."""
    used = set()
    lookup = modeling_mhc.hc_ops

    def recording(*args):
        ops = lookup(*args)
        used.add("reference" if ops is mhc_reference else ops.name)
        return ops

    monkeypatch.setattr(modeling_mhc, "hc_ops", recording)
    return used


def logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids)
    out.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


@pytest.mark.parametrize("residual_map", ["sinkhorn", "identity", "permutations"])
def test_every_hc_implementation_gives_the_same_logits_and_gradients(residual_map, monkeypatch):
    """``reference`` (the plain formula), ``torch``, ``triton`` (the interpreter here) and ``auto`` (torch for CPU
    tensors) agree to float32 rounding, scaled to the values: per module, as a ``scale`` gradient is a sum over every
    token and column that cancels to far below its module's other gradients."""
    model = variant_model(residual_map)
    assert model.config.hc_implementation == "auto"
    ids = torch.randint(0, VOCAB, (2, 6))
    model.set_hc_implementation("reference")
    assert model.config.hc_implementation == "reference"
    used = op_sets_used(monkeypatch)
    ref_logits, ref_grads = logits_and_grads(model, ids)
    assert used == {"reference"}
    cpu = TEST_DEVICE == "cpu"
    for implementation, op_set in (("torch", "torch"), ("triton", "triton"), ("auto", "torch" if cpu else "triton")):
        model.set_hc_implementation(implementation)
        used.clear()
        logits, grads = logits_and_grads(model, ids)
        assert used == {op_set}, implementation
        torch.testing.assert_close(logits, ref_logits, atol=1e-5 * ref_logits.abs().max().item(), rtol=1e-5)
        assert grads.keys() == ref_grads.keys()
        module_scale: dict[str, float] = {}
        for name, ref in ref_grads.items():
            module = name.rsplit(".", 1)[0]
            module_scale[module] = max(module_scale.get(module, 0.0), ref.abs().max().item())
        for name, grad in grads.items():
            atol = 1e-4 * module_scale[name.rsplit(".", 1)[0]]
            torch.testing.assert_close(grad, ref_grads[name], atol=atol, rtol=1e-4, msg=name)


def test_hc_implementation_is_read_when_the_model_is_built(tmp_path, monkeypatch):
    variant_model("unconstrained").save_pretrained(tmp_path)
    model = MHCForCausalLM.from_pretrained(tmp_path, hc_implementation="reference")
    used = op_sets_used(monkeypatch)
    model(torch.randint(0, VOCAB, (1, 4)))
    assert used == {"reference"}


def test_without_gradient_on_cpu_the_decode_kernels_run(monkeypatch):
    if TEST_DEVICE != "cpu":
        pytest.skip("the CPU decode kernels run on CPU tensors")
    model = variant_model("sinkhorn")
    used = op_sets_used(monkeypatch)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 4)))
    assert used == {"cpu_decode"}


def test_triton_on_cpu_tensors_without_the_interpreter_is_a_one_line_error(monkeypatch):
    model = variant_model("identity", hc_implementation="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="hc_implementation='triton' runs on CUDA tensors, not cpu tensors; set "
                                         "TRITON_INTERPRET=1") as error:
        model(torch.randint(0, VOCAB, (1, 4)))
    assert "\n" not in str(error.value) and "use 'torch' or 'auto'" in str(error.value)


def test_a_failed_kernels_import_warns_once_and_runs_the_reference(monkeypatch, caplog):
    """A checkpoint loaded as remote code on a machine without hf-mhc: ``hf_mhc.kernels`` does not import."""
    monkeypatch.setattr(modeling_mhc, "kernel_ops", None)
    monkeypatch.setattr(modeling_mhc, "KERNELS_IMPORT_ERROR", ImportError("no module named 'hf_mhc' (in this test)"),
                        raising=False)
    used = op_sets_used(monkeypatch)
    ids = torch.randint(0, VOCAB, (1, 4))
    with caplog.at_level("WARNING"):
        for residual_map in ("permutations", "sinkhorn"):
            variant_model(residual_map)(ids)
    warnings = [r.getMessage() for r in caplog.records if "hf_mhc.kernels failed to import" in r.getMessage()]
    assert len(warnings) == 1 and "run the plain reference formula" in warnings[0]
    assert used == {"reference"}
    with pytest.raises(ImportError, match=r"hc_implementation='torch' needs hf_mhc.kernels, which failed to "
                                          r"import .*use hc_implementation='reference'"):
        variant_model("identity", hc_implementation="torch")(ids)


@pytest.mark.parametrize("family, residual_map", [("qwen3", "sinkhorn"), ("llama", "identity"),
                                                  ("llama", "permutations")])
def test_model_forward_and_backward_compile_with_fullgraph(family, residual_map):
    config = MHCConfig(backbone_config=tiny_backbone_config(family), hc_mult=4, hc_residual_map=residual_map,
                       hc_init="deepseek_v4")
    model = MHCForCausalLM(config)
    ids = torch.randint(0, VOCAB, (2, 9))
    eager = model(ids, labels=ids, use_cache=False)
    eager.loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # aot_eager traces forward and backward through every custom op without a graph break (what fullgraph checks);
    # inductor's code generation adds nothing to that check.
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(ids, labels=ids, use_cache=False)
    out.loss.backward()
    torch.testing.assert_close(out.logits, eager.logits, **FLOAT32_TOLERANCES["same_ops"])
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, eager_grads[name], **FLOAT32_TOLERANCES["gradients"], msg=name)


@pytest.mark.parametrize("residual_map", ["identity", "unconstrained"])
def test_selective_recomputation_gives_the_same_gradients(residual_map):
    model = variant_model(residual_map)
    ids = torch.randint(0, VOCAB, (2, 6))
    logits, grads = logits_and_grads(model, ids)
    model.config.hc_recompute = True
    recomputed_logits, recomputed = logits_and_grads(model, ids)
    # Bit-exact: the checkpointed regions run the same ops, in the same order, on the same tensors.
    torch.testing.assert_close(recomputed_logits, logits, atol=0, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(recomputed[name], grad, **FLOAT32_TOLERANCES["gradients"], msg=name)


def test_the_decoder_layer_forward_is_a_plain_sequence():
    """``MHCDecoderLayer.forward`` reads top to bottom (collapse, attention, merge, collapse, MLP, merge) with no
    function defined inside it; selective recomputation is a method of its own, ``forward_recomputing``, and both
    give the same streams (gradients: ``test_selective_recomputation_*``)."""
    forward = ast.parse(textwrap.dedent(inspect.getsource(MHCDecoderLayer.forward))).body[0]
    nested = [node for node in ast.walk(forward) if node is not forward and isinstance(node, (ast.FunctionDef,
                                                                                            ast.Lambda))]
    assert not nested, [ast.unparse(node)[:60] for node in nested]
    calls = sorted((node for node in ast.walk(forward) if isinstance(node, ast.Call)),
                   key=lambda node: (node.lineno, node.col_offset))
    calls = [ast.unparse(node.func) for node in calls]
    assert [call for call in calls if call.rpartition(".")[2] in ("collapse", "self_attn", "merge", "mlp")] == [
        "self.collapse", "self.self_attn", "self.attn_hc.merge", "self.collapse", "self.mlp", "self.ffn_hc.merge"]
    model, ids = random_mhc(), token_ids()
    layer, streams = model.model.layers[0], model.model.embed_tokens(ids).unsqueeze(-2).expand(-1, -1, 3, -1)
    position_embeddings = model.model.rotary_emb(streams[..., 0, :], torch.arange(ids.shape[1])[None])
    plain = layer(streams, position_embeddings=position_embeddings)
    recomputed = layer.forward_recomputing(streams, position_embeddings=position_embeddings)
    torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)  # the same ops on the same tensors
