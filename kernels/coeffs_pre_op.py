"""``mhc_coeffs_pre``: a site's coefficients and its ``pre`` collapse as one op, ``streams -> (y, post, comb)``
(what DeepSeek-V4's ``HyperConnection`` returns), and the head readout ``streams -> y`` the same way.

Forward: the fused coefficient kernel (``coeffs_op``), then the collapse kernel (``pre_op``). Backward is one node:
``d pre[i] = <d y, X[i]>`` (a reduction over C, no stream-sized output), the maps' backward as in ``coeffs_op``, then
``d X = d raw @ fn + correction · X + pre[i] · d y`` in a single pass that writes ``d X`` once. As two ops,
``mhc_coeffs`` and ``mhc_pre`` each write a stream-sized ``d X`` and autograd adds them: one more ``n·C`` written, read
twice and (on CPU) freshly allocated per token and site. Saved for backward: the streams and, per token, ``pre``,
``mix`` and ``rstd``. Reference: ``hf_mhc.mhc_reference.mhc_coeffs_pre`` / ``mhc_head``.
"""

from __future__ import annotations

import torch

from hf_mhc.mhc_reference import DEFAULT_RESIDUAL_MAP, POST_MAGNITUDE

from .coeffs_op import coeffs_backward, coeffs_forward, fake_comb
from .common import zeros_if_none
from .pre_op import pre_forward, pre_weights_grad


def coeffs_pre_forward(streams, fn, base, scale, iters, eps, norm_eps, backend, head, residual_map=DEFAULT_RESIDUAL_MAP,
                       post_magnitude=POST_MAGNITUDE):
    """``(y, post, comb, pre, mix, rstd)`` for a sublayer (``comb`` empty for the identity map), ``(y, pre, mix,
    rstd)`` for the head."""
    pre, *maps = coeffs_forward(streams, fn, base, scale, iters, eps, norm_eps, backend, head, residual_map,
                                post_magnitude)
    y = pre_forward(streams, pre, backend)
    if head:
        return (y, pre, *maps)
    post, comb, mix, rstd = maps
    return y, post, comb, pre, mix, rstd


def coeffs_pre_backward(streams, fn, base, scale, pre, mix, rstd, grad_y, map_grads, iters, eps, backend, head,
                        residual_map=DEFAULT_RESIDUAL_MAP, post_magnitude=POST_MAGNITUDE):
    """``(d streams, d fn, d base, d scale)`` from ``d y`` and the gradients of ``post`` / ``comb`` (sublayer)."""
    grad_pre = pre_weights_grad(streams, pre, grad_y, backend)
    return coeffs_backward(streams, fn, base, scale, mix, rstd, (grad_pre, *map_grads), iters, eps, backend, head,
                           collapse=(pre, grad_y), residual_map=residual_map, post_magnitude=post_magnitude)


def _fake_weights(streams, width=None):
    lead, n = streams.shape[:-2], streams.shape[-2]
    return streams.new_empty(*lead, n if width is None else width, dtype=torch.float32)


# --- sublayer site ------------------------------------------------------------------------------------------------


