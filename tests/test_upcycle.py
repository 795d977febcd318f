"""Upcycling residual causal LMs: the mHC model starts out computing the source's function."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from conftest import FAMILIES, STORIES260K, VOCAB, assert_logits_close, perturbed_source_model, tiny_backbone_config
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import hf_mhc
from hf_mhc import SUPPORTED_BACKBONES, MHCConfig, MHCForCausalLM
from hf_mhc.conversion import convert_checkpoint
from hf_mhc.conversion.upcycle import mhc_config_for


def source_model(family, tied):
    return AutoModelForCausalLM.from_config(tiny_backbone_config(family, tie_word_embeddings=tied)).eval()


# Every family at 4 streams; the older four families also tied, and at every stream count.
UPCYCLE_CASES = [(family, False, 4) for family in SUPPORTED_BACKBONES] + [
    (family, tied, hc_mult) for family in FAMILIES for tied in (False, True) for hc_mult in (1, 2, 3, 4, 8)
    if (tied, hc_mult) != (False, 4)]


@pytest.mark.parametrize(("family", "tied", "hc_mult"), UPCYCLE_CASES)
def test_upcycled_logits_equal_the_source(family, tied, hc_mult):
    """On a source with perturbed norms and biases, left padding in the batch: the converter's float32 rule."""
    source = perturbed_source_model(family, tie_word_embeddings=tied)
    mhc = hf_mhc.upcycle(source, hc_mult=hc_mult).eval()
    assert isinstance(mhc, MHCForCausalLM) and mhc.config.hc_mult == hc_mult
    assert (mhc.lm_head.weight is mhc.model.embed_tokens.weight) == tied
    ids = torch.randint(3, VOCAB, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        expected = source(ids, attention_mask=mask).logits
        got = mhc(ids, attention_mask=mask).logits
    real = mask.bool()
    assert_logits_close(got[real], expected[real])


def test_upcycle_copies_weights_not_references():
    source = source_model("llama", tied=False)
    mhc = hf_mhc.upcycle(source)
    with torch.no_grad():
        mhc.model.layers[0].self_attn.q_proj.weight.add_(1.0)
    assert not torch.equal(mhc.model.layers[0].self_attn.q_proj.weight, source.model.layers[0].self_attn.q_proj.weight)


def test_upcycle_builds_without_a_random_initialisation():
    """The mHC model is built on the meta device and every tensor is assigned: no throwaway random backbone (for a
    large model that would be a second, float32 copy of it), so upcycling draws no random numbers."""
    source = source_model("mistral", tied=True)
    rng_before = torch.get_rng_state()
    mhc = hf_mhc.upcycle(source)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert not any(t.is_meta for t in (*mhc.parameters(), *mhc.buffers()))
    assert mhc.lm_head.weight is mhc.model.embed_tokens.weight
    # Bit-exact: both rotary embeddings compute their frequencies with the same code from the same config.
    torch.testing.assert_close(mhc.model.rotary_emb.inv_freq, source.model.rotary_emb.inv_freq, atol=0, rtol=0)


def test_upcycle_keeps_dtype_and_hc_in_float32():
    source = source_model("qwen3", tied=True).to(torch.bfloat16)
    mhc = hf_mhc.upcycle(source, hc_mult=4)
    assert mhc.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert mhc.model.layers[0].attn_hc.fn.dtype == torch.float32
    assert mhc.model.hc_head.hc_base.dtype == torch.float32
    ids = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(mhc(ids).logits.float(), source(ids).logits.float(), atol=0.1, rtol=0.05)


def test_upcycle_rejects_unsupported_families():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="supported backbone families: llama, mistral, qwen2, qwen3"):
        hf_mhc.upcycle(gpt2)
    with pytest.raises(ValueError, match="function_preserving"):
        hf_mhc.upcycle(source_model("llama", tied=False), hc_init="deepseek_v4")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(hc_sinkhron_iters=3), r"upcycle got an unknown mHC option 'hc_sinkhron_iters' \(did you mean "
                                    r"'hc_sinkhorn_iters'\?\); valid options: hc_mult, "),
        (dict(sinkhorn_iters=3), r"'sinkhorn_iters' \(did you mean 'hc_sinkhorn_iters'\?\)"),
        (dict(hc_eps=1e-5, hc_init_comb_diagonal=2.0), r"'hc_init_comb_diagonal' \(did you mean 'hc_init_comb_diag'"),
        (dict(vocab_size=7), r"unknown mHC option 'vocab_size'; valid options"),
    ],
)
def test_upcycle_refuses_unknown_options_before_loading(tmp_path, options, message):
    """A misspelt option is refused by name, never ignored (the model would get the default): before a path is
    loaded (this one does not exist), and by ``mhc_config_for``, which ``hf-mhc convert`` uses."""
    with pytest.raises(ValueError, match=message) as error:
        hf_mhc.upcycle(tmp_path / "not-loaded", hc_mult=4, **options)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=message.replace("upcycle", "mhc_config_for")):
        mhc_config_for(tiny_backbone_config("llama"), hc_mult=4, **options)
    upcycled = hf_mhc.upcycle(source_model("llama", tied=False), hc_mult=2, hc_sinkhorn_iters=3, hc_recompute=True)
    assert (upcycled.config.hc_sinkhorn_iters, upcycled.config.hc_recompute) == (3, True)


