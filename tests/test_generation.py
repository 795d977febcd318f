"""``generate()`` on mHC models: what transformers' ``GenerationTesterMixin`` checks, written for the mHC streams.

The reference for every decoding strategy is the same model decoding step by step with full forwards and no cache
(``reference_greedy``), or the same strategy without the cache; sampling compares runs under one seed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import FLOAT32_TOLERANCES, VOCAB, random_mhc
from transformers import CompileConfig, DynamicCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from hf_mhc import MHCForCausalLM, MHCModel
from hf_mhc.modeling_mhc import attention_layer_types
from hf_mhc.profiling import cache_bytes

PROMPT_LENGTH, NEW_TOKENS, HC_MULT = 5, 6, 3


def prompt(batch: int = 2) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, PROMPT_LENGTH))


@torch.no_grad()
def reference_greedy(model: MHCForCausalLM, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding by hand: one full forward over the whole sequence per token, no cache."""
    for _ in range(new_tokens):
        next_token = model(input_ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        input_ids = torch.cat([input_ids, next_token], dim=-1)
    return input_ids


def generate(model, input_ids, **kwargs):
    defaults = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=None)
    return model.generate(input_ids, **{**defaults, **kwargs})


@pytest.mark.usefixtures("on_test_device")  # on CUDA under HF_MHC_TEST_DEVICE=cuda
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_dict_outputs(family, use_cache):
    model, input_ids = random_mhc(family), prompt()
    model.set_attn_implementation("eager")  # attention weights
    out = generate(model, input_ids, do_sample=False, use_cache=use_cache, return_dict_in_generate=True,
                   output_scores=True, output_logits=True, output_hidden_states=True, output_attentions=True)
    batch, config = input_ids.shape[0], model.config
    assert torch.equal(out.sequences, reference_greedy(model, input_ids, NEW_TOKENS))
    assert len(out.scores) == len(out.logits) == NEW_TOKENS
    assert all(step.shape == (batch, VOCAB) for step in (*out.scores, *out.logits))
    # Step 0 sees the prompt, later steps one token with the cache, or the whole sequence without it.
    assert len(out.hidden_states) == len(out.attentions) == NEW_TOKENS
    for step, (hidden, attentions) in enumerate(zip(out.hidden_states, out.attentions, strict=True)):
        length = (PROMPT_LENGTH if step == 0 else 1) if use_cache else PROMPT_LENGTH + step
        assert len(hidden) == config.num_hidden_layers + 1
        assert all(h.shape == (batch, length, HC_MULT, config.hidden_size) for h in hidden)
        assert len(attentions) == config.num_hidden_layers
        assert all(a.shape[:3] == (batch, config.num_attention_heads, length) for a in attentions)
    if use_cache:
        assert isinstance(out.cache, DynamicCache)
        assert out.cache.get_seq_length() == PROMPT_LENGTH + NEW_TOKENS - 1
    else:
        assert out.cache is None


@pytest.mark.parametrize("do_sample", [False, True], ids=["beam", "beam_sample"])
def test_beam_search_with_and_without_cache(do_sample):
    model, input_ids = random_mhc(), prompt()
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(7)
        runs.append(generate(model, input_ids, num_beams=3, num_return_sequences=2, do_sample=do_sample,
                             use_cache=use_cache, return_dict_in_generate=True, output_scores=True))
    cached, uncached = runs
    assert cached.sequences.shape == (2 * input_ids.shape[0], PROMPT_LENGTH + NEW_TOKENS)
    assert torch.equal(cached.sequences, uncached.sequences)
    torch.testing.assert_close(cached.sequences_scores, uncached.sequences_scores, atol=1e-4, rtol=1e-4)
    assert len(cached.scores) == NEW_TOKENS and cached.beam_indices.shape[0] == 2 * input_ids.shape[0]


@pytest.mark.parametrize("use_cache", [True, False])
def test_sampling_is_reproducible_and_cache_independent(use_cache):
    model, input_ids = random_mhc(), prompt()
    torch.manual_seed(3)
    first = generate(model, input_ids, do_sample=True, top_k=20, temperature=0.8, use_cache=use_cache,
                     return_dict_in_generate=True, output_scores=True)
    torch.manual_seed(3)
    reference = generate(model, input_ids, do_sample=True, top_k=20, temperature=0.8, use_cache=True)
    assert torch.equal(first.sequences, reference)
    assert len(first.scores) == NEW_TOKENS


@pytest.mark.parametrize("assistant", ["draft_model", "prompt_lookup"])
def test_assisted_decoding_equals_greedy(assistant):
    model, input_ids = random_mhc(num_hidden_layers=2), prompt(batch=1)
    torch.manual_seed(1)
    kwargs = ({"assistant_model": random_mhc(num_hidden_layers=1)} if assistant == "draft_model"
              else {"prompt_lookup_num_tokens": 3})
    out = generate(model, input_ids, do_sample=False, **kwargs)
    assert torch.equal(out, reference_greedy(model, input_ids, NEW_TOKENS))


def test_generate_from_inputs_embeds_continues_the_prompt():
    model, input_ids = random_mhc(), prompt()
    embeds = model.get_input_embeddings()(input_ids)
    from_embeds = generate(model, None, inputs_embeds=embeds, do_sample=False)
    # With only inputs_embeds, generate returns the new tokens alone.
    assert torch.equal(from_embeds, reference_greedy(model, input_ids, NEW_TOKENS)[:, PROMPT_LENGTH:])


