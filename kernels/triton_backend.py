"""The Triton backend: fused Triton kernels, for CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``).
Importing this module imports Triton; the dispatch table loads it on the first call that needs it."""

from __future__ import annotations

from .coeffs_triton import coeffs_backward, coeffs_forward
from .common import Kernels
from .op_set import MHCOps
from .post_res_triton import post_res_backward, post_res_forward
from .pre_triton import pre_backward, pre_forward, pre_weights_grad
from .sinkhorn_triton import sinkhorn_backward, sinkhorn_forward

TRITON_KERNELS = Kernels(
    sinkhorn_forward=sinkhorn_forward, sinkhorn_backward=sinkhorn_backward, coeffs_forward=coeffs_forward,
    coeffs_backward=coeffs_backward, pre_forward=pre_forward, pre_backward=pre_backward,
    pre_weights_grad=pre_weights_grad, post_res_forward=post_res_forward, post_res_backward=post_res_backward,
)
TRITON_OPS = MHCOps("triton", TRITON_KERNELS)
