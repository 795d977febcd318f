"""``hf_mhc.conversion.verify``: a conversion is compared with its source in float32 from the same weights, whatever
dtype was written, with logits judged relative to their scale and greedy decoding identical; conversion bugs (a wrong
HC tensor, swapped experts) fail in every dtype and write nothing."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, assert_one_line_error, convert, leftovers, save_source, tiny_backbone_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_mhc
import hf_mhc.conversion.convert as convert_module
import hf_mhc.conversion.verify as verify_module
from hf_mhc.conversion import VerificationError, VerificationResult, convert_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def save_large_logit_llama(folder: Path) -> None:
    """A 4-layer, 128-wide random Llama whose lm_head is scaled so that its logits reach ~500: float32 rounding then
    differs by ~4e-4 between the mHC model and the source, above an absolute 1e-4 but 1e-6 of the logit scale."""
    config = tiny_backbone_config(
        "llama", vocab_size=256, hidden_size=128, intermediate_size=341, num_hidden_layers=4, num_attention_heads=4
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(600.0)
    model.save_pretrained(folder)


def save_noisy_deepseek_v3(folder: Path) -> None:
    """A 3-layer DeepSeek-V3 (MLA, a dense first layer, 8 routed experts, grouped top-2 routing, a shared expert)
    with N(0, 0.1) noise on every weight and on the routing bias, saved in float32: expert choices close enough that
    half-precision rounding flips some of them."""
    model = AutoModelForCausalLM.from_config(tiny_backbone_config("deepseek_v3", num_hidden_layers=3)).eval()
    with torch.no_grad():
        routing_biases = [tensor for name, tensor in model.named_buffers() if name.endswith("e_score_correction_bias")]
        for tensor in (*model.parameters(), *routing_biases):
            tensor.add_(0.1 * torch.randn_like(tensor))
    model.save_pretrained(folder)


def put_post_bias_off(monkeypatch, layer: int) -> None:
    """A conversion bug: ``layer``'s MLP post biases off by 0.01 in the HC tensors written."""
    real_tensors = convert_module.function_preserving_hc_tensors

    def wrong_init(config):
        tensors = real_tensors(config)
        tensors[f"model.layers.{layer}.ffn_hc.base"][config.hc_mult : 2 * config.hc_mult] += 0.01
        return tensors

    monkeypatch.setattr(convert_module, "function_preserving_hc_tensors", wrong_init)


def swap_tensors(monkeypatch, first: str, second: str) -> None:
    """A conversion bug: source tensors ``first`` and ``second`` written under each other's names."""
    real_plan = convert_module.plan_tensors

    def wrong_plan(*args, **kwargs):
        plan = real_plan(*args, **kwargs)
        index = {planned.spec.name: i for i, planned in enumerate(plan)}
        i, j = index[first], index[second]
        plan[i], plan[j] = replace(plan[i], source=plan[j].source), replace(plan[j], source=plan[i].source)
        return plan

    monkeypatch.setattr(convert_module, "plan_tensors", wrong_plan)


def test_failed_verification_writes_nothing(tmp_path, capsys, monkeypatch):
    save_source(tmp_path / "src", "llama")
    real_tensors = convert_module.function_preserving_hc_tensors

    def wrong_init(config):  # a conversion bug: layer 0's attention output weighted too much against the residual
        tensors = real_tensors(config)
        n = config.hc_mult
        tensors["model.layers.0.attn_hc.base"][n : 2 * n] += 1.0
        return tensors

    monkeypatch.setattr(convert_module, "function_preserving_hc_tensors", wrong_init)
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out")
    assert_one_line_error(status, err, "does not reproduce the source", "greedy decoding of 32 tokens", "bug")
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_verification_is_relative_to_the_logit_scale_in_every_dtype(tmp_path, dtype):
    save_large_logit_llama(tmp_path / "src")
    report = convert_checkpoint(tmp_path / "src", tmp_path / "out", dtype=dtype, progress=False)
    verification = report.verification
    assert verification.passed and verification.greedy_agrees, verification.summary()
    assert verification.dtype == dtype and verification.compute_dtype == "float32"
    assert (verification.rounded_tensors > 0) == (dtype != "float32")  # the source is stored in float32
    assert verification.logit_scale > 200
    assert verification.tolerance == pytest.approx(1e-4 * verification.logit_scale)
    # Rounding well above an absolute 1e-4, yet a few 1e-6 of the logit scale: a relative tolerance passes it.
    assert 1e-4 < verification.max_abs_logit_diff < 1e-5 * verification.logit_scale


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_wrong_hc_tensor_fails_verification_in_every_dtype(tmp_path, monkeypatch, dtype):
    """Layer 3's MLP post biases off by 0.01 move the logits by ~6e-4 of their scale and leave greedy decoding as it
    is: the threshold is the same small fraction of the scale in every written dtype, so half precision fails it
    too."""
    save_large_logit_llama(tmp_path / "src")
    put_post_bias_off(monkeypatch, layer=3)
    with pytest.raises(VerificationError, match=f"does not reproduce the source: {dtype} weights .*conversion bug"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", dtype=dtype, progress=False)
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_a_bfloat16_conversion_of_an_moe_model_verifies(tmp_path, capsys):
    """Computed in bfloat16, the mHC model's streams round differently from the source's residual stream, which flips
    expert choices of this model: on the verification prompts its logits differ from the source's by a sizeable
    fraction of their scale, so a verification in bfloat16 would fail a correct conversion. Both computed in float32
    from the same rounded weights agree to float32 rounding."""
    save_noisy_deepseek_v3(tmp_path / "src")
    source = AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.bfloat16).eval()
    mhc = hf_mhc.upcycle(source, hc_mult=4).eval()
    prompts, _ = verify_module.verification_prompts(tmp_path / "src", VOCAB)
    with torch.no_grad():
        source_logits = torch.cat([source(ids[None]).logits[0].float() for ids in prompts])
        mhc_logits = torch.cat([mhc(ids[None]).logits[0].float() for ids in prompts])
    assert (mhc_logits - source_logits).abs().max() > 0.1 * source_logits.abs().max()  # routing flips in bfloat16

    status, stdout, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--dtype", "bfloat16")
    assert status == 0, err
    rounded = len(load_file(tmp_path / "src" / "model.safetensors"))
    assert (f"Verification: bfloat16 weights against the source with {rounded} tensors rounded to bfloat16 as "
            "converted, both computed in float32, 3 prompts (token ids)") in stdout
    assert "greedy decoding of 32 tokens agrees" in stdout