@pytest.mark.usefixtures("on_test_device")  # on CUDA under HF_MHC_TEST_DEVICE=cuda
def test_static_cache_and_fullgraph_compile_equal_the_dynamic_cache():
    model, input_ids = random_mhc(), prompt()
    expected = reference_greedy(model, input_ids, NEW_TOKENS)
    assert torch.equal(generate(model, input_ids, do_sample=False, cache_implementation="static"), expected)
    # _can_compile_fullgraph is True: generate compiles the decoding step with fullgraph=True (aot_eager keeps the
    # CPU test fast; on a GPU transformers compiles with inductor by itself).
    compile_config = CompileConfig(fullgraph=True, backend="aot_eager", dynamic=False)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    compiled = generate(model, input_ids, do_sample=False, cache_implementation="static", compile_config=compile_config)
    assert torch.equal(compiled, expected)
    assert model._can_compile_fullgraph and model.__dict__.get("_compiled_call") is not None


def test_past_key_values_is_the_deprecated_name_of_cache():
    model, input_ids = random_mhc(), prompt()
    full = torch.cat([input_ids, torch.randint(3, VOCAB, (input_ids.shape[0], 3))], dim=-1)
    with torch.no_grad():
        expected = model(full, use_cache=False).logits[:, PROMPT_LENGTH:]
        cache = model(input_ids, use_cache=True).cache
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            continued = model(full[:, PROMPT_LENGTH:], past_key_values=cache, use_cache=True)
    assert any("`past_key_values` is deprecated" in str(warning.message) for warning in caught)
    assert continued.cache is cache and cache.get_seq_length() == full.shape[1]
    torch.testing.assert_close(continued.logits, expected, **FLOAT32_TOLERANCES["logits"])


def test_return_dict_false_returns_tuples():
    model, input_ids = random_mhc(), prompt()
    with torch.no_grad():
        base = MHCModel(model.config).eval()(input_ids, return_dict=False)
        causal = model(input_ids, labels=input_ids, return_dict=False)
    assert isinstance(base, tuple) and base[0].shape == (2, PROMPT_LENGTH, model.config.hidden_size)
    assert isinstance(causal, tuple)
    loss, logits = causal[:2]
    assert loss.ndim == 0 and logits.shape == (2, PROMPT_LENGTH, VOCAB)


def test_config_reads_and_writes_the_backbone_settings(tmp_path):
    model = random_mhc()
    config = model.config
    assert config.get_text_config() is config.get_text_config(decoder=True) is config
    assert (config.vocab_size, config.hidden_size, config.num_attention_heads) == (VOCAB, 32, 4)
    config.use_cache = False  # as Trainer does under gradient checkpointing: the model must follow it
    assert config.backbone_config.use_cache is False and "use_cache" not in config.to_dict()
    with torch.no_grad():
        assert model(prompt()).cache is None
    with pytest.raises(AttributeError, match="no attribute 'hc_mlt'"):
        config.hc_mlt  # noqa: B018
    model.save_pretrained(tmp_path)
    reloaded = MHCForCausalLM.from_pretrained(tmp_path)
    assert reloaded.config.use_cache is False and reloaded.config.backbone_config.use_cache is False
    assert reloaded.config.vocab_size == VOCAB


# --- cache variants: static caches with sliding-window layers, left-padded batches ---------------------------------
# mHC leaves the KV cache as the backbone lays it out (attention reads the collapsed stream), so every cache
# transformers offers for the backbone works unchanged. The offloaded caches need a CUDA device and are not tested.


def greedy(model, input_ids, **kwargs):
    return model.generate(input_ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                          pad_token_id=0, eos_token_id=None, **kwargs)


@pytest.mark.parametrize("family", ["mistral", "gemma3_text", "llama"])
def test_a_static_cache_bounds_sliding_layers_by_the_window_and_decodes_as_the_dynamic_one(family):
    """Mistral: every layer sliding; Gemma 3: sliding and full layers; Llama: full only. A prompt longer than the
    window, so the sliding layers really drop tokens."""
    model, input_ids = random_mhc(family), torch.randint(3, VOCAB, (2, 20))
    dynamic = greedy(model, input_ids)
    out = greedy(model, input_ids, cache_implementation="static", return_dict_in_generate=True)
    assert torch.equal(out.sequences, dynamic)
    config = model.config.backbone_config
    kinds = attention_layer_types(config)
    total = input_ids.shape[1] + NEW_TOKENS
    for kind, layer in zip(kinds, out.cache.layers, strict=True):
        if kind == "sliding_attention":
            assert type(layer) is StaticSlidingWindowLayer and layer.keys.shape[2] == config.sliding_window
        else:
            assert type(layer) is StaticLayer and layer.keys.shape[2] >= total - 1
    # The memory: keys and values of every layer's slots, float32, batch 2 (plus any small scalars a layer keeps).
    per_slot = 2 * input_ids.shape[0] * config.num_key_value_heads * config.head_dim * 4
    slots = sum(layer.keys.shape[2] for layer in out.cache.layers)
    assert 0 <= cache_bytes(out.cache) - slots * per_slot <= 8 * len(kinds)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_left_padded_batch_decodes_each_row_as_alone(family):
    model = random_mhc(family)
    long, short = torch.randint(3, VOCAB, (1, 9)), torch.randint(3, VOCAB, (1, 5))
    padded = torch.cat([long, torch.cat([torch.zeros(1, 4, dtype=torch.long), short], dim=1)])
    mask = torch.ones_like(padded)
    mask[1, :4] = 0
    batch = greedy(model, padded, attention_mask=mask)
    assert torch.equal(batch[0, 9:], greedy(model, long)[0, 9:])
    assert torch.equal(batch[1, 9:], greedy(model, short)[0, 5:])
