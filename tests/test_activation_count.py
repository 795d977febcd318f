"""``hf_mhc.activation_count``: the bytes a training forward holds for backward, counted on fake tensors, against the
same forward on real tensors (every family, residual and mHC, ``hc_recompute``, gradient checkpointing, two dtypes),
and the globals it substitutes while it counts."""

from __future__ import annotations

import threading

import pytest
import torch
from activation_helpers import COUNT_BATCH, COUNT_TOKENS, TRAINING_CASES, counted_backbone, real_held
from conftest import FAMILY_SETTINGS, tiny_backbone_config
from transformers import AutoModelForCausalLM, masking_utils
from transformers.integrations import moe

import hf_mhc.activation_count as activation_count
from hf_mhc.activation_count import _forward_as_in_training, activations_held
from hf_mhc.conversion.upcycle import mhc_config_for
from hf_mhc.planning import plan_memory
from hf_mhc.profiling import held_for_backward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", list(FAMILY_SETTINGS))
def test_planned_activations_equal_a_real_training_forward(family, dtype, monkeypatch, one_thread):
    """Per layer and outside the layers, byte for byte. MoE experts in float32 take transformers' grouped-mm
    fallback in both runs, as the plan counts them (torch's CPU kernel keeps 4·E more bytes of offsets)."""
    grouped_mm = moe._can_use_grouped_mm
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda input, weight, offs: (
        weight.dtype == torch.bfloat16 and grouped_mm(input, weight, offs)))
    config = counted_backbone(family)
    residual_cases = [TRAINING_CASES[0], TRAINING_CASES[2]]
    for model_config, cases in ((config, residual_cases), (mhc_config_for(config, hc_mult=3), TRAINING_CASES)):
        torch.manual_seed(0)
        real = real_held(AutoModelForCausalLM.from_config(model_config, dtype=dtype).train(), cases)
        planned = activations_held(model_config, dtype, batch=COUNT_BATCH, tokens=COUNT_TOKENS, cases=tuple(cases))
        assert planned == real, (type(model_config).__name__, cases)
        assert set(real[0]) == {None, *range(config.num_hidden_layers)}


def test_unequal_head_dims_count_as_the_memory_efficient_kernel():
    """MLA's q/k head dim differs from its v head dim: counted as CUDA's memory-efficient SDPA kernel keeps it
    (q, k, v, output, float32 log-sum-exp, two int64 RNG scalars), not the CPU math kernel's T × T probabilities."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    heads, tokens, qk_dim, v_dim = 4, 64, 24, 16
    with FakeTensorMode(), _forward_as_in_training():
        q, k = (torch.randn(1, heads, tokens, qk_dim, dtype=torch.bfloat16, requires_grad=True) * 1 for _ in "qk")
        v = torch.randn(1, heads, tokens, v_dim, dtype=torch.bfloat16, requires_grad=True) * 1
        held = held_for_backward(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
    values = heads * tokens * (2 * qk_dim + 2 * v_dim)
    assert sum(held.values()) == 2 * values + 4 * heads * tokens + 2 * 8
    full = plan_memory(tiny_backbone_config("deepseek_v3"), tokens=256, dtype="bfloat16")  # v_head_dim 8 < 16
    assert full.activation_bytes_per_token_layer["residual"] < 2 * plan_memory(
        tiny_backbone_config("deepseek_v3"), tokens=32, dtype="bfloat16").activation_bytes_per_token_layer["residual"]


def test_activations_held_sets_each_case_on_a_copy():
    """An MHCConfig saved with ``hc_recompute=True`` counts the plain case plainly, and neither config changes."""
    backbone_config = tiny_backbone_config("llama")
    recomputing = mhc_config_for(backbone_config, hc_mult=2, hc_recompute=True)
    plain, recomputed = activations_held(recomputing, torch.float32, batch=COUNT_BATCH, tokens=COUNT_TOKENS,
                                         cases=((False, False), (True, False)))
    reference = mhc_config_for(backbone_config, hc_mult=2)
    assert [plain, recomputed] == activations_held(reference, torch.float32, batch=COUNT_BATCH, tokens=COUNT_TOKENS,
                                                   cases=((False, False), (True, False)))
    assert plain != recomputed and recomputing.hc_recompute is True and reference.hc_recompute is False
    activations_held(backbone_config, torch.float32, batch=COUNT_BATCH, tokens=COUNT_TOKENS)
    assert "hc_recompute" not in backbone_config.to_dict()


def test_the_substitutions_leave_real_tensors_alone(one_thread):
    """While a plan runs, a real-tensor call (another thread's training step) gets the originals' results."""
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    q, k = torch.randn(2, 1, 2, 6, 8, dtype=torch.float64).unbind()
    v = torch.randn(1, 2, 6, 4, dtype=torch.float64)
    weight = torch.randn(4, 8, 8)
    inputs, offsets = torch.randn(6, 8), torch.tensor([2, 4, 6, 6], dtype=torch.int32)
    expected = (masking_utils.find_packed_sequence_indices(position_ids),
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
                moe._can_use_grouped_mm(inputs, weight, offsets))
    with _forward_as_in_training():
        got = (masking_utils.find_packed_sequence_indices(position_ids),
               torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
               moe._can_use_grouped_mm(inputs, weight, offsets))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and got[2] == expected[2]


def test_plans_in_two_threads_leave_the_globals_as_they_were(monkeypatch):
    """Thread B plans while thread A's plan runs and ends last: the functions both substitute end as they began."""
    patched = (masking_utils, "find_packed_sequence_indices"), (moe, "_can_use_grouped_mm"), (
        torch.nn.functional, "scaled_dot_product_attention"), (torch.utils.checkpoint, "_CheckpointFrame")
    originals = [getattr(module, name) for module, name in patched]
    first_done, calls, threads = threading.Event(), [], []
    count = activation_count.held_for_backward

    def interleaved(*args, **kwargs):
        calls.append(threading.current_thread())
        if len(calls) == 1:  # thread A, inside its plan: B starts its own, and counts only once A's has ended
            threads.append(threading.Thread(target=lambda: activations_held(counted_backbone("llama"), torch.float32,
                                                                            batch=1, tokens=4)))
            threads[0].start()
        else:
            first_done.wait(timeout=120)
        return count(*args, **kwargs)

    monkeypatch.setattr(activation_count, "held_for_backward", interleaved)
    activations_held(counted_backbone("llama"), torch.float32, batch=1, tokens=4)
    first_done.set()
    threads[0].join(timeout=120)
    assert len(calls) == 2 and [getattr(module, name) for module, name in patched] == originals
