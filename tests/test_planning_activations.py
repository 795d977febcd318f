"""``hf-mhc plan``'s activations: the bytes a training forward holds for backward, counted on fake tensors, against
the same forward on real tensors (every family, residual and mHC, ``hc_recompute``, gradient checkpointing, two
dtypes), the counter against torch's profiler, and the checkpointed cases by hand."""

from __future__ import annotations

import functools
import gc
import json
import threading

import pytest
import torch
from conftest import FAMILY_SETTINGS, MOE_FAMILIES, tiny_backbone_config
from torch.multiprocessing.reductions import StorageWeakRef
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM, masking_utils
from transformers.integrations import moe

import hf_mhc
from hf_mhc.conversion.upcycle import mhc_config_for
from hf_mhc.planning import ACTIVATION_CASES, _forward_as_in_training, activations_held, held_by_case, plan_memory
from hf_mhc.profiling import held_for_backward

BATCH, TOKENS = 2, 24  # more tokens than Mistral's and Gemma 3's sliding windows
CASES = [(False, False), (True, False), (False, True)]  # (hc_recompute, gradient checkpointing)


def backbone(family: str):
    # DeepSeek-V3 with q/k and v head dims equal (8 + 8 = 16): torch's CPU SDPA then runs the fused kernel, as the
    # plan counts; unequal dims are test_unequal_head_dims_count_as_the_memory_efficient_kernel's.
    return tiny_backbone_config(family, **({"v_head_dim": 16} if family == "deepseek_v3" else {}))


def real_held(model, cases) -> list[dict]:
    """What :func:`activations_held` counts, on ``model``'s real tensors (the same cases and attribution)."""
    return held_by_case(model, torch.randint(3, 100, (BATCH, TOKENS)), tuple(cases))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("family", list(FAMILY_SETTINGS))
def test_planned_activations_equal_a_real_training_forward(family, dtype, monkeypatch, one_thread):
    """Per layer and outside the layers, byte for byte. MoE experts in float32 take transformers' grouped-mm
    fallback in both runs, as the plan counts them (torch's CPU kernel keeps 4·E more bytes of offsets)."""
    grouped_mm = moe._can_use_grouped_mm
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda input, weight, offs: (
        weight.dtype == torch.bfloat16 and grouped_mm(input, weight, offs)))
    config = backbone(family)
    for model_config, cases in ((config, [CASES[0], CASES[2]]), (mhc_config_for(config, hc_mult=3), CASES)):
        torch.manual_seed(0)
        real = real_held(AutoModelForCausalLM.from_config(model_config, dtype=dtype).train(), cases)
        planned = activations_held(model_config, dtype, batch=BATCH, tokens=TOKENS, cases=tuple(cases))
        assert planned == real, (type(model_config).__name__, cases)
        assert set(real[0]) == {None, *range(config.num_hidden_layers)}


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_moe", "deepseek_v3"])
def test_held_bytes_are_what_the_profiler_sees_allocated(family, one_thread):
    """An independent count: the bytes a forward leaves allocated (torch's profiler) while its loss is alive, plus
    the input ids it saves, less the loss itself, within 64 bytes (scalar constants some families make)."""
    config = backbone(family)
    input_ids = torch.randint(3, 100, (BATCH, TOKENS))
    for model_config, (hc_recompute, checkpointing) in [(config, CASES[0]), (config, CASES[2])] + [
            (mhc_config_for(config, hc_mult=4), case) for case in CASES]:
        model = AutoModelForCausalLM.from_config(model_config).train()
        model.config.hc_recompute = hc_recompute
        if checkpointing:
            model.activation_checkpointing_enable()
        held = sum(held_for_backward(lambda model=model: model(input_ids, labels=input_ids, use_cache=False).loss,
                                     exclude=tuple(model.parameters())).values())
        gc.collect()  # what the count's forward left in reference cycles is freed before, not during the profile
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            loss = model(input_ids, labels=input_ids, use_cache=False).loss
        allocated = sum(event.self_cpu_memory_usage for event in profiler.key_averages())
        expected = allocated + input_ids.numel() * input_ids.element_size() - loss.numel() * loss.element_size()
        assert abs(held - expected) <= 64, (type(model_config).__name__, hc_recompute, checkpointing, held, expected)
        del loss  # freed before the next case's profiled forward


def test_reentrant_gradient_checkpointing_is_what_the_profiler_sees_allocated(one_thread):
    """Transformers' gradient checkpointing with ``use_reentrant=True`` (a Trainer option), residual and mHC, as
    the test above."""
    input_ids = torch.randint(3, 100, (BATCH, TOKENS))
    for model_config in (tiny_backbone_config("llama"), mhc_config_for(tiny_backbone_config("llama"), hc_mult=4)):
        model = AutoModelForCausalLM.from_config(model_config).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        held = sum(held_for_backward(lambda model=model: model(input_ids, labels=input_ids, use_cache=False).loss,
                                     exclude=tuple(model.parameters())).values())
        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            loss = model(input_ids, labels=input_ids, use_cache=False).loss
        allocated = sum(event.self_cpu_memory_usage for event in profiler.key_averages())
        expected = allocated + input_ids.numel() * input_ids.element_size() - loss.numel() * loss.element_size()
        assert abs(held - expected) <= 64, (type(model_config).__name__, held, expected)
        del loss


