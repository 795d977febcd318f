"""Our ops against transformers' own DeepSeek-V4 mHC modules, with the same random parameters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
)

from hf_mhc.kernels import mhc_coeffs, mhc_head, mhc_post_res, mhc_pre

HIDDEN = 24
TOL = dict(atol=1e-6, rtol=1e-6)


def dsv4_config(n):
    return SimpleNamespace(hc_mult=n, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, hidden_size=HIDDEN)


def random_hyper_connection(n):
    hc = DeepseekV4HyperConnection(dsv4_config(n))
    with torch.no_grad():
        hc.fn.normal_(0, 0.3)
        hc.base.normal_(0, 1)
        hc.scale.uniform_(0.5, 1.5)
    return hc


def our_coeffs(hc, streams):
    return mhc_coeffs(streams, hc.fn, hc.base, hc.scale, sinkhorn_iters=hc.hc_sinkhorn_iters, eps=hc.hc_eps,
                      norm_eps=hc.input_norm.eps)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_hyper_connection_matches_deepseek_v4(n):
    hc = random_hyper_connection(n)
    streams = torch.randn(2, 5, n, HIDDEN)
    post_ref, comb_ref, collapsed_ref = hc(streams)
    pre, post, comb = our_coeffs(hc, streams)
    torch.testing.assert_close(post, post_ref, **TOL)
    torch.testing.assert_close(comb, comb_ref, **TOL)
    torch.testing.assert_close(mhc_pre(streams, pre), collapsed_ref, **TOL)

    # DeepSeek-V4 consumes `pre` inside its forward; recover it exactly from float64 streams, for which its collapse
    # `sum_i pre_i X_i` is computed in float64 from the float32 `pre` (X [n, C] has full row rank).
    _, _, collapsed64 = hc(streams.double())
    pre_ref = torch.linalg.lstsq(streams.double().transpose(-1, -2), collapsed64.unsqueeze(-1)).solution.squeeze(-1)
    torch.testing.assert_close(pre.double(), pre_ref, **TOL)


class _LinearSublayer(nn.Module):
    """Stands in for attention / MoE: a fixed linear map, returning what DeepSeek-V4's layer unpacks."""

    def __init__(self, returns_tuple):
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.returns_tuple = returns_tuple

    def forward(self, hidden_states, **kwargs):
        out = self.proj(hidden_states)
        return (out, None) if self.returns_tuple else out


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_decoder_layer_merge_matches_deepseek_v4(n):
    layer = DeepseekV4DecoderLayer.__new__(DeepseekV4DecoderLayer)
    nn.Module.__init__(layer)
    layer.attn_hc, layer.ffn_hc = random_hyper_connection(n), random_hyper_connection(n)
    layer.self_attn, layer.mlp = _LinearSublayer(True), _LinearSublayer(False)
    layer.input_layernorm = layer.post_attention_layernorm = nn.Identity()
    streams = torch.randn(2, 5, n, HIDDEN)
    site_inputs = []
    layer.ffn_hc.register_forward_pre_hook(lambda module, args: site_inputs.append(args[0]))
    expected_output = layer(streams)

    # Each site compared from identical inputs: the streams entering it in DeepSeek-V4's own layer.
    for site_in, site_out, hc, sublayer in (
        (streams, site_inputs[0], layer.attn_hc, layer.self_attn.proj),
        (site_inputs[0], expected_output, layer.ffn_hc, layer.mlp.proj),
    ):
        pre, post, comb = our_coeffs(hc, site_in)
        merged = mhc_post_res(site_in, sublayer(mhc_pre(site_in, pre)), post, comb)
        torch.testing.assert_close(merged, site_out, atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_head_matches_deepseek_v4(n):
    head = DeepseekV4HyperHead(dsv4_config(n))
    with torch.no_grad():
        head.hc_fn.normal_(0, 0.3)
        head.hc_base.normal_(0, 1)
        head.hc_scale.uniform_(0.5, 1.5)
    streams = torch.randn(2, 5, n, HIDDEN)
    out = mhc_head(streams, head.hc_fn, head.hc_base, head.hc_scale, eps=head.eps, norm_eps=head.input_norm.eps)
    torch.testing.assert_close(out, head(streams), **TOL)