@torch.library.custom_op("hf_mhc::mhc_coeffs_pre_fwd", mutates_args=())
def mhc_coeffs_pre_fwd_op(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
    eps: float, norm_eps: float, backend: str, residual_map: str, post_magnitude: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return coeffs_pre_forward(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, backend, False, residual_map,
                              post_magnitude)


@mhc_coeffs_pre_fwd_op.register_fake
def _(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, backend, residual_map, post_magnitude):
    return (streams.new_empty(*streams.shape[:-2], streams.shape[-1]), _fake_weights(streams),
            fake_comb(streams, residual_map), _fake_weights(streams),
            _fake_weights(streams, fn.shape[0]), streams.new_empty(streams.shape[:-2], dtype=torch.float32))


@torch.library.custom_op("hf_mhc::mhc_coeffs_pre_bwd", mutates_args=())
def mhc_coeffs_pre_bwd_op(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, pre: torch.Tensor,
    mix: torch.Tensor, rstd: torch.Tensor, grad_y: torch.Tensor, grad_post: torch.Tensor, grad_comb: torch.Tensor,
    sinkhorn_iters: int, eps: float, backend: str, residual_map: str, post_magnitude: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return coeffs_pre_backward(streams, fn, base, scale, pre, mix, rstd, grad_y, (grad_post, grad_comb),
                               sinkhorn_iters, eps, backend, head=False, residual_map=residual_map,
                               post_magnitude=post_magnitude)


@mhc_coeffs_pre_bwd_op.register_fake
def _(streams, fn, base, scale, pre, mix, rstd, grad_y, grad_post, grad_comb, sinkhorn_iters, eps, backend,
      residual_map, post_magnitude):
    return torch.empty_like(streams), torch.empty_like(fn), torch.empty_like(base), torch.empty_like(scale)


def _coeffs_pre_setup_context(ctx, inputs, output):
    streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, backend, residual_map, post_magnitude = inputs
    _, _, _, pre, mix, rstd = output
    ctx.save_for_backward(streams, fn, base, scale, pre, mix, rstd)
    ctx.mark_non_differentiable(pre, mix, rstd)
    ctx.sinkhorn_iters, ctx.eps, ctx.backend = sinkhorn_iters, eps, backend
    ctx.residual_map, ctx.post_magnitude = residual_map, post_magnitude


def _coeffs_pre_backward(ctx, grad_y, grad_post, grad_comb, grad_pre, grad_mix, grad_rstd):
    streams, fn, base, scale, pre, mix, rstd = ctx.saved_tensors
    grads = mhc_coeffs_pre_bwd_op(
        streams, fn, base, scale, pre, mix, rstd, zeros_if_none(grad_y, streams[..., 0, :]),
        zeros_if_none(grad_post, pre), zeros_if_none(grad_comb, fake_comb(streams, ctx.residual_map)),
        ctx.sinkhorn_iters, ctx.eps, ctx.backend, ctx.residual_map, ctx.post_magnitude,
    )
    return (*grads, None, None, None, None, None, None)


mhc_coeffs_pre_fwd_op.register_autograd(_coeffs_pre_backward, setup_context=_coeffs_pre_setup_context)


# --- head -------------------------------------------------------------------------------------------------------


@torch.library.custom_op("hf_mhc::mhc_head_fwd", mutates_args=())
def mhc_head_fwd_op(
    streams: torch.Tensor, hc_fn: torch.Tensor, hc_base: torch.Tensor, hc_scale: torch.Tensor, eps: float,
    norm_eps: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return coeffs_pre_forward(streams, hc_fn, hc_base, hc_scale, 1, eps, norm_eps, backend, head=True)


@mhc_head_fwd_op.register_fake
def _(streams, hc_fn, hc_base, hc_scale, eps, norm_eps, backend):
    return (streams.new_empty(*streams.shape[:-2], streams.shape[-1]), _fake_weights(streams),
            _fake_weights(streams), streams.new_empty(streams.shape[:-2], dtype=torch.float32))


@torch.library.custom_op("hf_mhc::mhc_head_bwd", mutates_args=())
def mhc_head_bwd_op(
    streams: torch.Tensor, hc_fn: torch.Tensor, hc_base: torch.Tensor, hc_scale: torch.Tensor, pre: torch.Tensor,
    mix: torch.Tensor, rstd: torch.Tensor, grad_y: torch.Tensor, eps: float, backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return coeffs_pre_backward(streams, hc_fn, hc_base, hc_scale, pre, mix, rstd, grad_y, (), 1, eps, backend,
                               head=True)


@mhc_head_bwd_op.register_fake
def _(streams, hc_fn, hc_base, hc_scale, pre, mix, rstd, grad_y, eps, backend):
    return (torch.empty_like(streams), torch.empty_like(hc_fn), torch.empty_like(hc_base),
            torch.empty_like(hc_scale))


def _head_setup_context(ctx, inputs, output):
    streams, hc_fn, hc_base, hc_scale, eps, norm_eps, backend = inputs
    _, pre, mix, rstd = output
    ctx.save_for_backward(streams, hc_fn, hc_base, hc_scale, pre, mix, rstd)
    ctx.mark_non_differentiable(pre, mix, rstd)
    ctx.eps, ctx.backend = eps, backend


def _head_backward(ctx, grad_y, grad_pre, grad_mix, grad_rstd):
    streams, hc_fn, hc_base, hc_scale, pre, mix, rstd = ctx.saved_tensors
    grads = mhc_head_bwd_op(streams, hc_fn, hc_base, hc_scale, pre, mix, rstd,
                            zeros_if_none(grad_y, streams[..., 0, :]), ctx.eps, ctx.backend)
    return (*grads, None, None, None)


mhc_head_fwd_op.register_autograd(_head_backward, setup_context=_head_setup_context)
