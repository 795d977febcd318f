"""Quantized KV cache on mHC models: ``generate(..., cache_implementation="quantized", cache_config=...)``.

mHC leaves the KV cache alone: each attention sublayer sees the collapsed stream ``h = sum_i pre_i x_i`` (one
hidden vector per token, as in the backbone) and caches the backbone's keys and values of it. So transformers'
``QuantizedCache`` works on an mHC model as on its backbone, with the same bytes per token. The checks:

* cache bytes: counted from the tensors the cache layers hold after a forward pass (quanto's packed tensors
  unflattened into their storage), the dynamic cache against its closed form ``2 L B H_kv T D`` floats, the
  quantized one against ``nbits`` bits per value plus a float32 scale and zero per group;
* the upcycled model's cache equals its source's (Llama; DeepSeek-V3 where supported), in size and, at
  function-preserving init, in values;
* greedy agreement with the dynamic cache: the generated tokens equal up to at least the first step where the
  dynamic cache's top-1/top-2 logit margin is within twice the quantized cache's logit error (measured along the
  same tokens), which bounds it on any CPU; on stories260K, 8-bit HQQ keeps the first 20 tokens (40 measured);
* MLA (DeepSeek-V3, which caches the compressed latent and the shared RoPE key): the quantized cache on the source
  model, and on the upcycled one where ``deepseek_v3`` is an mHC backbone (skipped otherwise).

``optimum-quanto`` and ``hqq`` are optional (``pip install 'hf-mhc[quant]'``, not in ``dev``): their cases skip
when the package is missing. The ``fp8`` backend needs neither and always runs.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import OLD_FP8_CACHE, STORIES260K, VOCAB, needs_torch, tiny_backbone_config
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DynamicCache,
    LlamaForCausalLM,
    QuantizedCache,
)
from transformers.utils import is_hqq_available, is_optimum_quanto_available

import hf_mhc
from hf_mhc.profiling import cache_bytes

needs_quanto = pytest.mark.skipif(not is_optimum_quanto_available(),
                                  reason="optimum-quanto is not installed (pip install 'hf-mhc[quant]')")
needs_hqq = pytest.mark.skipif(not is_hqq_available(), reason="hqq is not installed (pip install 'hf-mhc[quant]')")
needs_stories = pytest.mark.skipif(not STORIES260K.is_dir(), reason="../shared/assets/stories260K is not present")

# (backend, nbits): what each backend takes on CPU (quanto: 2 or 4 bits; hqq: 1, 2, 3, 4 or 8; fp8: per-tensor).
BACKENDS = [
    pytest.param("quanto", 2, marks=needs_quanto, id="quanto-2"),
    pytest.param("quanto", 4, marks=needs_quanto, id="quanto-4"),
    pytest.param("hqq", 4, marks=needs_hqq, id="hqq-4"),
    pytest.param("hqq", 8, marks=needs_hqq, id="hqq-8"),
    pytest.param("fp8", None, marks=needs_torch(*OLD_FP8_CACHE), id="fp8"),
]


def group_size(config) -> int:
    """A quantization group size dividing ``num_key_value_heads * head_dim``, so that every sequence length can be
    quantized (quanto and HQQ group the flattened ``[B, H_kv, T, D]`` states; the default 64 needs ``H_kv * D``
    divisible by 64, which tiny models are not)."""
    if getattr(config, "kv_lora_rank", None):  # MLA: one latent "head" of kv_lora_rank, one RoPE key head
        width = math.gcd(config.kv_lora_rank, config.qk_rope_head_dim)
    else:
        width = config.num_key_value_heads * config.head_dim
    return max(g for g in (8, 16, 32, 64) if width % g == 0)


def cache_config(backend: str, nbits: int | None, config) -> dict:
    if backend == "fp8":  # per-tensor: takes no group-wise option
        return {"backend": "fp8"}
    return {"backend": backend, "nbits": nbits, "q_group_size": group_size(config)}


def make_cache(model, backend: str | None, nbits: int | None = None):
    """A fresh ``DynamicCache`` (``backend=None``) or ``QuantizedCache`` for ``model``."""
    if backend is None:
        return DynamicCache(config=model.config)
    options = cache_config(backend, nbits, model.config)
    return QuantizedCache(options.pop("backend"), model.config, **options)


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache):
    model(input_ids=input_ids, cache=cache, use_cache=True)
    return cache


@torch.no_grad()
def stepped_logits(model, prompt: torch.Tensor, continuation: torch.Tensor, cache) -> torch.Tensor:
    """Next-token logits ``[len(continuation), V]`` along ``prompt`` then ``continuation`` (teacher-forced, one token
    a step, as greedy decoding does while it follows ``continuation``)."""
    logits = [model(input_ids=prompt, cache=cache, use_cache=True).logits[0, -1]]
    for token in continuation[:-1]:
        logits.append(model(input_ids=token.view(1, 1), cache=cache, use_cache=True).logits[0, -1])
    return torch.stack(logits)


def agreement(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of equal tokens before the first difference."""
    differ = (a != b).nonzero()
    return int(differ[0]) if len(differ) else len(a)


