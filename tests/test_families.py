"""The family table: every supported backbone family, upcycled, cached, saved, loaded as remote code, converted,
LoRA-adapted and gradient-checkpointed, on a tiny random config with perturbed norms and biases."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DENSE_FAMILIES,
    FLOAT32_TOLERANCES,
    MOE_FAMILIES,
    assert_logits_close,
    assert_same_weights,
    loss_gradients,
    perturbed_source_model,
    randomize_hc,
    remote_code_logits,
    tiny_backbone_config,
    token_ids,
)
from peft import get_peft_model
from peft.tuners.lora import LoraLayer
from safetensors import safe_open
from transformers import AutoModelForCausalLM
from transformers.conversion_mapping import register_checkpoint_conversion_mapping

import hf_mhc
from hf_mhc import MHCForCausalLM, modeling_mhc
from hf_mhc.cli import main
from hf_mhc.configuration_mhc import BACKBONE_WIRINGS, SUPPORTED_BACKBONES, BackboneWiring
from hf_mhc.conversion import is_hc_parameter
from hf_mhc.distributed import split_pipeline
from hf_mhc.mhc_reference import RESIDUAL_MAPS, sinkhorn
from hf_mhc.peft import lora_target_modules, mhc_lora_config

FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
assert set(FAMILIES) == set(SUPPORTED_BACKBONES), "every supported family has a row here"


pytestmark = pytest.mark.usefixtures("one_thread")


def source_model(family: str) -> torch.nn.Module:
    return perturbed_source_model(family)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_loss_aux_loss_and_router_logits_equal_the_source(family):
    """With ``output_router_logits=True`` and labels, ``aux_loss`` is the family's load-balancing loss of the router
    logits and ``loss`` includes ``router_aux_loss_coef · aux_loss``, as in the source (DeepSeek-V3 defines no
    load-balancing loss: ``aux_loss`` is ``None`` in both)."""
    source = source_model(family)
    mhc = hf_mhc.upcycle(source, hc_mult=4).eval()
    ids = token_ids(2, 12)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        expected = source(ids, attention_mask=mask, labels=labels, output_router_logits=True)
        got = mhc(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    assert len(got.router_logits) == len(expected.router_logits) > 0
    for ours, theirs in zip(got.router_logits, expected.router_logits, strict=True):
        assert_logits_close(ours, theirs)
        assert theirs.argmax(-1).unique().numel() > 1  # the routing depends on the token
    assert_logits_close(got.loss, expected.loss)
    if family == "deepseek_v3":
        assert got.aux_loss is None and expected.aux_loss is None
    else:
        assert_logits_close(got.aux_loss, expected.aux_loss)
        plain = mhc(ids, attention_mask=mask, labels=labels, output_router_logits=False)
        assert plain.aux_loss is None and plain.router_logits is None
        coefficient = source.config.router_aux_loss_coef
        torch.testing.assert_close(got.loss, plain.loss + coefficient * got.aux_loss)


@pytest.mark.parametrize("family", FAMILIES)
def test_post_norm_wiring_is_preserved_only_up_to_hc_eps(family):
    """``s = 1 - O(hc_eps)`` scales each site's stream mean. Pre-norm sublayers and the final norm cancel it, so
    even a large ``hc_eps = 1e-2`` keeps the logits within float32 rounding. Post-norm wiring (OLMo 2) feeds its
    sublayers ``s^k · h`` instead of ``h``: the logits move by about ``4 · hc_eps`` of their size here (measured
    4e-3 at ``hc_eps = 1e-3``, 4e-2 at 1e-2 for 2 layers, 1.5e-1 for 8), so at the default ``1e-6`` by about 4e-6,
    within rounding again."""
    source = source_model(family)
    mhc = hf_mhc.upcycle(source, hc_mult=4, hc_eps=1e-2).eval()
    ids = token_ids()
    with torch.no_grad():
        expected, got = source(ids).logits, mhc(ids).logits
    if BACKBONE_WIRINGS[family].pre_norm:
        assert_logits_close(got, expected)
    else:
        assert (got - expected).abs().max() > 1e-3 * expected.abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_stream_mean_follows_the_residual_stream(family):
    """Function preservation layer by layer: the streams entering layer ``l`` average to ``s^(2l)`` times the
    source's hidden state there (``s``: the row sum of the initial ``comb``). Pre-norm wiring gives this to float32
    rounding. Post-norm wiring (OLMo 2: ``h + norm(F(h))``) feeds each sublayer ``s^k · h`` instead of ``h``, which
    its MLP does not scale out, so there the match is ``O(k · hc_eps)``, here measured below 1e-6 relative."""
    source = source_model(family)
    mhc = hf_mhc.upcycle(source, hc_mult=4).eval()
    config = mhc.config
    comb_b = config.hc_init_comb_diag * torch.eye(config.hc_mult)
    row_sum = sinkhorn(comb_b, config.hc_sinkhorn_iters, config.hc_eps).double().sum(-1).mean().item()
    ids = token_ids()
    with torch.no_grad():
        residual = source(ids, output_hidden_states=True).hidden_states
        streams = mhc(ids, output_hidden_states=True).hidden_states
    tolerance = 1e-6 if BACKBONE_WIRINGS[family].pre_norm else 1e-5
    for layer in range(config.backbone_config.num_hidden_layers):  # the last hidden state is the final-normed one
        mean = streams[layer].double().mean(-2) / row_sum ** (2 * layer)
        expected = residual[layer].double()
        assert (mean - expected).abs().max() <= tolerance * expected.abs().max(), (family, layer)


@pytest.mark.parametrize("family", FAMILIES)
def test_cached_greedy_equals_uncached(family):
    mhc = randomize_hc(hf_mhc.upcycle(source_model(family), hc_mult=3)).eval()
    ids = token_ids(2, 7)
    cached = mhc.generate(ids, max_new_tokens=8, do_sample=False, use_cache=True, pad_token_id=0)
    uncached = mhc.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False, pad_token_id=0)
    assert cached.shape == (2, 15)
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("family", FAMILIES)
def test_save_and_from_pretrained_give_the_same_logits(family, tmp_path):
    mhc = randomize_hc(hf_mhc.upcycle(source_model(family), hc_mult=3)).eval()
    mhc.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(reloaded) is MHCForCausalLM
    assert_same_weights(reloaded, mhc)
    ids = token_ids()
    with torch.no_grad():
        assert_logits_close(reloaded(ids).logits, mhc(ids).logits)


@pytest.fixture(scope="module")
def remote_and_local_logits(tmp_path_factory):
    """Every family's saved mHC folder, and a Llama one per residual map, loaded with ``trust_remote_code`` in one
    process without ``hf_mhc``; ``(remote, local)`` logits by family or map."""
    root = tmp_path_factory.mktemp("remote_code")
    torch.manual_seed(0)  # module-scoped: set up before the per-test seed
    ids = token_ids()
    models = {family: hf_mhc.upcycle(source_model(family), hc_mult=3) for family in FAMILIES}
    models |= {f"llama-{name}": hf_mhc.upcycle(source_model("llama"), hc_mult=4, hc_residual_map=name)
               for name in RESIDUAL_MAPS}
    local = {}
    for name, model in models.items():
        model = randomize_hc(model).eval()
        model.save_pretrained(root / name)
        with torch.no_grad():
            local[name] = model(ids).logits
    remote = remote_code_logits([root / name for name in models], ids, root)
    return {name: (logits, local[name]) for name, logits in zip(models, remote, strict=True)}


@pytest.mark.parametrize("case", FAMILIES + tuple(f"llama-{name}" for name in RESIDUAL_MAPS))
def test_trust_remote_code_load_without_the_plugin(case, remote_and_local_logits):
    remote, local = remote_and_local_logits[case]
    # The plugin runs its own kernels, the remote copy the plain reference formula: equal up to float32 rounding,
    # which the unconstrained map (not non-expansive) amplifies up to about 5e-6 of the logits.
    assert_logits_close(remote, local)


# MoE families: test_convert_streams_a_published_moe_checkpoint_as_it_is (the published layout, verified) below.
@pytest.mark.parametrize("family", DENSE_FAMILIES)
def test_convert_of_the_saved_source(family, tmp_path, capsys):
    source = source_model(family)
    source.save_pretrained(tmp_path / "src")
    status = main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--hc-mult", "3", "--no-verify"])
    assert status == 0, capsys.readouterr().err
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert isinstance(converted, MHCForCausalLM) and converted.config.backbone_config.model_type == family
    assert set(source.state_dict()) <= set(converted.state_dict())  # every backbone tensor under its own name
    ids = token_ids()
    with torch.no_grad():
        assert_logits_close(converted(ids).logits, source(ids).logits)


def saved_tensor_names(folder) -> set[str]:
    names = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as weights:
            names |= set(weights.keys())
    return names


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_experts_save_and_load_in_the_published_layout(family, tmp_path):
    """In memory the experts are fused (``mlp.experts.gate_up_proj``); on disk an mHC checkpoint holds them as its
    source does, one tensor per expert under the family's published names, and loads them back."""
    source = source_model(family)
    source.save_pretrained(tmp_path / "src")
    mhc = randomize_hc(hf_mhc.upcycle(source, hc_mult=3)).eval()
    mhc.save_pretrained(tmp_path / "mhc")
    saved = saved_tensor_names(tmp_path / "mhc")
    assert {name for name in saved if not is_hc_parameter(name)} == saved_tensor_names(tmp_path / "src")
    assert any(".experts.0." in name for name in saved)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "mhc").eval()
    assert_same_weights(reloaded, mhc)
    ids = token_ids()
    with torch.no_grad():
        assert_logits_close(reloaded(ids).logits, mhc(ids).logits)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_checkpoints_saved_with_fused_experts_still_load(family, tmp_path, monkeypatch):
    """mHC checkpoints written before the published layout held the fused in-memory tensors."""
    mhc = randomize_hc(hf_mhc.upcycle(source_model(family), hc_mult=3)).eval()
    with monkeypatch.context() as patch:  # no conversions at save: the tensors as they are in memory
        patch.setattr(modeling_mhc, "use_backbone_weight_conversions",
                      lambda family: register_checkpoint_conversion_mapping("mhc", [], overwrite=True))
        mhc.save_pretrained(tmp_path)
    assert any(name.endswith("experts.gate_up_proj") for name in saved_tensor_names(tmp_path))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert_same_weights(reloaded, mhc)
    ids = token_ids()
    with torch.no_grad():
        assert_logits_close(reloaded(ids).logits, mhc(ids).logits)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_convert_streams_a_published_moe_checkpoint_as_it_is(family, tmp_path, capsys):
    """MoE checkpoints are saved with one tensor per expert (transformers fuses them on load). ``hf-mhc convert``
    copies them under their own names, verifies, and the mHC checkpoint loads with the source's logits."""
    source = source_model(family)
    source.save_pretrained(tmp_path / "src")
    status = main(["convert", str(tmp_path / "src"), str(tmp_path / "out")])
    assert status == 0, capsys.readouterr().err
    saved = saved_tensor_names(tmp_path / "out")
    assert {name for name in saved if not is_hc_parameter(name)} == saved_tensor_names(tmp_path / "src")
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = token_ids()
    with torch.no_grad():
        assert_logits_close(converted(ids).logits, source(ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_targets_the_family_projections(family):
    mhc = hf_mhc.upcycle(source_model(family), hc_mult=2)
    targets = lora_target_modules(family)
    model = get_peft_model(mhc, mhc_lora_config(r=2, lora_alpha=4, model_type=family))
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    assert adapted == set(targets)
    if family == "phi3":
        assert {"qkv_proj", "gate_up_proj"} <= adapted
    ids = token_ids()
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    lora_b = [(name, param) for name, param in model.named_parameters() if "lora_B" in name]
    assert lora_b and all(param.grad is not None and param.grad.abs().max() > 0 for _, param in lora_b)
    hc_grads = [param.grad for name, param in model.named_parameters() if "modules_to_save" in name and param.grad
                is not None]
    assert hc_grads


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_gives_the_same_gradients(family):
    """Before any optimizer step: the same gradients with activation checkpointing, and with it plus hc_recompute."""
    model = randomize_hc(hf_mhc.upcycle(source_model(family), hc_mult=3)).train()
    ids = token_ids()

    plain = loss_gradients(model, ids)
    model.activation_checkpointing_enable()
    assert model.model.layers[0].gradient_checkpointing
    checkpointed = loss_gradients(model, ids)
    for layer in model.model.layers:  # and selective recomputation of the mHC maps on top (hc_recompute)
        layer.hc_recompute = True
    recomputed = loss_gradients(model, ids)
    assert plain.keys() == checkpointed.keys() == recomputed.keys()
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], **FLOAT32_TOLERANCES["gradients"], msg=name)
        torch.testing.assert_close(recomputed[name], plain[name], **FLOAT32_TOLERANCES["gradients"], msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_stages_compute_the_model(family):
    """The stages run the model's own layer loop, embedding scaling, rotary embeddings per attention kind and logit
    scaling: chained, they give the model's logits."""
    mhc = randomize_hc(hf_mhc.upcycle(source_model(family), hc_mult=3)).eval()
    ids = token_ids(2, 9)  # longer than the sliding windows
    with torch.no_grad():
        expected = mhc(ids).logits
        hidden = ids
        for stage in split_pipeline(mhc, num_stages=2):
            hidden = stage(hidden)
    # Bit-exact: the stages run the model's own code on the model's own parameters (the same tensors).
    torch.testing.assert_close(hidden, expected, atol=0, rtol=0)


def test_a_setting_the_wiring_refuses_gets_one_line():
    with pytest.raises(ValueError, match=r"^Unsupported mHC backbone 'gemma3_text' \(use_bidirectional_attention="
                                         r"True does not fit a causal mHC model\); supported backbone families: "):
        hf_mhc.MHCConfig(backbone_config=tiny_backbone_config("gemma3_text", use_bidirectional_attention=True))


def test_a_wiring_entry_that_does_not_fit_the_layer_names_what(monkeypatch):
    monkeypatch.setitem(BACKBONE_WIRINGS, "olmo2", BackboneWiring())  # OLMo 2 has no input_layernorm
    with pytest.raises(ValueError, match=r"^Unsupported mHC backbone 'olmo2' \(Olmo2DecoderLayer lacks "
                                         r"\['input_layernorm'\]\)"):
        MHCForCausalLM(hf_mhc.MHCConfig(backbone_config=tiny_backbone_config("olmo2")))
    monkeypatch.setitem(BACKBONE_WIRINGS, "gemma3_text", BackboneWiring(attention_after=("post_attention_layernorm",)))
    with pytest.raises(ValueError, match=r"Gemma3DecoderLayer has \['pre_feedforward_layernorm', "
                                         r"'post_feedforward_layernorm'\], which the wiring entry does not place"):
        MHCForCausalLM(hf_mhc.MHCConfig(backbone_config=tiny_backbone_config("gemma3_text")))
    monkeypatch.setitem(BACKBONE_WIRINGS, "phi3", BackboneWiring())  # a dropout, no weights, but not the identity
    with pytest.raises(ValueError, match=r"Phi3DecoderLayer has \['resid_attn_dropout', 'resid_mlp_dropout'\]"):
        MHCForCausalLM(hf_mhc.MHCConfig(backbone_config=tiny_backbone_config("phi3")))


def test_bfloat16_load_keeps_the_backbone_float32_modules_too(tmp_path):
    """DeepSeek-V3 keeps its router (``gate.weight``, ``e_score_correction_bias``) in float32, as its own model
    does, also from a checkpoint that stores them in bfloat16."""
    hf_mhc.upcycle(source_model("deepseek_v3").to(torch.bfloat16)).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    router = model.model.layers[1].mlp.gate
    assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32
    assert model.model.layers[1].attn_hc.fn.dtype == torch.float32
    assert model.model.layers[1].self_attn.q_a_proj.weight.dtype == torch.bfloat16
