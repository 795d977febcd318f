"""The oracle of every op test: ``hf_mhc.mhc_reference`` computed in float64, one tolerance table, one check.

``check_against_reference(run, reference, inputs)`` runs an op on a backend (the torch or Triton kernels, the C++ CPU
decode kernels, the reference itself in float32) and its formula in ``mhc_reference`` on float64 copies of the same
inputs with ``compute_dtype=torch.float64``, then compares every output and, with random upstream gradients, every
input gradient. A compared tensor passes when ``max |ours - float64| <= tolerance * max(1, max |float64|)``: absolute
for values below 1, relative to the tensor's largest entry above, so the bounds hold for any values, any x86 CPU and
thread count (BLAS may block a product differently, which moves float32 results by a few ulps of their scale).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_mhc import mhc_reference


@dataclass(frozen=True)
class Tolerance:
    """Bounds relative to ``max(1, max |float64 value|)`` of the compared tensor."""

    forward: float  # an output of this dtype
    backward: float  # a gradient, where this is the least precise dtype among the op's inputs and outputs


TOLERANCES: dict[torch.dtype, Tolerance] = {
    # float32 arithmetic throughout: the maps (Sinkhorn's iterations and its recomputed backward included), the GEMMs.
    torch.float32: Tolerance(forward=2e-5, backward=1e-4),
    # float64 streams: every backend computes the maps in float32 and returns float64, so float32's bounds.
    torch.float64: Tolerance(forward=2e-5, backward=1e-4),
    # One rounding of each stream-sized result to the dtype: at most 2^-8 of the value for bfloat16, 2^-11 for float16,
    # twice that where the Triton interpreter truncates instead of rounding; gradients also carry the rounding of the
    # stream gradients and of the upstream gradients of the dtype.
    torch.bfloat16: Tolerance(forward=2e-2, backward=5e-2),
    torch.float16: Tolerance(forward=2e-3, backward=5e-3),
}


def float64_copy(value: Any) -> Any:
    """A float64 leaf with the values of a floating-point tensor (requiring grad as it does); anything else as it
    is."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().to(torch.float64).requires_grad_(value.requires_grad)
    return value


def assert_close_to_float64(actual: torch.Tensor, expected: torch.Tensor, tolerance: float, what: str = "") -> None:
    """``max |actual - expected| <= tolerance * max(1, max |expected|)`` (``expected`` in float64)."""
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual.to(torch.float64), expected, atol=tolerance * scale, rtol=0,
                               msg=lambda message: f"{what}: {message}")


def _as_tuple(outputs: Any) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


def check_against_reference(
    run: Callable[..., Any],
    reference: Callable[..., Any],
    inputs: Sequence[Any],
    *,
    backward: bool = True,
) -> tuple:
    """Check ``run(*inputs)`` against ``reference(*float64 copies of inputs, compute_dtype=torch.float64)``.

    ``reference`` is a formula of ``mhc_reference`` (or a composition of them, taking ``compute_dtype``) with the
    op's settings bound; both return a tensor or a tuple of the same length, ``None`` in the same places. Forward:
    each output has the reference's shape and is within ``TOLERANCES[its dtype].forward``. Backward (unless
    ``backward=False``): the same random normal upstream gradients (drawn in each output's dtype, never all-ones) go
    back through both, and the gradient of every input that requires grad is finite and within the ``backward``
    tolerance of the least precise dtype among the op's floating inputs and outputs. Returns ``run``'s outputs.
    """
    expected_inputs = [float64_copy(value) for value in inputs]
    outputs = _as_tuple(run(*inputs))
    expected = _as_tuple(reference(*expected_inputs, compute_dtype=torch.float64))
    assert len(outputs) == len(expected), f"{len(outputs)} outputs, the reference has {len(expected)}"
    for index, (ours, truth) in enumerate(zip(outputs, expected, strict=True)):
        if truth is None:
            assert ours is None, f"output {index} should be None"
            continue
        assert ours.shape == truth.shape, f"output {index}: shape {tuple(ours.shape)}, expected {tuple(truth.shape)}"
        assert_close_to_float64(ours, truth, TOLERANCES[ours.dtype].forward, f"output {index}")
    if not backward:
        return outputs

    differentiable = [(ours, truth) for ours, truth in zip(outputs, expected, strict=True)
                      if ours is not None and ours.requires_grad]
    assert all(truth.requires_grad for _, truth in differentiable)
    upstream = [torch.randn(ours.shape, dtype=torch.float64, device=ours.device).to(ours.dtype)
                for ours, _ in differentiable]
    wanted = [index for index, value in enumerate(inputs) if isinstance(value, torch.Tensor) and value.requires_grad]
    grads = torch.autograd.grad([ours for ours, _ in differentiable], [inputs[i] for i in wanted], upstream,
                                materialize_grads=True)
    expected_grads = torch.autograd.grad([truth for _, truth in differentiable], [expected_inputs[i] for i in wanted],
                                         [grad.to(torch.float64) for grad in upstream], materialize_grads=True)
    dtypes = {t.dtype for t in (*inputs, *outputs) if isinstance(t, torch.Tensor) and t.is_floating_point()}
    tolerance = max(TOLERANCES[dtype].backward for dtype in dtypes)
    for index, grad, truth in zip(wanted, grads, expected_grads, strict=True):
        assert torch.isfinite(grad).all(), f"gradient of input {index} is not finite"
        assert_close_to_float64(grad, truth, tolerance, f"gradient of input {index}")
    return outputs


def random_site_params(n: int, hidden: int, residual_map: str = "sinkhorn") -> tuple[torch.Tensor, ...]:
    """``fn``, ``base``, ``scale`` of a site of ``residual_map`` (float32, on the default device), away from any
    special values: ``fn ~ N(0, 0.25)``, ``base ~ N(0, 1)``, ``scale`` in ``[0.5, 1.5)``."""
    rows = sum(mhc_reference.map_sizes(n, residual_map))
    return (torch.randn(rows, n * hidden) * 0.5, torch.randn(rows),
            torch.rand(mhc_reference.scale_size(residual_map)) + 0.5)


def random_head_params(n: int, hidden: int) -> tuple[torch.Tensor, ...]:
    """``hc_fn``, ``hc_base``, ``hc_scale`` of a head, drawn as ``random_site_params``."""
    return torch.randn(n, n * hidden) * 0.5, torch.randn(n), torch.rand(1) + 0.5


def leaf(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` that requires grad, with no history."""
    return tensor.detach().clone().requires_grad_(True)
