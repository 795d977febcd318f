"""Our ops against transformers' own hyper-connection modules with the same random parameters: DeepSeek-V4's (mHC,
also GLM-5-Next's) and HY-V4's (the identity map).

Each output is held to two scale-aware bounds that hold on any CPU and thread count, with the formula of
``hf_mhc.mhc_reference`` in float64 on the same parameters as the truth: it agrees with upstream's float32 output
within ``AGREEMENT_ULPS`` float32 ulps of the output's scale (a transposed ``comb`` or a missing term is off by a
sizeable fraction of it), and it is at least as accurate as upstream's own float32 rounding (twice its error, plus
``ACCURACY_SLACK_ULPS``), so a reordering that loses accuracy fails even when it stays close to upstream. Agreement with
upstream is also what checks the reference formula itself.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import HYV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperConnection,
    DeepseekV4HyperHead,
)
from transformers.models.hy_v4.modeling_hy_v4 import HYV4HyperConnection

from hf_mhc import mhc_reference
from hf_mhc.compat import unweighted_norm_eps
from hf_mhc.kernels import mhc_coeffs, mhc_coeffs_pre, mhc_head, mhc_post_res, mhc_pre

HIDDEN = 24
AGREEMENT_ULPS = 8  # ours vs upstream, in float32 ulps of the output's largest float64 value
ACCURACY_SLACK_ULPS = 2  # how much less accurate than upstream's float32 rounding ours may be, beyond twice its error
FLOAT64 = dict(compute_dtype=torch.float64)


def assert_conforms(ours: torch.Tensor, theirs: torch.Tensor, truth: torch.Tensor) -> None:
    """``ours`` and ``theirs`` (upstream, float32) against ``truth`` (the float64 formula)."""
    ulp = torch.finfo(torch.float32).eps * truth.abs().max().item()
    ours, theirs = ours.double(), theirs.double()
    agreement = (ours - theirs).abs().max().item()
    assert agreement <= AGREEMENT_ULPS * ulp, f"differs from upstream by {agreement / ulp:.1f} ulps of the scale"
    our_error, their_error = (ours - truth).abs().max().item(), (theirs - truth).abs().max().item()
    assert our_error <= 2 * their_error + ACCURACY_SLACK_ULPS * ulp, (
        f"{our_error / ulp:.1f} ulps from float64, upstream {their_error / ulp:.1f}"
    )


def dsv4_config(n):
    return SimpleNamespace(hc_mult=n, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, hidden_size=HIDDEN)


def randomize_(fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor) -> None:
    """Upstream's parameters away from their start (``scale = 1``, ``base = 0``): every map token-dependent, uneven."""
    with torch.no_grad():
        fn.normal_(0, 0.3)
        base.normal_(0, 1)
        scale.uniform_(0.5, 1.5)


def random_hyper_connection(n):
    hc = DeepseekV4HyperConnection(dsv4_config(n))
    randomize_(hc.fn, hc.base, hc.scale)
    return hc


def our_coeffs(hc, streams):
    return mhc_coeffs(streams, hc.fn, hc.base, hc.scale, sinkhorn_iters=hc.hc_sinkhorn_iters, eps=hc.hc_eps,
                      norm_eps=unweighted_norm_eps(hc.input_norm))