def test_upcycle_from_a_saved_folder(tmp_path):
    source = source_model("mistral", tied=False)
    source.save_pretrained(tmp_path)
    mhc = hf_mhc.upcycle(tmp_path, hc_mult=2).eval()
    ids = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        assert_logits_close(mhc(ids).logits, source(ids).logits)


@pytest.mark.skipif(not STORIES260K.is_dir(), reason="../shared/assets/stories260K is not present")
def test_real_pretrained_llama_upcycles_exactly():
    source = AutoModelForCausalLM.from_pretrained(STORIES260K).eval()
    mhc = hf_mhc.upcycle(source, hc_mult=4).eval()
    bos = torch.tensor([[source.config.bos_token_id]])
    ids = torch.randint(3, source.config.vocab_size, (2, 48))
    with torch.no_grad():
        assert_logits_close(mhc(ids).logits, source(ids).logits)
    expected = source.generate(bos, max_new_tokens=32, do_sample=False)
    assert torch.equal(mhc.generate(bos, max_new_tokens=32, do_sample=False), expected)


@pytest.mark.parametrize("hc_mult", [2, 3, 4, 8])
def test_function_preserving_init_gives_every_stream_its_own_post(hc_mult):
    mhc = hf_mhc.upcycle(source_model("llama", tied=False), hc_mult=hc_mult)
    base = mhc.model.layers[1].ffn_hc.base.detach()
    post = 2 * torch.sigmoid(base[hc_mult : 2 * hc_mult])
    assert len(set(post.tolist())) == hc_mult  # no two streams alike, or they would train identically
    assert abs(post.mean().item() - 1.0) < 1e-4
    pre = torch.sigmoid(base[:hc_mult]) + mhc.config.hc_eps
    torch.testing.assert_close(pre, torch.full((hc_mult,), 1.0 / hc_mult), atol=1e-7, rtol=0)


def test_function_preserving_hc_tensors_match_the_model_init():
    from hf_mhc.modeling_mhc import function_preserving_hc_tensors

    config = hf_mhc.upcycle(source_model("qwen2", tied=True), hc_mult=3).config
    state = MHCForCausalLM(config).state_dict()
    tensors = function_preserving_hc_tensors(config)
    assert set(tensors) == {name for name in state if hf_mhc.conversion.is_hc_parameter(name)}
    for name, tensor in tensors.items():
        assert torch.equal(state[name], tensor), name


RESIDUAL_MAP_CASES = [(residual_map, n) for residual_map in ("unconstrained", "identity", "permutations")
                      for n in ((1, 2, 3, 4) if residual_map == "permutations" else (1, 2, 3, 4, 8))]


@pytest.mark.parametrize(("residual_map", "hc_mult"), RESIDUAL_MAP_CASES)
@pytest.mark.parametrize("family", ["llama", "olmo2", "granite"])
def test_every_residual_map_upcycles_to_the_source_logits(family, residual_map, hc_mult):
    """Each map's function-preserving start (``fn = 0``, biases making ``pre = 1/n``, ``mean(post) = 1`` and rows of
    ``comb`` summing to 1) reproduces the source, also with post-norms (OLMo 2) and residual multipliers (Granite)."""
    source = source_model(family, tied=False)
    mhc = hf_mhc.upcycle(source, hc_mult=hc_mult, hc_residual_map=residual_map).eval()
    assert mhc.config.hc_residual_map == residual_map
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        assert_logits_close(mhc(ids).logits, source(ids).logits)
    # The token-dependent part is off but trainable: fn = 0 with a non-zero scale, so fn gets a gradient.
    mhc.train()
    mhc(ids, labels=ids).loss.backward()
    assert mhc.model.layers[0].ffn_hc.fn.grad.abs().sum() > 0 or hc_mult == 1


