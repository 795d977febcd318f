"""``mhc_post_res``: ``X'[i] = post[i] · y + sum_j comb[j, i] · X[j]``, the sublayer output merged into the streams,
as a ``torch.library`` custom op with its own backward. With ``identity`` (the identity residual map, ``comb``
empty) the streams are carried as they are, ``X'[i] = post[i] · y + X[i]``. Saved for backward: the streams, ``y``,
``post`` and ``comb``. Reference: ``hf_mhc.mhc_reference.mhc_post_res``."""

from __future__ import annotations

import torch

from .common import Kernels


def define_mhc_post_res(backend: str, kernels: Kernels):
    """The custom ops ``hf_mhc::mhc_post_res_fwd_<backend>`` / ``_bwd_<backend>`` over ``kernels.post_res_forward``
    / ``post_res_backward``; returns the forward op ``(streams, y, post, comb, identity) -> new streams``."""

    @torch.library.custom_op(f"hf_mhc::mhc_post_res_fwd_{backend}", mutates_args=())
    def mhc_post_res_fwd(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                         identity: bool) -> torch.Tensor:
        return kernels.post_res_forward(streams, y, post, comb, identity)

    @mhc_post_res_fwd.register_fake
    def _(streams, y, post, comb, identity):
        return torch.empty_like(streams)

    @torch.library.custom_op(f"hf_mhc::mhc_post_res_bwd_{backend}", mutates_args=())
    def mhc_post_res_bwd(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                         grad_out: torch.Tensor, identity: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return kernels.post_res_backward(streams, y, post, comb, grad_out, identity)

    @mhc_post_res_bwd.register_fake
    def _(streams, y, post, comb, grad_out, identity):
        f32 = torch.float32
        return (torch.empty_like(streams), torch.empty_like(y), torch.empty_like(post, dtype=f32),
                torch.empty_like(comb, dtype=f32))

    def setup_context(ctx, inputs, output):
        streams, y, post, comb, identity = inputs
        ctx.save_for_backward(streams, y, post, comb)
        ctx.identity = identity

    def backward_of_post_res(ctx, grad_out):
        streams, y, post, comb = ctx.saved_tensors
        grad_streams, grad_y, grad_post, grad_comb = mhc_post_res_bwd(streams, y, post, comb, grad_out.contiguous(),
                                                                      ctx.identity)
        return grad_streams, grad_y, grad_post.to(post.dtype), grad_comb.to(comb.dtype), None

    mhc_post_res_fwd.register_autograd(backward_of_post_res, setup_context=setup_context)
    return mhc_post_res_fwd
