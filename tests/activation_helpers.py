"""Helpers shared by the tests of ``hf_mhc.activation_count``, ``hf_mhc.profiling`` and ``hf_mhc.planning``:
the tiny configs and training cases the activation counts run on, and the same counts on real tensors."""

from __future__ import annotations

import torch
from conftest import tiny_backbone_config

from hf_mhc.activation_count import held_by_case

COUNT_BATCH, COUNT_TOKENS = 2, 24  # more tokens than Mistral's and Gemma 3's sliding windows
TRAINING_CASES = [(False, False), (True, False), (False, True)]  # (hc_recompute, gradient checkpointing)


def counted_backbone(family: str):
    """The tiny ``family`` config the activation counts run on. DeepSeek-V3 with q/k and v head dims equal (8 + 8 =
    16): torch's CPU SDPA then runs the fused kernel, as the plan counts; unequal dims are
    test_activation_count.py's test_unequal_head_dims_count_as_the_memory_efficient_kernel's."""
    return tiny_backbone_config(family, **({"v_head_dim": 16} if family == "deepseek_v3" else {}))


def real_held(model, cases) -> list[dict]:
    """What :func:`hf_mhc.activation_count.activations_held` counts, on ``model``'s real tensors (the same cases and
    attribution)."""
    return held_by_case(model, torch.randint(3, 100, (COUNT_BATCH, COUNT_TOKENS)), tuple(cases))


# ---------------------------------------------------------------- diagnostics