@pytest.mark.parametrize("residual_map", ["unconstrained", "identity", "permutations"])
def test_function_preserving_init_of_each_map_gives_its_stated_values(residual_map):
    """``pre = 1/n``, every stream its own ``post`` with mean 1, and ``comb``: the identity (unconstrained, identity)
    or a doubly stochastic matrix with mHC's starting diagonal (permutations)."""
    n = 4
    mhc = hf_mhc.upcycle(source_model("llama", tied=False), hc_mult=n, hc_residual_map=residual_map,
                         **({"hc_post_magnitude": 3.0} if residual_map == "identity" else {}))
    site = mhc.model.layers[1].attn_hc
    pre, post, comb = (m[0, 0] for m in site.maps(torch.randn(1, 1, n, 32)))
    torch.testing.assert_close(pre, torch.full((n,), 1.0 / n), atol=1e-7, rtol=0)
    assert len(set(post.tolist())) == n and abs(post.mean().item() - 1.0) < 1e-6
    if residual_map == "permutations":
        sinkhorn_start = torch.softmax(mhc.config.hc_init_comb_diag * torch.eye(n), dim=-1)
        torch.testing.assert_close(comb, sinkhorn_start, atol=1e-6, rtol=0)
    else:  # bit-exact: identity's comb is built; unconstrained's is comb_b = I plus s2·tanh(0) = 0, exact in IEEE
        torch.testing.assert_close(comb, torch.eye(n), atol=0, rtol=0)


@pytest.mark.parametrize("residual_map", ["unconstrained", "identity", "permutations"])
def test_every_residual_map_gives_the_function_preserving_hc_tensors_of_its_init(residual_map):
    from hf_mhc.modeling_mhc import function_preserving_hc_tensors

    config = hf_mhc.upcycle(source_model("qwen2", tied=True), hc_mult=3, hc_residual_map=residual_map).config
    state = MHCForCausalLM(config).state_dict()
    for name, tensor in function_preserving_hc_tensors(config).items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.skipif(not STORIES260K.is_dir(), reason="../shared/assets/stories260K is not present")
@pytest.mark.parametrize("residual_map", ["unconstrained", "identity", "permutations"])
def test_real_pretrained_llama_upcycles_exactly_with_each_residual_map(residual_map):
    source = AutoModelForCausalLM.from_pretrained(STORIES260K).eval()
    mhc = hf_mhc.upcycle(source, hc_mult=4, hc_residual_map=residual_map).eval()
    ids = torch.randint(3, source.config.vocab_size, (2, 48))
    with torch.no_grad():
        assert_logits_close(mhc(ids).logits, source(ids).logits)


def test_the_residual_map_alias_is_deprecated_but_still_accepted():
    """``residual_map``, the former name of ``hc_residual_map``, works for one more release with a FutureWarning that
    names the field; given with a different ``hc_residual_map`` it is refused; ``hc_residual_map`` alone warns not."""
    source = source_model("llama", tied=False)
    with pytest.warns(FutureWarning, match=r"residual_map is deprecated .* hf-mhc 0\.2\.0: pass "
                                           r"hc_residual_map='identity'"):
        assert hf_mhc.upcycle(source, hc_mult=2, residual_map="identity").config.hc_residual_map == "identity"
    with pytest.warns(FutureWarning), pytest.raises(
            ValueError, match="upcycle got residual_map='identity' and hc_residual_map='permutations'"):
        hf_mhc.upcycle(source, residual_map="identity", hc_residual_map="permutations")
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        assert hf_mhc.upcycle(source, hc_residual_map="unconstrained").config.hc_residual_map == "unconstrained"


def test_upcycle_and_convert_take_their_defaults_from_mhc_config():
    """One place for each default: ``hc_mult`` and the residual map of ``upcycle``, ``mhc_config_for`` and
    ``convert_checkpoint`` are ``MHCConfig``'s."""
    for function in (hf_mhc.upcycle, mhc_config_for, convert_checkpoint):
        assert inspect.signature(function).parameters["hc_mult"].default == MHCConfig.hc_mult, function
    config = hf_mhc.upcycle(source_model("llama", tied=False)).config
    assert (config.hc_mult, config.hc_residual_map) == (MHCConfig.hc_mult, MHCConfig.hc_residual_map)
