"""The torch backend: memory-light torch kernels with custom forward and backward, which save only the streams, the
sublayer output and per-token coefficients, and recompute Sinkhorn's iterates in backward. Any device; no Triton."""

from __future__ import annotations

from .coeffs_torch import coeffs_backward, coeffs_forward
from .common import Kernels
from .op_set import MHCOps
from .post_res_torch import post_res_backward, post_res_forward
from .pre_torch import pre_backward, pre_forward, pre_weights_grad
from .sinkhorn_torch import sinkhorn_backward, sinkhorn_forward

TORCH_KERNELS = Kernels(
    sinkhorn_forward=sinkhorn_forward, sinkhorn_backward=sinkhorn_backward, coeffs_forward=coeffs_forward,
    coeffs_backward=coeffs_backward, pre_forward=pre_forward, pre_backward=pre_backward,
    pre_weights_grad=pre_weights_grad, post_res_forward=post_res_forward, post_res_backward=post_res_backward,
)
TORCH_OPS = MHCOps("torch", TORCH_KERNELS)
