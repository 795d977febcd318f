"""``mhc_head``: the final readout ``streams [..., n, C] -> y = sum_i pre_h[i] · X[i]`` as one ``torch.library``
custom op, the head's weights (``pre_h = sigmoid(mix · scale + base) + eps``) and the collapse together, backward in
one node like ``mhc_coeffs_pre``. Saved for backward: the streams and, per token, ``pre_h``, ``mix`` and ``rstd``.
Reference: ``hf_mhc.mhc_reference.mhc_head``."""

from __future__ import annotations

import torch

from hf_mhc.mhc_reference import DEFAULT_RESIDUAL_MAP, POST_MAGNITUDE

from .coeffs_pre_op import coeffs_pre_backward, coeffs_pre_forward, fake_weights
from .common import Kernels, zeros_if_none


def define_mhc_head(backend: str, kernels: Kernels):
    """The custom ops ``hf_mhc::mhc_head_fwd_<backend>`` / ``_bwd_<backend>``; returns the forward op ``(streams,
    hc_fn, hc_base, hc_scale, eps, norm_eps) -> (y, pre_h, mix, rstd)``."""

    @torch.library.custom_op(f"hf_mhc::mhc_head_fwd_{backend}", mutates_args=())
    def mhc_head_fwd(
        streams: torch.Tensor, hc_fn: torch.Tensor, hc_base: torch.Tensor, hc_scale: torch.Tensor, eps: float,
        norm_eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return coeffs_pre_forward(kernels, streams, hc_fn, hc_base, hc_scale, 1, eps, norm_eps, True,
                                  DEFAULT_RESIDUAL_MAP, POST_MAGNITUDE)  # the head has one map: the settings are unused

    @mhc_head_fwd.register_fake
    def _(streams, hc_fn, hc_base, hc_scale, eps, norm_eps):
        return (streams.new_empty(*streams.shape[:-2], streams.shape[-1]), fake_weights(streams),
                fake_weights(streams), streams.new_empty(streams.shape[:-2], dtype=torch.float32))

    @torch.library.custom_op(f"hf_mhc::mhc_head_bwd_{backend}", mutates_args=())
    def mhc_head_bwd(
        streams: torch.Tensor, hc_fn: torch.Tensor, hc_base: torch.Tensor, hc_scale: torch.Tensor, pre: torch.Tensor,
        mix: torch.Tensor, rstd: torch.Tensor, grad_y: torch.Tensor, eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return coeffs_pre_backward(kernels, streams, hc_fn, hc_base, hc_scale, pre, mix, rstd, grad_y, (), 1, eps,
                                   True, DEFAULT_RESIDUAL_MAP, POST_MAGNITUDE)

    @mhc_head_bwd.register_fake
    def _(streams, hc_fn, hc_base, hc_scale, pre, mix, rstd, grad_y, eps):
        return (torch.empty_like(streams), torch.empty_like(hc_fn), torch.empty_like(hc_base),
                torch.empty_like(hc_scale))

    def setup_context(ctx, inputs, output):
        streams, hc_fn, hc_base, hc_scale, eps, norm_eps = inputs
        _, pre, mix, rstd = output
        ctx.save_for_backward(streams, hc_fn, hc_base, hc_scale, pre, mix, rstd)
        ctx.mark_non_differentiable(pre, mix, rstd)
        ctx.eps = eps

    def backward_of_head(ctx, grad_y, grad_pre, grad_mix, grad_rstd):
        streams, hc_fn, hc_base, hc_scale, pre, mix, rstd = ctx.saved_tensors
        grads = mhc_head_bwd(streams, hc_fn, hc_base, hc_scale, pre, mix, rstd,
                             zeros_if_none(grad_y, streams[..., 0, :]), ctx.eps)
        return (*grads, None, None)

    mhc_head_fwd.register_autograd(backward_of_head, setup_context=setup_context)
    return mhc_head_fwd
