"""Hugging Face behaviour of the mHC models: Auto classes, save/load, generation, attention backends, training."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import (
    FAMILIES,
    VOCAB,
    assert_logits_close,
    assert_same_weights,
    loss_gradients,
    tiny_backbone_config,
)
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from hf_mhc import MHCConfig, MHCForCausalLM, MHCForSequenceClassification, MHCModel


def random_mhc(family="llama", hc_mult=3, tie_word_embeddings=False, **overrides):
    """An mHC model with DeepSeek-V4's random HC init, so every map is token-dependent and non-trivial."""
    backbone = tiny_backbone_config(family, tie_word_embeddings=tie_word_embeddings)
    config = MHCConfig(backbone_config=backbone, hc_mult=hc_mult, hc_init="deepseek_v4", **overrides)
    return MHCForCausalLM(config).eval()


def token_ids(batch=2, length=9):
    return torch.randint(3, VOCAB, (batch, length))


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
def test_cached_generation_equals_uncached(family):
    model = random_mhc(family)
    ids = token_ids(2, 7)
    cached = model.generate(ids, max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
    uncached = model.generate(ids, max_new_tokens=10, do_sample=False, use_cache=False, pad_token_id=0)
    assert cached.shape == (2, 17)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("family", FAMILIES)
def test_incremental_forward_with_cache_matches_full_forward(family):
    model = random_mhc(family)
    ids = token_ids(2, 12)
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :8], use_cache=True)
        rest = model(ids[:, 8:], cache=first.cache, use_cache=True)
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], 1), full, atol=1e-5, rtol=1e-5)


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
    torch.testing.assert_close(eager_logits[real], sdpa_logits[real], atol=1e-5, rtol=1e-5)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = random_mhc("qwen3").train()
    ids = token_ids()

    plain = loss_gradients(model, ids)
    model.activation_checkpointing_enable()
    assert model.model.layers[0].gradient_checkpointing
    checkpointed = loss_gradients(model, ids)
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5, msg=name)


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
    torch.testing.assert_close(out.logits[1:], alone, atol=1e-5, rtol=1e-5)


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
        torch.testing.assert_close(grads[name], plain_grads[name], atol=1e-6, rtol=1e-5, msg=name)
    assert saved_per_token() < 0.8 * plain_saved
    model.activation_checkpointing_enable()  # composes with gradient checkpointing
    _, checkpointed_grads = loss_and_grads()
    for name in plain_grads:
        torch.testing.assert_close(checkpointed_grads[name], plain_grads[name], atol=1e-6, rtol=1e-5, msg=name)


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