def coeffs64(hc, x64):
    """``pre, post, comb`` of ``hc`` from the float64 formula."""
    return mhc_reference.mhc_coeffs(x64, hc.fn.double(), hc.base.double(), hc.scale.double(),
                                    sinkhorn_iters=hc.hc_sinkhorn_iters, eps=hc.hc_eps,
                                    norm_eps=unweighted_norm_eps(hc.input_norm), **FLOAT64)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_hyper_connection_matches_deepseek_v4(n):
    hc = random_hyper_connection(n)
    streams = torch.randn(2, 5, n, HIDDEN)
    post_ref, comb_ref, collapsed_ref = hc(streams)
    pre64, post64, comb64 = coeffs64(hc, streams.double())
    pre, post, comb = our_coeffs(hc, streams)
    assert_conforms(post, post_ref, post64)
    assert_conforms(comb, comb_ref, comb64)
    assert_conforms(mhc_pre(streams, pre), collapsed_ref, mhc_reference.mhc_pre(streams.double(), pre64, **FLOAT64))

    # DeepSeek-V4 consumes `pre` inside its forward; recover its value from float64 streams, for which the collapse
    # `sum_i pre_i X_i` of its float32 `pre` is exact up to float64 rounding (X [n, C] has full row rank).
    _, _, collapsed_of_x64 = hc(streams.double())
    x64 = streams.double().transpose(-1, -2)
    pre_ref = torch.linalg.lstsq(x64, collapsed_of_x64.unsqueeze(-1)).solution.squeeze(-1)
    assert_conforms(pre, pre_ref, pre64)


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
        x64 = site_in.double()
        pre64, post64, comb64 = coeffs64(hc, x64)
        sublayer64 = copy.deepcopy(sublayer).double()
        sublayer_output64 = sublayer64(mhc_reference.mhc_pre(x64, pre64, **FLOAT64))
        assert_conforms(merged, site_out, mhc_reference.mhc_post_res(x64, sublayer_output64, post64, comb64, **FLOAT64))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_head_matches_deepseek_v4(n):
    head = DeepseekV4HyperHead(dsv4_config(n))
    randomize_(head.hc_fn, head.hc_base, head.hc_scale)
    streams = torch.randn(2, 5, n, HIDDEN)
    norm_eps = unweighted_norm_eps(head.input_norm)
    out = mhc_head(streams, head.hc_fn, head.hc_base, head.hc_scale, eps=head.eps, norm_eps=norm_eps)
    truth = mhc_reference.mhc_head(streams.double(), head.hc_fn.double(), head.hc_base.double(),
                                   head.hc_scale.double(), eps=head.eps, norm_eps=norm_eps, **FLOAT64)
    assert_conforms(out, head(streams), truth)


@pytest.mark.parametrize("n", [1, 3, 4])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_identity_map_matches_hy_v4(backend, n):
    """transformers' ``HYV4HyperConnection`` (its ``hc_magnitude`` is our ``post_magnitude``) and its decoder layer's
    merge ``X[i] + post[i] * y``: ``mhc_coeffs_pre`` with ``residual_map="identity"``, ``mhc_post_res(comb=None)``."""
    magnitude = 2.5  # not 2, so that a hard-coded 2 fails
    config = HYV4Config(hidden_size=HIDDEN, hc_mult=n, hc_magnitude=magnitude, hc_eps=1e-6, rms_norm_eps=1e-6)
    upstream = HYV4HyperConnection(config)
    randomize_(upstream.fn, upstream.base, upstream.scale)
    streams, sublayer_output = torch.randn(2, 5, n, HIDDEN), torch.randn(2, 5, HIDDEN)
    post_ref, collapsed_ref = upstream(streams)
    merged_ref = post_ref.unsqueeze(-1) * sublayer_output.unsqueeze(-2) + streams
    settings = dict(sinkhorn_iters=1, eps=upstream.hc_eps, norm_eps=unweighted_norm_eps(upstream.input_norm),
                    residual_map="identity", post_magnitude=magnitude)
    params = (upstream.fn, upstream.base, upstream.scale)
    collapsed, post, comb = mhc_coeffs_pre(streams, *params, backend=backend, **settings)
    assert comb is None
    x64 = streams.double()
    collapsed64, post64, _ = mhc_reference.mhc_coeffs_pre(x64, *(p.double() for p in params), **settings, **FLOAT64)
    assert_conforms(post, post_ref, post64)
    assert_conforms(collapsed, collapsed_ref, collapsed64)
    assert_conforms(mhc_post_res(streams, sublayer_output, post, None, backend=backend), merged_ref,
                    mhc_reference.mhc_post_res(x64, sublayer_output.double(), post64, None, **FLOAT64))