MOE_CONVERSION_BUGS = {
    "post bias off": lambda monkeypatch: put_post_bias_off(monkeypatch, layer=2),
    "experts swapped": lambda monkeypatch: swap_tensors(
        monkeypatch, "model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.experts.1.gate_proj.weight"
    ),
}


@pytest.mark.parametrize("bug", MOE_CONVERSION_BUGS)
def test_a_wrong_bfloat16_conversion_of_an_moe_model_fails(tmp_path, monkeypatch, bug):
    save_noisy_deepseek_v3(tmp_path / "src")
    MOE_CONVERSION_BUGS[bug](monkeypatch)
    with pytest.raises(VerificationError, match="does not reproduce the source: bfloat16 weights .*conversion bug"):
        convert_checkpoint(tmp_path / "src", tmp_path / "out", dtype="bfloat16", progress=False)
    assert not (tmp_path / "out").exists() and not leftovers(tmp_path)


def test_verification_requires_identical_greedy_decoding_also_in_half_precision(tmp_path, capsys, monkeypatch):
    save_source(tmp_path / "src", "llama")
    real_run = verify_module._run_prompts
    runs = []

    def converted_decodes_differently(*args):
        logits, tokens = real_run(*args)
        runs.append(tokens)
        if len(runs) == 2:  # the converted model: same logits, one greedy token changed
            tokens = tokens.clone()
            tokens[0, -1] = (tokens[0, -1] + 1) % 101
        return logits, tokens

    monkeypatch.setattr(verify_module, "_run_prompts", converted_decodes_differently)
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--dtype", "bfloat16")
    assert_one_line_error(status, err, "greedy decoding of 32 tokens DIFFERS", "conversion bug")
    assert len(runs) == 2 and not (tmp_path / "out").exists()


def test_a_weight_beyond_float16_fails_verification_and_says_so(tmp_path, capsys):
    model = AutoModelForCausalLM.from_config(tiny_backbone_config("llama")).eval()
    with torch.no_grad():
        model.lm_head.weight[5, 0] = 1e5  # inf in float16
    model.save_pretrained(tmp_path / "src")
    status, _, err = convert(capsys, tmp_path / "src", tmp_path / "out", "--dtype", "float16")
    assert_one_line_error(status, err, "max |logit difference| inf", "float16 holds weights up to 65504 only")
    assert not (tmp_path / "out").exists()
    assert convert(capsys, tmp_path / "src", tmp_path / "out", "--dtype", "bfloat16")[0] == 0


def test_a_verification_passes_with_agreeing_logits_and_greedy_decoding_only():
    common = dict(dtype="bfloat16", compute_dtype="float32", rounded_tensors=12, prompts=3, prompt_source="token ids",
                  logit_scale=50.0, greedy_tokens=32)
    close = VerificationResult(max_abs_logit_diff=4e-3, greedy_agrees=True, **common)
    assert close.passed and close.tolerance == pytest.approx(5e-3)
    assert close.summary().startswith("bfloat16 weights against the source with 12 tensors rounded to bfloat16 as "
                                      "converted, both computed in float32, 3 prompts (token ids)")
    assert not VerificationResult(max_abs_logit_diff=4e-3, greedy_agrees=False, **common).passed
    assert not VerificationResult(max_abs_logit_diff=6e-3, greedy_agrees=True, **common).passed
    assert not VerificationResult(max_abs_logit_diff=math.inf, greedy_agrees=True, **common).passed
    assert verify_module.logit_tolerance(0.5) == pytest.approx(1e-4)  # max(1, scale)
    assert verify_module.logit_tolerance(300.0) == pytest.approx(3e-2)
