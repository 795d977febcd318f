"""``hf_mhc.monkey_patch`` (``apply_mhc_kernels``) on transformers' own mHC models: the same logits and gradients as
upstream. On a GPU machine ``HF_MHC_TEST_DEVICE=cuda`` runs them on CUDA with the compiled Triton kernels."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)
from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection, Glm5NextTextModel
from transformers.models.hy_v4_vl.modeling_hy_v4_vl import HYV4VLTextModel

import hf_mhc.monkey_patch as monkey_patch
from hf_mhc import apply_mhc_kernels

pytestmark = pytest.mark.usefixtures("on_test_device")  # CUDA tensors under HF_MHC_TEST_DEVICE=cuda

# The patched model against upstream, both in float32 (the same math in another order), per entry: outputs within
# 1e-5 + 1e-5·|upstream|, gradients within 1e-5 + 1e-4·|upstream| (sums over every token, which cancel).
OUTPUT_TOLERANCE = dict(atol=1e-5, rtol=1e-5)
GRADIENT_TOLERANCE = dict(atol=1e-5, rtol=1e-4)


def tiny_deepseek_v4():
    config = DeepseekV4Config(
        vocab_size=67, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=4,
        n_shared_experts=1, layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"], o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16,
        index_topk=4, sliding_window=8, num_nextn_predict_layers=0, qk_rope_head_dim=8, max_position_embeddings=64,
    )
    model = DeepseekV4ForCausalLM(config)
    with torch.no_grad():  # DeepSeek-V4 starts with scale = 1, base = 0: make every map token-dependent and uneven
        for name, param in model.named_parameters():
            if "hc" in name and ("base" in name or "scale" in name):
                param.normal_(0.5, 0.5)
    return model


def loss_and_grads(model, ids):
    model.zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend", [None, "triton"])
def test_deepseek_v4_logits_and_gradients_are_unchanged(backend):
    upstream = tiny_deepseek_v4().train()
    patched = apply_mhc_kernels(copy.deepcopy(upstream), backend=backend)
    ids = torch.randint(0, 67, (2, 12))
    logits_ref, grads_ref = loss_and_grads(upstream, ids)
    logits, grads = loss_and_grads(patched, ids)
    torch.testing.assert_close(logits, logits_ref, **OUTPUT_TOLERANCE)
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], msg=name, **GRADIENT_TOLERANCE)


def tiny_glm5_next():
    """Both attention kinds (linear, indexed) and both MLP kinds (dense, MoE), with uneven token-dependent maps."""
    config = Glm5NextTextConfig(
        vocab_size=67, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=0, v_head_dim=16, qk_nope_head_dim=16, index_topk=16, index_kpool=4,
        index_head_dim=16, index_n_heads=2, linear_head_dim=16, linear_num_heads=2, max_position_embeddings=64,
        pad_token_id=0, layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
    )
    model = Glm5NextTextModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "_hc." in name:
                param.normal_(0.5, 0.5) if name.endswith(("base", "scale")) else param.normal_(0, 0.05)
    return model


@pytest.mark.parametrize("backend", [None, "triton"])
def test_glm5_next_hidden_states_and_gradients_are_unchanged(backend):
    upstream = tiny_glm5_next().train()
    patched = apply_mhc_kernels(copy.deepcopy(upstream), backend=backend)
    assert sum("forward" in vars(m) for m in patched.modules()) == 6  # 4 hyper-connections, 2 decoder layers
    ids = torch.randint(1, 67, (2, 12))
    upstream_grad = torch.randn(2, 12, 32)
    results = []
    for model in (upstream, patched):
        hidden = model(ids).last_hidden_state
        hidden.backward(upstream_grad)
        results.append((hidden.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (hidden_ref, grads_ref), (hidden, grads) = results
    torch.testing.assert_close(hidden, hidden_ref, **OUTPUT_TOLERANCE)
    assert grads.keys() == grads_ref.keys() and any("_hc.fn" in name for name in grads)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], msg=name, **GRADIENT_TOLERANCE)


def test_glm5_next_hyper_connection_is_unchanged():
    config = SimpleNamespace(hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, hidden_size=24)
    upstream = Glm5NextTextHyperConnection(config)
    with torch.no_grad():
        upstream.fn.normal_(0, 0.3)
        upstream.base.normal_(0, 1)
        upstream.scale.uniform_(0.5, 1.5)
    patched = apply_mhc_kernels(copy.deepcopy(upstream))
    streams = torch.randn(2, 5, 4, 24, requires_grad=True)
    upstream_out, patched_out = upstream(streams), patched(streams)
    for ours, theirs in zip(patched_out, upstream_out, strict=True):
        torch.testing.assert_close(ours, theirs, **OUTPUT_TOLERANCE)
    grads = [torch.randn_like(t) for t in upstream_out]
    expected = torch.autograd.grad(upstream_out, [streams, upstream.fn], grads)
    got = torch.autograd.grad(patched_out, [streams, patched.fn], grads)
    for ours, theirs in zip(got, expected, strict=True):
        torch.testing.assert_close(ours, theirs, **GRADIENT_TOLERANCE)


# HY-V4: a dense and a MoE layer, a full and a shared DSA indexer; hc_magnitude 2.5 (not DeepSeek's 2), and hc_eps,
# rms_norm_eps large enough that a misplaced or missing epsilon shows at the tolerance.
HY_V4_SETTINGS = dict(
    vocab_size=67, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
    num_attention_heads=2, n_routed_experts=4, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, index_topk=4, index_head_dim=16, index_n_heads=2,
    indexer_types=["full", "shared"], max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    hc_magnitude=2.5, hc_eps=1e-2, rms_norm_eps=1e-3, initializer_range=0.05,
)


def tiny_hy_v4(kind: str, hc_mult: int):
    """``HYV4ForCausalLM`` (``kind="hy_v4"``) or HY-V4-VL's ``HYV4VLTextModel``, with uneven token-dependent maps."""
    if kind == "hy_v4":
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("hy_v4", hc_mult=hc_mult, **HY_V4_SETTINGS))
    else:
        rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}
        model = HYV4VLTextModel(AutoConfig.for_model("hy_v4_vl_text", hc_mult=hc_mult, rope_parameters=rope,
                                                     **HY_V4_SETTINGS))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "hc" in name:
                param.normal_(0.5, 0.5) if name.endswith(("base", "scale")) else param.normal_(0, 0.05)
    return model.train()


