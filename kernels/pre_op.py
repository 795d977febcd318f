"""``mhc_pre``: collapse ``[..., n, C]`` streams with weights ``pre [..., n]`` into the sublayer input ``[..., C]``, as
a ``torch.library`` custom op with its own backward. Saved for backward: the streams (shared with the other ops of
the site) and ``pre``. Reference: ``hf_mhc.mhc_reference.mhc_pre``."""

from __future__ import annotations

import torch

from .common import Kernels


def define_mhc_pre(backend: str, kernels: Kernels):
    """The custom ops ``hf_mhc::mhc_pre_fwd_<backend>`` / ``_bwd_<backend>`` over ``kernels.pre_forward`` /
    ``pre_backward``; returns the forward op ``(streams, pre) -> y``."""

    @torch.library.custom_op(f"hf_mhc::mhc_pre_fwd_{backend}", mutates_args=())
    def mhc_pre_fwd(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        return kernels.pre_forward(streams, pre)

    @mhc_pre_fwd.register_fake
    def _(streams, pre):
        return streams.new_empty(*streams.shape[:-2], streams.shape[-1])

    @torch.library.custom_op(f"hf_mhc::mhc_pre_bwd_{backend}", mutates_args=())
    def mhc_pre_bwd(streams: torch.Tensor, pre: torch.Tensor, grad_out: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.pre_backward(streams, pre, grad_out)

    @mhc_pre_bwd.register_fake
    def _(streams, pre, grad_out):
        return torch.empty_like(streams), torch.empty_like(pre, dtype=torch.float32)

    def setup_context(ctx, inputs, output):
        streams, pre = inputs
        ctx.save_for_backward(streams, pre)

    def backward_of_pre(ctx, grad_out):
        streams, pre = ctx.saved_tensors
        grad_streams, grad_pre = mhc_pre_bwd(streams, pre, grad_out.contiguous())
        return grad_streams, grad_pre.to(pre.dtype)

    mhc_pre_fwd.register_autograd(backward_of_pre, setup_context=setup_context)
    return mhc_pre_fwd
