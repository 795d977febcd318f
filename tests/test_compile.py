"""The ops are well-formed ``torch.library`` custom ops, and an mHC model compiles with ``fullgraph=True``."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, tiny_backbone_config

from hf_mhc import MHCConfig, MHCForCausalLM
from hf_mhc.kernels.coeffs_op import mhc_coeffs_fwd_op
from hf_mhc.kernels.coeffs_pre_op import mhc_coeffs_pre_fwd_op, mhc_head_fwd_op
from hf_mhc.kernels.post_res_op import mhc_post_res_fwd_op
from hf_mhc.kernels.pre_op import mhc_pre_fwd_op
from hf_mhc.kernels.sinkhorn_op import sinkhorn_fwd_op


def _op_cases(n=3, hidden=8):
    streams = torch.randn(2, 3, n, hidden, requires_grad=True)
    weights = torch.rand(2, 3, n, requires_grad=True)
    site_params = (torch.randn((n + 2) * n, n * hidden, requires_grad=True),
                   torch.randn((n + 2) * n, requires_grad=True), torch.rand(3, requires_grad=True))
    return [
        (sinkhorn_fwd_op, (torch.randn(2, 3, n, n, requires_grad=True), 5, 1e-6, "torch")),
        (mhc_coeffs_fwd_op, (streams, *site_params, 5, 1e-6, 1e-6, "torch", "sinkhorn", 2.0)),
        (mhc_coeffs_pre_fwd_op, (streams, *site_params, 5, 1e-6, 1e-6, "torch", "sinkhorn", 2.0)),
        (mhc_head_fwd_op, (streams, torch.randn(n, n * hidden, requires_grad=True), torch.randn(n, requires_grad=True),
                           torch.rand(1, requires_grad=True), 1e-6, 1e-6, "torch")),
        (mhc_pre_fwd_op, (streams, weights, "torch")),
        (mhc_post_res_fwd_op, (streams, torch.randn(2, 3, hidden, requires_grad=True), weights,
                               torch.rand(2, 3, n, n, requires_grad=True), "torch", False)),
    ]


@pytest.mark.parametrize("index", range(6), ids=["sinkhorn", "coeffs", "coeffs_pre", "head", "pre", "post_res"])
def test_custom_op_registration(index):
    op, args = _op_cases()[index]
    torch.library.opcheck(op, args)


def test_model_forward_and_backward_compile_with_fullgraph():
    config = MHCConfig(backbone_config=tiny_backbone_config("qwen3"), hc_mult=4, hc_init="deepseek_v4")
    model = MHCForCausalLM(config)
    ids = torch.randint(0, VOCAB, (2, 9))
    eager = model(ids, labels=ids, use_cache=False)
    eager.loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    # aot_eager traces forward and backward through every custom op without a graph break; inductor code generation
    # works too but costs minutes on a 2-core CI machine.
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(ids, labels=ids, use_cache=False)
    out.loss.backward()
    torch.testing.assert_close(out.logits, eager.logits, atol=1e-6, rtol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, eager_grads[name], atol=1e-6, rtol=1e-5, msg=name)