def test_checkpointed_layers_hold_their_inputs_by_hand():
    """Gradient checkpointing: per layer the hidden states entering it (``n·C`` streams for mHC) and a copy of the
    CPU random state; the rotary ``cos`` and ``sin`` ``[1, T, head_dim]`` in the model's dtype and the position ids
    ``[1, T]`` (int64) that every layer's keyword arguments pass, first held by layer 0."""
    config = tiny_backbone_config("llama")  # C = 32, 2 layers, head_dim 8
    plan = plan_memory(config, tokens=TOKENS, batch=BATCH, dtype="bfloat16", hc_mult=4)
    rng_state = torch.get_rng_state().numel()
    rotary = 2 * TOKENS * 8 * 2 + TOKENS * 8
    layers, per_token = config.num_hidden_layers, BATCH * TOKENS
    for name, width in (("residual + gradient checkpointing", 32), ("mhc + gradient checkpointing", 4 * 32)):
        expected = layers * (per_token * width * 2 + rng_state) + rotary
        assert plan.activation_bytes_per_token_layer[name] * per_token * layers == expected, name
        assert plan.activation_bytes[name] == expected + plan.activation_bytes_outside_layers[name]


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


def test_the_plan_reports_every_case():
    plan = plan_memory(tiny_backbone_config("qwen3_moe"), tokens=TOKENS, batch=BATCH, dtype="bfloat16", hc_mult=4)
    assert list(plan.activation_bytes) == [name for name, *_ in ACTIVATION_CASES]
    mhc = plan.activation_bytes_per_token_layer
    assert mhc["mhc + hc_recompute"] < mhc["mhc"] and mhc["mhc + gradient checkpointing"] < mhc["mhc + hc_recompute"]
    assert set(plan.activation_largest_layer_bytes) == {"residual", "mhc", "mhc + hc_recompute"}
    residual = plan_memory(tiny_backbone_config("qwen3_moe"), tokens=TOKENS, batch=BATCH, dtype="bfloat16")
    assert list(residual.activation_bytes) == ["residual", "residual + gradient checkpointing"]
    assert residual.activation_bytes["residual"] == plan.activation_bytes["residual"]
    assert MOE_FAMILIES  # qwen3_moe: its dense layer 0 and its MoE layer 1 differ
    assert plan.activation_largest_layer_bytes["residual"] * 2 > plan.activation_bytes["residual"] - (
        plan.activation_bytes_outside_layers["residual"])


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


def test_activations_held_sets_each_case_on_a_copy():
    """An MHCConfig saved with ``hc_recompute=True`` counts the plain case plainly, and neither config changes."""
    backbone_config = tiny_backbone_config("llama")
    recomputing = mhc_config_for(backbone_config, hc_mult=2, hc_recompute=True)
    plain, recomputed = activations_held(recomputing, torch.float32, batch=BATCH, tokens=TOKENS,
                                         cases=((False, False), (True, False)))
    reference = mhc_config_for(backbone_config, hc_mult=2)
    assert [plain, recomputed] == activations_held(reference, torch.float32, batch=BATCH, tokens=TOKENS,
                                                   cases=((False, False), (True, False)))
    assert plain != recomputed and recomputing.hc_recompute is True and reference.hc_recompute is False
    activations_held(backbone_config, torch.float32, batch=BATCH, tokens=TOKENS)
    assert "hc_recompute" not in backbone_config.to_dict()


def test_the_mhc_plan_runs_the_configs_attention(tmp_path, one_thread):
    """A config.json saved with ``attn_implementation: eager`` (the ``T × T`` probabilities held): the mHC cases
    run it too, as ``hf_mhc.upcycle`` of that model does (counted on its real tensors)."""
    folder = tmp_path / "eager"
    tiny_backbone_config("llama").save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**saved, "attn_implementation": "eager"}))
    plan = plan_memory(folder, tokens=TOKENS, batch=BATCH, dtype="float32", hc_mult=2)
    torch.manual_seed(0)
    upcycled = hf_mhc.upcycle(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).train(), hc_mult=2)
    assert upcycled.config._attn_implementation == "eager"
    for (name, *_), real in zip(ACTIVATION_CASES[2:], real_held(upcycled, CASES), strict=True):
        assert plan.activation_bytes[name] == sum(real.values()), name


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
    import hf_mhc.planning as planning

    patched = (masking_utils, "find_packed_sequence_indices"), (moe, "_can_use_grouped_mm"), (
        torch.nn.functional, "scaled_dot_product_attention"), (torch.utils.checkpoint, "_CheckpointFrame")
    originals = [getattr(module, name) for module, name in patched]
    first_done, calls, threads = threading.Event(), [], []
    count = planning.held_for_backward

    def interleaved(*args, **kwargs):
        calls.append(threading.current_thread())
        if len(calls) == 1:  # thread A, inside its plan: B starts its own, and counts only once A's has ended
            threads.append(threading.Thread(target=lambda: activations_held(backbone("llama"), torch.float32,
                                                                            batch=1, tokens=4)))
            threads[0].start()
        else:
            first_done.wait(timeout=120)
        return count(*args, **kwargs)

    monkeypatch.setattr(planning, "held_for_backward", interleaved)
    activations_held(backbone("llama"), torch.float32, batch=1, tokens=4)
    first_done.set()
    threads[0].join(timeout=120)
    assert len(calls) == 2 and [getattr(module, name) for module, name in patched] == originals
