"""Sinkhorn-Knopp for ``comb`` in torch: a memory-light forward and the exact backward of the finite iteration.

The forward is ``hf_mhc.mhc_reference.sinkhorn``: ``M = softmax(logits) + eps`` (softmax over each row), then
``2·iters - 1`` normalisations (below). The backward returns the exact gradient of the finite iteration (the numbers
autograd gives through the unrolled loop) while saving only the ``[..., n, n]`` logits: the iterates are replayed
once into a transient list. The kernels work on ``[n, n, tokens]`` (``_tokens_last``): every step is then one
vectorised pass over the tokens rather than a reduction over a last axis of size n.

One normalisation step divides ``M`` by ``d = M.sum(axis) + eps``; its backward is
``dM = (G - sum_axis(G * M_out)) / d``. Step 0 normalises columns, then rows and columns alternate.
"""

from __future__ import annotations

import torch

from .common import without_autocast

_WITHIN_ROW, _WITHIN_COLUMN = 1, 0  # axes of the tokens-last layout [row, column, tokens]


def _tokens_last(matrices: torch.Tensor) -> torch.Tensor:
    """``[..., n, n]`` -> contiguous float32 ``[n, n, ...]``."""
    return matrices.float().movedim((-2, -1), (0, 1)).contiguous()


def _tokens_first(matrices: torch.Tensor) -> torch.Tensor:
    return matrices.movedim((0, 1), (-2, -1)).contiguous()


def _normalisation_axes(iters: int) -> list[int]:
    """The axis each step sums over: columns first, then rows and columns alternate."""
    return [_WITHIN_COLUMN] + [_WITHIN_ROW, _WITHIN_COLUMN] * (iters - 1)


@without_autocast
def sinkhorn_forward(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``[..., n, n]`` logits -> float32 ``comb``, the formula of ``mhc_reference.sinkhorn``."""
    with torch.no_grad():
        matrix = torch.softmax(_tokens_last(logits), dim=_WITHIN_ROW) + eps
        for axis in _normalisation_axes(iters):
            matrix /= matrix.sum(dim=axis, keepdim=True) + eps
        return _tokens_first(matrix)


@without_autocast
def sinkhorn_backward(logits: torch.Tensor, grad_comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Exact gradient w.r.t. ``logits [..., n, n]`` of ``sinkhorn(logits, iters, eps)`` (float32)."""
    probs = torch.softmax(_tokens_last(logits), dim=_WITHIN_ROW)
    matrix = probs + eps
    steps = []  # (normalised matrix, denominator, axis), replayed from the logits
    for axis in _normalisation_axes(iters):
        denominator = matrix.sum(dim=axis, keepdim=True) + eps
        matrix = matrix / denominator
        steps.append((matrix, denominator, axis))
    grad = _tokens_last(grad_comb)
    for matrix, denominator, axis in reversed(steps):
        grad = (grad - (grad * matrix).sum(dim=axis, keepdim=True)) / denominator
    return _tokens_first(probs * (grad - (grad * probs).sum(dim=_WITHIN_ROW, keepdim=True)))
