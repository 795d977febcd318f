"""``mhc_coeffs``: a site's maps alone, ``streams [..., n, C] -> pre, post, comb``, as a ``torch.library`` custom op
with its own backward. Saved for backward: the streams, ``mix = RMSNorm(flat) @ fn.T`` and ``rstd`` (see
``coeffs_torch``). Reference: ``hf_mhc.mhc_reference.mhc_coeffs``."""

from __future__ import annotations

import torch

from .common import Kernels, zeros_if_none


def fake_comb(streams: torch.Tensor, residual_map: str) -> torch.Tensor:
    """The ``comb`` an op returns: ``[..., n, n]`` float32, empty for the identity map."""
    if residual_map == "identity":
        return streams.new_empty(0, dtype=torch.float32)
    return streams.new_empty(*streams.shape[:-1], streams.shape[-2], dtype=torch.float32)


def define_mhc_coeffs(backend: str, kernels: Kernels):
    """The custom ops ``hf_mhc::mhc_coeffs_fwd_<backend>`` / ``_bwd_<backend>`` over ``kernels.coeffs_forward`` /
    ``coeffs_backward``; returns the forward op ``(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps,
    residual_map, post_magnitude) -> (pre, post, comb, mix, rstd)``."""

    @torch.library.custom_op(f"hf_mhc::mhc_coeffs_fwd_{backend}", mutates_args=())
    def mhc_coeffs_fwd(
        streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
        eps: float, norm_eps: float, residual_map: str, post_magnitude: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return kernels.coeffs_forward(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, False, residual_map,
                                      post_magnitude)

    @mhc_coeffs_fwd.register_fake
    def _(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, residual_map, post_magnitude):
        lead, n = streams.shape[:-2], streams.shape[-2]
        new = streams.new_empty
        f32 = torch.float32
        return (new(*lead, n, dtype=f32), new(*lead, n, dtype=f32), fake_comb(streams, residual_map),
                new(*lead, fn.shape[0], dtype=f32), new(lead, dtype=f32))

    @torch.library.custom_op(f"hf_mhc::mhc_coeffs_bwd_{backend}", mutates_args=())
    def mhc_coeffs_bwd(
        streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, mix: torch.Tensor,
        rstd: torch.Tensor, grad_pre: torch.Tensor, grad_post: torch.Tensor, grad_comb: torch.Tensor,
        sinkhorn_iters: int, eps: float, residual_map: str, post_magnitude: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return kernels.coeffs_backward(streams, fn, base, scale, mix, rstd, (grad_pre, grad_post, grad_comb),
                                       sinkhorn_iters, eps, False, None, residual_map, post_magnitude)

    @mhc_coeffs_bwd.register_fake
    def _(streams, fn, base, scale, mix, rstd, grad_pre, grad_post, grad_comb, sinkhorn_iters, eps, residual_map,
          post_magnitude):
        return torch.empty_like(streams), torch.empty_like(fn), torch.empty_like(base), torch.empty_like(scale)

    def setup_context(ctx, inputs, output):
        streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, residual_map, post_magnitude = inputs
        *_, mix, rstd = output
        ctx.save_for_backward(streams, fn, base, scale, mix, rstd)
        ctx.mark_non_differentiable(mix, rstd)
        ctx.sinkhorn_iters, ctx.eps, ctx.residual_map, ctx.post_magnitude = (sinkhorn_iters, eps, residual_map,
                                                                             post_magnitude)

    def backward_of_coeffs(ctx, grad_pre, grad_post, grad_comb, grad_mix, grad_rstd):
        streams, fn, base, scale, mix, rstd = ctx.saved_tensors
        like = streams.new_empty(*streams.shape[:-2], streams.shape[-2], dtype=torch.float32)
        grads = mhc_coeffs_bwd(
            streams, fn, base, scale, mix, rstd, zeros_if_none(grad_pre, like), zeros_if_none(grad_post, like),
            zeros_if_none(grad_comb, fake_comb(streams, ctx.residual_map)), ctx.sinkhorn_iters, ctx.eps,
            ctx.residual_map, ctx.post_magnitude,
        )
        return (*grads, None, None, None, None, None)

    mhc_coeffs_fwd.register_autograd(backward_of_coeffs, setup_context=setup_context)
    return mhc_coeffs_fwd
