"""``hf_mhc.profiling``: the bytes held for backward (against torch's profiler, and by hand for checkpoints, dropped
branches and threads), and the bytes a KV cache holds."""

from __future__ import annotations

import functools
import gc
import threading

import pytest
import torch
from activation_helpers import COUNT_BATCH, COUNT_TOKENS, TRAINING_CASES, counted_backbone
from conftest import OLD_CHECKPOINT, needs_torch, tiny_backbone_config
from torch.multiprocessing.reductions import StorageWeakRef
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint
from transformers import AutoModelForCausalLM, DynamicCache

from hf_mhc.conversion.upcycle import mhc_config_for
from hf_mhc.profiling import cache_bytes, held_for_backward, saved_bytes_for_backward


def held_and_allocated(model, input_ids: torch.Tensor) -> tuple[int, int]:
    """What :func:`held_for_backward` counts for ``model``'s training forward on ``input_ids`` (parameters excluded),
    and an independent count: the bytes the same forward leaves allocated (torch's profiler) while its loss is alive,
    plus the input ids it saves, less the loss itself."""
    held = saved_bytes_for_backward(lambda: model(input_ids, labels=input_ids, use_cache=False).loss,
                                    exclude=tuple(model.parameters()))
    gc.collect()  # what the count's forward left in reference cycles is freed before, not during the profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        loss = model(input_ids, labels=input_ids, use_cache=False).loss
    allocated = sum(event.self_cpu_memory_usage for event in profiler.key_averages())
    return held, allocated + input_ids.numel() * input_ids.element_size() - loss.numel() * loss.element_size()


@needs_torch(*OLD_CHECKPOINT)
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_moe", "deepseek_v3"])
def test_held_bytes_are_what_the_profiler_sees_allocated(family, one_thread):
    """Within 64 bytes (scalar constants some families make), residual and mHC, plain, with ``hc_recompute`` and with
    gradient checkpointing."""
    config = counted_backbone(family)
    input_ids = torch.randint(3, 100, (COUNT_BATCH, COUNT_TOKENS))
    for model_config, (hc_recompute, checkpointing) in [(config, TRAINING_CASES[0]), (config, TRAINING_CASES[2])] + [
            (mhc_config_for(config, hc_mult=4), case) for case in TRAINING_CASES]:
        model = AutoModelForCausalLM.from_config(model_config).train()
        model.config.hc_recompute = hc_recompute
        if checkpointing:
            model.activation_checkpointing_enable()
        held, expected = held_and_allocated(model, input_ids)
        assert abs(held - expected) <= 64, (type(model_config).__name__, hc_recompute, checkpointing, held, expected)


def test_reentrant_gradient_checkpointing_is_what_the_profiler_sees_allocated(one_thread):
    """Transformers' gradient checkpointing with ``use_reentrant=True`` (a Trainer option), residual and mHC, as
    the test above."""
    input_ids = torch.randint(3, 100, (COUNT_BATCH, COUNT_TOKENS))
    for model_config in (tiny_backbone_config("llama"), mhc_config_for(tiny_backbone_config("llama"), hc_mult=4)):
        model = AutoModelForCausalLM.from_config(model_config).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        held, expected = held_and_allocated(model, input_ids)
        assert abs(held - expected) <= 64, (type(model_config).__name__, held, expected)


@needs_torch(*OLD_CHECKPOINT)
def test_checkpoints_count_only_what_they_keep():
    """By hand on real tensors: a checkpoint keeps its input, its keyword tensor and a copy of the CPU random state;
    under ``no_grad`` nothing; dropped, nothing (its keyword tensor lives on, not held by it); another thread's
    checkpoint is not this forward's."""
    x, w = torch.randn(1000, requires_grad=True), torch.randn(1000)

    def region(a, *, b):
        return (a * b).sin()

    def checkpointed():
        return checkpoint(region, x * 1, b=w, use_reentrant=False)

    state = torch.get_rng_state().numel()
    assert held_for_backward(checkpointed) == {None: 4000 + 4000 + state}
    with torch.no_grad():
        assert held_for_backward(checkpointed) == {}

    def dropped():
        checkpointed()
        return (x * 2).sum()  # saves nothing

    assert held_for_backward(dropped) == {}
    kept = []

    def beside_a_thread():
        thread = threading.Thread(target=lambda: kept.append(checkpointed()))
        thread.start()
        thread.join()
        return (x * 2).sum()

    assert held_for_backward(beside_a_thread) == {} and len(kept) == 1


def test_saved_outputs_are_freed_with_their_graph():
    """``exp`` saves its own output: a branch dropped in the forward holds nothing, and once counted, the forward's
    graph and what it saved are freed (no reference cycle left by the counting)."""
    x = torch.randn(1000, requires_grad=True)
    saved = []

    def forward():
        branch = x.exp()  # dropped
        kept = (x * 3).exp()
        saved.extend(StorageWeakRef(tensor.untyped_storage()) for tensor in (branch, kept))
        return kept.sum()

    assert held_for_backward(forward) == {None: 4000}
    assert all(ref.expired() for ref in saved)


def test_reentrant_checkpoints_count_their_random_state():
    """``use_reentrant=True``: the input it saves, the tensor a ``functools.partial`` binds and the CPU random state
    kept on its autograd node; nothing once dropped."""
    x, w = torch.randn(1000, requires_grad=True), torch.randn(1000)
    region = functools.partial(lambda a, b: (a * b).sin(), b=w)
    state = torch.get_rng_state().numel()
    assert held_for_backward(lambda: checkpoint(region, x * 1, use_reentrant=True)) == {None: 4000 + 4000 + state}

    def dropped():
        checkpoint(region, x * 1, use_reentrant=True)
        return (x * 2).sum()

    assert held_for_backward(dropped) == {}


def test_cache_bytes_counts_every_layer_and_a_shared_tensor_once():
    """Keys and values of every layer, in their own dtypes; a tensor two layers hold counts once."""
    keys, values = torch.zeros(2, 3, 5, 8, dtype=torch.bfloat16), torch.zeros(2, 3, 5, 4)
    cache = DynamicCache()
    cache.update(keys, values, layer_idx=0)
    cache.update(keys.clone(), values.clone(), layer_idx=1)
    assert cache_bytes(cache) == 2 * (keys.numel() * 2 + values.numel() * 4)
    cache.layers[1].keys = cache.layers[0].keys
    assert cache_bytes(cache) == keys.numel() * 2 + 2 * values.numel() * 4
