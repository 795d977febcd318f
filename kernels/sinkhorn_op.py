"""``sinkhorn``: the Sinkhorn-Knopp projection ``logits [..., n, n] -> comb`` as a ``torch.library`` custom op with
its own backward (saves the logits only). Reference: ``hf_mhc.mhc_reference.sinkhorn``."""

from __future__ import annotations

import torch

from .common import Kernels


def define_sinkhorn(backend: str, kernels: Kernels):
    """The custom ops ``hf_mhc::sinkhorn_fwd_<backend>`` / ``_bwd_<backend>`` over ``kernels.sinkhorn_forward`` /
    ``sinkhorn_backward``; returns the forward op ``(logits, iters, eps) -> comb``."""

    @torch.library.custom_op(f"hf_mhc::sinkhorn_fwd_{backend}", mutates_args=())
    def sinkhorn_fwd(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        return kernels.sinkhorn_forward(logits, iters, eps)

    @sinkhorn_fwd.register_fake
    def _(logits, iters, eps):
        return torch.empty_like(logits, dtype=torch.float32)

    @torch.library.custom_op(f"hf_mhc::sinkhorn_bwd_{backend}", mutates_args=())
    def sinkhorn_bwd(logits: torch.Tensor, grad_comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        return kernels.sinkhorn_backward(logits, grad_comb, iters, eps)

    @sinkhorn_bwd.register_fake
    def _(logits, grad_comb, iters, eps):
        return torch.empty_like(logits, dtype=torch.float32)

    def setup_context(ctx, inputs, output):
        logits, iters, eps = inputs
        ctx.save_for_backward(logits)
        ctx.iters, ctx.eps = iters, eps

    def backward_of_sinkhorn(ctx, grad_comb):
        (logits,) = ctx.saved_tensors
        return sinkhorn_bwd(logits, grad_comb, ctx.iters, ctx.eps).to(logits.dtype), None, None

    sinkhorn_fwd.register_autograd(backward_of_sinkhorn, setup_context=setup_context)
    return sinkhorn_fwd