def output_and_grads(model, ids, output_grad):
    """The logits (or last hidden state) and every parameter gradient after ``output.backward(output_grad)``."""
    model.zero_grad()
    out = model(ids)
    output = out.logits if hasattr(out, "logits") else out.last_hidden_state
    output.backward(output_grad)
    return output.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("kind", "hc_mult", "backend"), [
    ("hy_v4", 4, "torch"), ("hy_v4", 4, "triton"), ("hy_v4", 3, "torch"), ("hy_v4", 3, "triton"),
    ("hy_v4_vl", 4, "torch"), ("hy_v4_vl", 4, "triton"),
])
def test_hy_v4_outputs_and_gradients_are_unchanged(kind, hc_mult, backend, monkeypatch):
    """Every output and gradient within ``(atol + 4u) * max|upstream|`` (``atol`` of ``OUTPUT_TOLERANCE``), where ``u``
    is upstream's own float32 error (its worst over the output and gradients, relative to the same model in float64):
    the one- and few-entry gradients (``scale``, ``hc_scale``, ``hc_base``, the attention sinks) are sums over every
    token and stream that cancel, and float32 rounding alone moves them by up to ~5e-4 of their value, upstream's as
    much as ours."""
    upstream = tiny_hy_v4(kind, hc_mult)
    patched = apply_mhc_kernels(copy.deepcopy(upstream), backend=backend)
    assert sum("forward" in vars(m) for m in patched.modules()) == 7  # 4 hyper-connections, 2 decoder layers, head
    ids = torch.randint(1, 67, (2, 12))
    output_grad = torch.randn(2, 12, 67 if kind == "hy_v4" else 32)
    output_ref, grads_ref = output_and_grads(upstream, ids, output_grad)
    output, grads = output_and_grads(patched, ids, output_grad)
    exact = copy.deepcopy(upstream).double()
    exact.config._experts_implementation = "eager"  # grouped_mm has no float64 kernel
    with monkeypatch.context() as context:  # upstream's float32 casts too
        context.setattr(torch.Tensor, "float", torch.Tensor.double)
        output_exact, grads_exact = output_and_grads(exact, ids, output_grad.double())
    assert grads.keys() == grads_ref.keys() and sum("hc" in name for name in grads) == 15
    results = [("output", output, output_ref, output_exact)]
    results += [(name, grads[name], grads_ref[name], grads_exact[name]) for name in grads_ref]
    upstream_error = max(((ref.double() - value).abs().max() / value.abs().max()).item() for *_, ref, value in results)
    for name, ours, ref, _ in results:
        atol = (OUTPUT_TOLERANCE["atol"] + 4 * upstream_error) * ref.abs().max().item()
        torch.testing.assert_close(ours, ref, atol=atol, rtol=0, msg=name)


def test_hy_v4_runs_through_the_ops(monkeypatch):
    """The patched HY-V4 calls our ops and uses what they return: each hyper-connection ``mhc_coeffs_pre`` with the
    identity map and ``hc_magnitude``, each merge ``mhc_post_res`` without a comb, the head ``mhc_head``; any one op
    returning NaN makes every output NaN."""
    calls, poisoned = [], set()

    def counting(name):
        op = getattr(monkey_patch, name)

        def call(*args, **kwargs):
            calls.append((name, kwargs.get("residual_map"), kwargs.get("post_magnitude"),
                          args[3] if name == "mhc_post_res" else "-"))
            result = op(*args, **kwargs)
            if name not in poisoned:
                return result
            return tuple(t * float("nan") for t in result[:2]) + result[2:] if isinstance(result, tuple) else \
                result * float("nan")

        return call

    for name in ("mhc_coeffs_pre", "mhc_post_res", "mhc_head"):
        monkeypatch.setattr(monkey_patch, name, counting(name))
    ids = torch.randint(1, 67, (1, 5))
    for kind in ("hy_v4", "hy_v4_vl"):
        model = apply_mhc_kernels(tiny_hy_v4(kind, 4))
        calls.clear()
        model(ids)
        assert sorted(calls, key=str) == sorted(
            [("mhc_coeffs_pre", "identity", 2.5, "-")] * 4 + [("mhc_post_res", None, None, None)] * 4
            + [("mhc_head", None, None, "-")], key=str)
        for name in ("mhc_coeffs_pre", "mhc_post_res", "mhc_head"):
            poisoned.add(name)
            out = model(ids)
            assert (out.logits if kind == "hy_v4" else out.last_hidden_state).isnan().all(), name
            poisoned.clear()


def test_models_without_hyper_connections_are_refused():
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=32))
    with pytest.raises(ValueError, match=r"found no hyper-connection module in LlamaForCausalLM; it patches "
                                         r"DeepseekV4HyperConnection, .*HYV4HyperConnection, .*HYV4VLDecoderLayer\.$"):
        apply_mhc_kernels(llama)
