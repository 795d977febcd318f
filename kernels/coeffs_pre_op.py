"""``mhc_coeffs_pre``: a site's entry, its maps and the ``pre`` collapse as one ``torch.library`` custom op,
``streams -> (y, post, comb)`` (what DeepSeek-V4's ``HyperConnection`` returns).

Forward: a backend's coefficient kernel, then its collapse kernel. Backward is one node: ``d pre[i] = <d y, X[i]>``
(a reduction over C, no stream-sized output), the maps' backward, then ``d X = d raw @ fn + correction · X +
pre[i] · d y`` in a single pass that writes ``d X`` once (as two ops, ``mhc_coeffs`` and ``mhc_pre`` would each
write a stream-sized ``d X`` for autograd to add). Saved for backward: the streams and, per token, ``pre``, ``mix``
and ``rstd``. Reference: ``hf_mhc.mhc_reference.mhc_coeffs_pre``.
"""

from __future__ import annotations

import torch

from .coeffs_op import fake_comb
from .common import Kernels, zeros_if_none


def coeffs_pre_forward(kernels: Kernels, streams, fn, base, scale, iters, eps, norm_eps, head, residual_map,
                       post_magnitude):
    """``(y, post, comb, pre, mix, rstd)`` for a sublayer (``comb`` empty for the identity map), ``(y, pre, mix,
    rstd)`` for the head (``head_op``)."""
    pre, *maps = kernels.coeffs_forward(streams, fn, base, scale, iters, eps, norm_eps, head, residual_map,
                                        post_magnitude)
    y = kernels.pre_forward(streams, pre)
    if head:
        return (y, pre, *maps)
    post, comb, mix, rstd = maps
    return y, post, comb, pre, mix, rstd


def coeffs_pre_backward(kernels: Kernels, streams, fn, base, scale, pre, mix, rstd, grad_y, map_grads, iters, eps,
                        head, residual_map, post_magnitude):
    """``(d streams, d fn, d base, d scale)`` from ``d y`` and the gradients of ``post`` / ``comb`` (sublayer)."""
    grad_pre = kernels.pre_weights_grad(streams, pre, grad_y)
    return kernels.coeffs_backward(streams, fn, base, scale, mix, rstd, (grad_pre, *map_grads), iters, eps, head,
                                   (pre, grad_y), residual_map, post_magnitude)


def fake_weights(streams: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """A float32 ``[..., n]`` (or ``[..., width]``) per-token tensor for the fake (tracing) kernels."""
    lead, n = streams.shape[:-2], streams.shape[-2]
    return streams.new_empty(*lead, n if width is None else width, dtype=torch.float32)


def define_mhc_coeffs_pre(backend: str, kernels: Kernels):
    """The custom ops ``hf_mhc::mhc_coeffs_pre_fwd_<backend>`` / ``_bwd_<backend>``; returns the forward op
    ``(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, residual_map, post_magnitude) -> (y, post, comb, pre,
    mix, rstd)``."""

    @torch.library.custom_op(f"hf_mhc::mhc_coeffs_pre_fwd_{backend}", mutates_args=())
    def mhc_coeffs_pre_fwd(
        streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
        eps: float, norm_eps: float, residual_map: str, post_magnitude: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return coeffs_pre_forward(kernels, streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, False,
                                  residual_map, post_magnitude)

    @mhc_coeffs_pre_fwd.register_fake
    def _(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, residual_map, post_magnitude):
        return (streams.new_empty(*streams.shape[:-2], streams.shape[-1]), fake_weights(streams),
                fake_comb(streams, residual_map), fake_weights(streams), fake_weights(streams, fn.shape[0]),
                streams.new_empty(streams.shape[:-2], dtype=torch.float32))

    @torch.library.custom_op(f"hf_mhc::mhc_coeffs_pre_bwd_{backend}", mutates_args=())
    def mhc_coeffs_pre_bwd(
        streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, pre: torch.Tensor,
        mix: torch.Tensor, rstd: torch.Tensor, grad_y: torch.Tensor, grad_post: torch.Tensor, grad_comb: torch.Tensor,
        sinkhorn_iters: int, eps: float, residual_map: str, post_magnitude: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return coeffs_pre_backward(kernels, streams, fn, base, scale, pre, mix, rstd, grad_y, (grad_post, grad_comb),
                                   sinkhorn_iters, eps, False, residual_map, post_magnitude)

    @mhc_coeffs_pre_bwd.register_fake
    def _(streams, fn, base, scale, pre, mix, rstd, grad_y, grad_post, grad_comb, sinkhorn_iters, eps, residual_map,
          post_magnitude):
        return torch.empty_like(streams), torch.empty_like(fn), torch.empty_like(base), torch.empty_like(scale)

    def setup_context(ctx, inputs, output):
        streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, residual_map, post_magnitude = inputs
        _, _, _, pre, mix, rstd = output
        ctx.save_for_backward(streams, fn, base, scale, pre, mix, rstd)
        ctx.mark_non_differentiable(pre, mix, rstd)
        ctx.sinkhorn_iters, ctx.eps, ctx.residual_map, ctx.post_magnitude = (sinkhorn_iters, eps, residual_map,
                                                                             post_magnitude)

    def backward_of_coeffs_pre(ctx, grad_y, grad_post, grad_comb, grad_pre, grad_mix, grad_rstd):
        streams, fn, base, scale, pre, mix, rstd = ctx.saved_tensors
        grads = mhc_coeffs_pre_bwd(
            streams, fn, base, scale, pre, mix, rstd, zeros_if_none(grad_y, streams[..., 0, :]),
            zeros_if_none(grad_post, pre), zeros_if_none(grad_comb, fake_comb(streams, ctx.residual_map)),
            ctx.sinkhorn_iters, ctx.eps, ctx.residual_map, ctx.post_magnitude,
        )
        return (*grads, None, None, None, None, None)

    mhc_coeffs_pre_fwd.register_autograd(backward_of_coeffs_pre, setup_context=setup_context)
    return mhc_coeffs_pre_fwd
