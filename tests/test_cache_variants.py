"""Cache variants on mHC models: static caches with sliding-window layers, and batched left-padded generation.

mHC leaves the KV cache as the backbone lays it out (attention reads the collapsed stream), so every cache
transformers offers for the backbone works unchanged; these tests hold greedy decoding to the dynamic cache's and each
row of a left-padded batch to the same prompt decoded alone. The offloaded caches (``"offloaded"``,
``"offloaded_static"``) need a CUDA device and are not tested here.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_backbone_config
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from hf_mhc import MHCConfig, MHCForCausalLM
from hf_mhc.modeling_mhc import attention_layer_types
from hf_mhc.profiling import cache_bytes

NEW_TOKENS = 6


def random_mhc(family: str) -> MHCForCausalLM:
    backbone = tiny_backbone_config(family)
    return MHCForCausalLM(MHCConfig(backbone_config=backbone, hc_mult=3, hc_init="deepseek_v4")).eval()


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
