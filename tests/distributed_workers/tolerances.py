"""Tolerances of the distributed workers, and the scale-aware comparison they use.

A sharded or pipelined run computes the same sums as one process in another order (per-rank or per-microbatch
partial sums, then a reduction), so its float32 results differ from the one-process ones by rounding that scales with
the magnitudes summed, not with each result: an entry near zero gets noise of its neighbours' size. Each tensor is
therefore compared against its own largest entry.
"""

from __future__ import annotations

import torch

# float32 reduction-order noise measured on these tiny models is a few 1e-7 of a tensor's largest entry for logits,
# losses and most gradients; 1e-4 leaves a wide margin for other CPUs and thread counts and is still far below what a
# real defect gives (a gradient reduced from one rank only, or averaged over the wrong count, is off by a factor of 2;
# one token of the 48 missing from the loss moves it by ~2%).
FLOAT32_RTOL = 1e-4

# Noise in a float32 sum scales with its terms, not with its result. Some gradients are a small remainder of
# cancelling terms: the final RMSNorm is scale-invariant, so per token sum_i pre_i <dy, X_i> = <dy, y> = 0 and the
# head's gradients (hc_head.*, ~3e-6 here) come out far smaller than the terms they sum, with errors up to 6e-5 of
# their own size. Their terms are bounded by the model's gradient scale, so each gradient entry is also allowed
# GRADIENT_FLOOR times the largest gradient entry of the whole model (0.16 here, in the embedding): the largest error
# of any gradient entry measured is 7e-9 of it (two ranks, one or two threads each), and 2e-7 of it is 1% of the
# head's smallest gradient.
GRADIENT_FLOOR = 2e-7

# bfloat16 keeps 8 significant bits: one rounding step is 2**-8 of a value. The bf16 loss is a float32 mean over the
# tokens of a cross-entropy of bf16 logits; summing in another order perturbs the logits by bf16 rounding, and the
# mean over tokens averages most of it out (measured: 1e-7 of the loss). One bf16 rounding step of the loss is the
# tolerance.
BFLOAT16_RTOL = 2.0**-8

# AdamW moves an entry by lr * m_hat / (sqrt(v_hat) + eps) plus its weight decay lr * wd * p. For the first three
# steps with betas (0.9, 0.999), |m_hat / sqrt(v_hat)| <= 1, 1.0014, 1.0036 (Cauchy-Schwarz on the two moment sums):
# at most ~lr per step, whatever the gradient. A gradient entry near zero is all rounding noise, so its sign can differ
# between two runs that agree to FLOAT32_RTOL, and the two runs step that entry in opposite directions: after k steps
# parameters may differ by up to 2 * k * lr (the decay terms differ by lr * wd * |Δp|, negligible). This bound, 1%
# above it, is the only tolerance the optimizer justifies after a step; the gradients before the first step are
# compared with FLOAT32_RTOL instead.
ADAM_STEP_BOUND = 1.01


def adamw_parameter_atol(lr: float, steps: int) -> float:
    """The largest difference two AdamW runs from equal parameters can reach after ``steps`` steps (see above)."""
    return 2 * steps * lr * ADAM_STEP_BOUND


def gradient_atol(gradients: list[torch.Tensor]) -> float:
    """``GRADIENT_FLOOR`` times the largest entry of ``gradients`` (all of a model's parameter gradients)."""
    return GRADIENT_FLOOR * max(gradient.abs().max().item() for gradient in gradients)


def assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float = 0.0,
                          name: str = "") -> float:
    """Assert ``|actual - expected| <= rtol * max|expected| + atol`` entrywise (same shape); return the largest error
    as a fraction of that bound (how much of the tolerance was used)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    bound = rtol * scale + atol
    assert error <= bound, f"{name}: max |Δ| {error:.3g} > {rtol:g} * max|expected| ({scale:.3g}) + {atol:.3g}"
    return error / bound if bound > 0 else 0.0