def check_greedy(model, prompt: torch.Tensor, backend: str, nbits: int | None, new_tokens: int) -> dict:
    """Greedy generation with the quantized cache against the dynamic one. Returns the measured agreement, the
    agreement the logit errors guarantee, and the largest logit error relative to the logits' standard deviation."""
    n = prompt.shape[1]
    reference = model.generate(input_ids=prompt, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
    tokens, ref_logits = reference.sequences[0, n:], torch.stack(reference.logits)[:, 0]
    options = cache_config(backend, nbits, model.config)
    quantized = model.generate(input_ids=prompt, max_new_tokens=new_tokens, do_sample=False,
                               cache_implementation="quantized", cache_config=options, return_dict_in_generate=True)
    assert isinstance(quantized.cache, QuantizedCache)
    q_logits = stepped_logits(model, prompt, tokens, make_cache(model, backend, nbits))
    error = (q_logits - ref_logits).abs().amax(-1)
    top2 = ref_logits.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    # Greedy keeps the reference token while its margin exceeds the two logits' errors; the slack covers the float
    # rounding between generate's forward and the stepped one.
    slack = 1e-4 * ref_logits.std()
    unsafe = (margin <= 2 * error + slack).nonzero()
    return {"agreement": agreement(quantized.sequences[0, n:], tokens),
            "guaranteed": int(unsafe[0]) if len(unsafe) else new_tokens,
            "relative_error": float(error.max() / ref_logits.std())}


def upcycled_pair(source):
    """``(source, mHC model upcycled from a copy of it)``, both in eval mode."""
    return source.eval(), hf_mhc.upcycle(copy.deepcopy(source), hc_mult=4).eval()


def expected_quantized_bytes(num_values: int, num_layers: int, backend: str, nbits: int | None, group: int) -> int:
    """Upper bound of a quantized cache's bytes: ``nbits`` per value, plus a float32 scale and zero per group (fp8:
    one byte per value and a float32 scale for the keys and one for the values of each layer)."""
    if backend == "fp8":
        return num_values + 2 * 4 * num_layers
    return num_values * nbits // 8 + 2 * 4 * num_values // group


@pytest.mark.parametrize(("backend", "nbits"), BACKENDS)
def test_quantized_cache_bytes_on_mhc(backend, nbits):
    source, model = upcycled_pair(LlamaForCausalLM(tiny_backbone_config("llama")))
    config = source.config
    ids = torch.randint(3, VOCAB, (2, 24))
    dense = prefill(model, ids, make_cache(model, None))
    num_values = 2 * config.num_hidden_layers * 2 * config.num_key_value_heads * 24 * config.head_dim
    assert cache_bytes(dense) == 4 * num_values  # float32 keys and values, closed form
    quantized = prefill(model, ids, make_cache(model, backend, nbits))
    assert quantized.get_seq_length() == 24
    q_bytes = cache_bytes(quantized)
    bound = expected_quantized_bytes(num_values, config.num_hidden_layers, backend, nbits, group_size(config))
    assert 0 < q_bytes <= bound < cache_bytes(dense) / 2, (q_bytes, bound, cache_bytes(dense))
    # mHC caches what its backbone caches: the source Llama holds the same bytes, dynamic and quantized.
    assert cache_bytes(prefill(source, ids, make_cache(source, None))) == cache_bytes(dense)
    assert cache_bytes(prefill(source, ids, make_cache(source, backend, nbits))) == q_bytes


needs_mla_mhc = pytest.mark.skipif("deepseek_v3" not in hf_mhc.SUPPORTED_BACKBONES,
                                   reason="deepseek_v3 is not an mHC backbone yet")


def tiny_source(family: str):
    if family == "deepseek_v3":
        return DeepseekV3ForCausalLM(tiny_deepseek_v3_config())
    return LlamaForCausalLM(tiny_backbone_config(family))


@pytest.mark.parametrize("family", ["llama", pytest.param("deepseek_v3", marks=needs_mla_mhc)])
def test_mhc_cache_equals_source_cache(family):
    """The upcycled model's keys and values are its source's (attention sees the collapsed stream, which at
    function-preserving init is the source's hidden state), layer by layer."""
    source, model = upcycled_pair(tiny_source(family))
    ids = torch.randint(3, VOCAB, (2, 17))
    theirs, ours = prefill(source, ids, make_cache(source, None)), prefill(model, ids, make_cache(model, None))
    assert len(ours.layers) == len(theirs.layers) == source.config.num_hidden_layers
    for mine, src in zip(ours.layers, theirs.layers, strict=True):
        for name in ("keys", "values"):
            expected = getattr(src, name)
            torch.testing.assert_close(getattr(mine, name), expected, rtol=0, atol=1e-5 * expected.abs().max())


@pytest.mark.parametrize(("backend", "nbits"), BACKENDS)
def test_quantized_generate_on_tiny_mhc(backend, nbits):
    """Runs on a random tiny mHC model (odd prompt length: every length must quantize), and agrees with the dynamic
    cache at least as far as the logit errors guarantee."""
    _, model = upcycled_pair(LlamaForCausalLM(tiny_backbone_config("llama")))
    result = check_greedy(model, torch.randint(3, VOCAB, (1, 13)), backend, nbits, new_tokens=12)
    assert result["agreement"] >= result["guaranteed"], result


@needs_stories
@pytest.mark.parametrize(("backend", "nbits"), BACKENDS)
def test_quantized_generate_on_upcycled_stories260k(backend, nbits):
    """The real pretrained Llama upcycled: greedy agreement and logit error of each backend (measured: relative
    error 0.03-0.04 at 8 bits, 0.2-0.64 at 4, 0.27-0.31 for fp8's per-tensor scale; 8-bit HQQ guaranteed 40 of 40
    tokens on the first prompt)."""
    source, model = upcycled_pair(AutoModelForCausalLM.from_pretrained(STORIES260K))
    tokenizer = AutoTokenizer.from_pretrained(STORIES260K)
    bounds = {8: 0.15, None: 0.6, 4: 1.0, 2: None}  # relative logit error: 1.5-3.5x the largest measured
    for text in ("Once upon a time", "Tom and his dog went to the park. They saw a big"):
        prompt = tokenizer(text, return_tensors="pt").input_ids
        result = check_greedy(model, prompt, backend, nbits, new_tokens=40)
        assert result["agreement"] >= result["guaranteed"], (text, result)
        if bounds[nbits] is not None:
            assert result["relative_error"] <= bounds[nbits], (text, result)
        if (backend, nbits, text) == ("hqq", 8, "Once upon a time"):
            assert result["guaranteed"] >= 20, result
    # The same cache bytes as the source Llama, and the quantized ones below half the dynamic ones.
    ids = tokenizer("Once upon a time, there was a little girl named Lily.", return_tensors="pt").input_ids
    dense = cache_bytes(prefill(model, ids, make_cache(model, None)))
    assert dense == cache_bytes(prefill(source, ids, make_cache(source, None)))
    quantized = cache_bytes(prefill(model, ids, make_cache(model, backend, nbits)))
    assert quantized == cache_bytes(prefill(source, ids, make_cache(source, backend, nbits))) < dense / 2


@needs_hqq
@needs_stories
def test_more_bits_less_error():
    _, model = upcycled_pair(AutoModelForCausalLM.from_pretrained(STORIES260K))
    prompt = AutoTokenizer.from_pretrained(STORIES260K)("Once upon a time", return_tensors="pt").input_ids
    errors = {nbits: check_greedy(model, prompt, "hqq", nbits, new_tokens=20)["relative_error"] for nbits in (4, 8)}
    assert 0 < errors[8] < errors[4] / 3, errors  # measured about 20x apart


@needs_quanto
def test_quanto_takes_2_or_4_bits():
    _, model = upcycled_pair(LlamaForCausalLM(tiny_backbone_config("llama")))
    with pytest.raises(ValueError, match="has to be one of"):
        model.generate(input_ids=torch.randint(3, VOCAB, (1, 5)), max_new_tokens=2, do_sample=False,
                       cache_implementation="quantized", cache_config={"backend": "quanto", "nbits": 8})


def test_sliding_window_backbone_is_refused_clearly():
    """transformers' QuantizedCache takes full-attention layers only: an mHC Mistral with a sliding window gets its
    one-line error, before generating anything."""
    _, model = upcycled_pair(AutoModelForCausalLM.from_config(tiny_backbone_config("mistral")))
    with pytest.raises(ValueError, match="only full attention layers"):
        model.generate(input_ids=torch.randint(3, VOCAB, (1, 5)), max_new_tokens=2, do_sample=False,
                       cache_implementation="quantized", cache_config={"backend": "fp8"})


def tiny_deepseek_v3_config() -> DeepseekV3Config:
    """MLA: the cache holds the compressed latent (``kv_lora_rank``) and the shared RoPE key, one "head" each."""
    return DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=8,
        qk_rope_head_dim=16, v_head_dim=8, max_position_embeddings=128, pad_token_id=0)


