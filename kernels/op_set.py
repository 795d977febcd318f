"""``MHCOps``: one backend's custom ops behind the signatures of ``hf_mhc.mhc_reference``'s functions of the same
names (``sinkhorn``, ``mhc_coeffs``, ``mhc_coeffs_pre``, ``mhc_pre``, ``mhc_post_res``, ``mhc_head``), so that the
dispatch table's entries, the reference module included, are called alike."""

from __future__ import annotations

import torch

from hf_mhc.mhc_reference import DEFAULT_RESIDUAL_MAP, POST_MAGNITUDE, ResidualMap

from .coeffs_op import define_mhc_coeffs
from .coeffs_pre_op import define_mhc_coeffs_pre
from .common import Kernels
from .head_op import define_mhc_head
from .post_res_op import define_mhc_post_res
from .pre_op import define_mhc_pre
from .sinkhorn_op import define_sinkhorn


class MHCOps:
    """The ops of one backend (``name``: ``"torch"`` or ``"triton"``), each a ``torch.library`` custom op (named
    ``hf_mhc::<op>_fwd_<name>``) with its own backward. The numbers are those of ``hf_mhc.mhc_reference``; every
    result is float32 (maps) or the streams' dtype (streams, ``y``), and none is a view."""

    def __init__(self, name: str, kernels: Kernels):
        self.name = name
        self.kernels = kernels
        self.sinkhorn_op = define_sinkhorn(name, kernels)
        self.coeffs_op = define_mhc_coeffs(name, kernels)
        self.coeffs_pre_op = define_mhc_coeffs_pre(name, kernels)
        self.pre_op = define_mhc_pre(name, kernels)
        self.post_res_op = define_mhc_post_res(name, kernels)
        self.head_op = define_mhc_head(name, kernels)

    def __repr__(self) -> str:
        return f"MHCOps({self.name!r})"

    def sinkhorn(self, logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        """``logits [..., n, n]`` -> float32 ``comb [..., n, n]``."""
        return self.sinkhorn_op(logits, iters, eps)

    def mhc_coeffs(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                   sinkhorn_iters: int, eps: float, norm_eps: float, residual_map: ResidualMap = DEFAULT_RESIDUAL_MAP,
                   post_magnitude: float = POST_MAGNITUDE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [..., n, C]`` -> ``pre``, ``post`` ``[..., n]``, ``comb [..., n, n]`` (the comb applied: an
        expanded identity for ``residual_map="identity"``)."""
        pre, post, comb, _, _ = self.coeffs_op(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps, residual_map,
                                               float(post_magnitude))
        if residual_map == "identity":
            n = streams.shape[-2]
            comb = torch.eye(n, device=streams.device).expand(*streams.shape[:-2], n, n)
        return pre, post, comb

    def mhc_coeffs_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, *,
                       sinkhorn_iters: int, eps: float, norm_eps: float,
                       residual_map: ResidualMap = DEFAULT_RESIDUAL_MAP, post_magnitude: float = POST_MAGNITUDE,
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``streams [..., n, C]`` -> ``y [..., C]`` (streams' dtype), ``post [..., n]``, ``comb [..., n, n]``
        (``None`` for the identity map)."""
        y, post, comb, _, _, _ = self.coeffs_pre_op(streams, fn, base, scale, sinkhorn_iters, eps, norm_eps,
                                                    residual_map, float(post_magnitude))
        return y, post, None if residual_map == "identity" else comb

    def mhc_pre(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """``streams [..., n, C]``, ``pre [..., n]`` -> ``y [..., C]`` (streams' dtype)."""
        return self.pre_op(streams, pre)

    def mhc_post_res(self, streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor,
                     comb: torch.Tensor | None) -> torch.Tensor:
        """``X'[i] = post[i] · y + sum_j comb[j, i] · X[j]`` (``comb=None``: ``+ X[i]``), ``[..., n, C]``."""
        if comb is None:
            return self.post_res_op(streams, y, post, post.new_empty(0, dtype=torch.float32), True)
        return self.post_res_op(streams, y, post, comb, False)

    def mhc_head(self, streams: torch.Tensor, hc_fn: torch.Tensor, hc_base: torch.Tensor, hc_scale: torch.Tensor, *,
                 eps: float, norm_eps: float) -> torch.Tensor:
        """``streams [..., n, C]`` -> ``y [..., C]`` (streams' dtype)."""
        return self.head_op(streams, hc_fn, hc_base, hc_scale, eps, norm_eps)[0]