def mla_generate(model, backend: str, nbits: int | None) -> QuantizedCache:
    options = cache_config(backend, nbits, model.config)
    out = model.generate(input_ids=torch.randint(3, VOCAB, (1, 11)), max_new_tokens=4, do_sample=False,
                         cache_implementation="quantized", cache_config=options, return_dict_in_generate=True)
    return out.cache


@pytest.mark.parametrize(("backend", "nbits"), BACKENDS)
def test_quantized_cache_on_mla_backbone(backend, nbits):
    """DeepSeek-V3's MLA caches ``kv_lora_rank + qk_rope_head_dim`` values per token and layer; the quantized cache
    compresses them further. The source model here; the mHC one in the next test, once ``deepseek_v3`` is a
    supported backbone."""
    model = DeepseekV3ForCausalLM(tiny_deepseek_v3_config()).eval()
    cache = mla_generate(model, backend, nbits)
    assert isinstance(cache, QuantizedCache) and cache.get_seq_length() == 14


@needs_mla_mhc
@pytest.mark.parametrize(("backend", "nbits"), BACKENDS)
def test_quantized_cache_on_mla_mhc(backend, nbits):
    """An upcycled DeepSeek-V3 (MLA): the source's cache bytes, below half the dynamic cache's, and greedy agreement
    as far as the logit errors guarantee."""
    source, model = upcycled_pair(tiny_source("deepseek_v3"))
    ids = torch.randint(3, VOCAB, (1, 16))
    quantized = cache_bytes(prefill(model, ids, make_cache(model, backend, nbits)))
    assert quantized == cache_bytes(prefill(source, ids, make_cache(source, backend, nbits)))
    assert quantized < cache_bytes(prefill(model, ids, make_cache(model, None))) / 2
    assert mla_generate(model, backend, nbits).get_seq_length() == 14
    result = check_greedy(model, torch.randint(3, VOCAB, (1, 13)), backend, nbits, new_tokens=8)
    assert result["agreement"] >= result["guaranteed"], result
