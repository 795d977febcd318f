"""transformers' own distributed engine on mHC models: ``from_pretrained(folder, distributed_config=DistributedConfig(
tp_size=..., pp_size=..., fsdp_size=..., ep_size=...))``, two gloo ranks on CPU.

mHC models take the backbone's plans (``MHCConfig.base_model_{tp,ep,fsdp,pp}_plan``) and keep their float32 HC modules
out of the TP and EP plans (replicated); with pipeline parallelism the stages exchange the streams ``[B, T, n, C]``.
Each plan is one job of ``distributed_workers/native_worker.py`` for the rank processes that
``transformers_suite.RankPool`` starts once for the session (the parallelism mixins use them too).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_backbone_config
from distributed_workers import native_worker
from transformers_suite import run_distributed

from hf_mhc import MHCConfig, MHCForCausalLM


def test_mhc_config_advertises_the_backbones_plans():
    backbone = tiny_backbone_config("qwen3_moe")
    config = MHCConfig(backbone_config=backbone)
    assert config.base_model_tp_plan == type(backbone).base_model_tp_plan
    assert config.base_model_ep_plan == type(backbone).base_model_ep_plan
    hc_units = dict.fromkeys(("layers.*.attn_hc", "layers.*.ffn_hc", "hc_head"), "free_full_weight")
    assert config.base_model_fsdp_plan == type(backbone).base_model_fsdp_plan | hc_units
    assert list(config.base_model_pp_plan) == ["embed_tokens", "layers", "hc_head", "norm"]
    model = MHCForCausalLM(config)
    assert model.tp_plan["lm_head"] == "colwise_gather_output"
    assert model.ep_plan == {f"model.{pattern}": style for pattern, style in type(backbone).base_model_ep_plan.items()}
    assert model.fsdp_plan["lm_head"] == "keep_full_weight" and model.pp_plan["lm_head"] == (["hidden_states"],
                                                                                            ["logits"])
    for plan in (model.tp_plan, model.ep_plan):
        assert not any("hc" in pattern for pattern in plan)


def test_streams_given_as_inputs_embeds_continue_the_model():
    """What a pipeline stage receives: the streams entering the layers, as 4-D ``inputs_embeds``."""
    model = MHCForCausalLM(MHCConfig(backbone_config=tiny_backbone_config("granite"), hc_mult=3,
                                     hc_init="deepseek_v4")).eval()
    input_ids = torch.randint(3, 90, (2, 7))
    with torch.no_grad():
        outputs = model(input_ids, output_hidden_states=True)
        streams = outputs.hidden_states[0]  # embeddings already scaled by Granite's multiplier
        torch.testing.assert_close(model(inputs_embeds=streams).logits, outputs.logits)
    with pytest.raises(ValueError, match=r"streams \[B, T, n, C\] with \(n, C\) = \(3, 32\)"):
        model(inputs_embeds=streams[:, :, :2])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    """A 4-layer dense (Llama) and a 2-layer MoE (Qwen3-MoE) mHC checkpoint, with random (DeepSeek-V4) HC maps."""
    folder = tmp_path_factory.mktemp("native")
    torch.manual_seed(0)
    dense = tiny_backbone_config("llama", vocab_size=96, num_hidden_layers=4)
    moe = tiny_backbone_config("qwen3_moe", vocab_size=96)
    for name, backbone in (("dense", dense), ("moe", moe)):
        MHCForCausalLM(MHCConfig(backbone_config=backbone, hc_mult=3, hc_init="deepseek_v4")).save_pretrained(
            folder / name)
    return str(folder / "dense"), str(folder / "moe")


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("plan", list(native_worker.PLANS))
def test_distributed_config_matches_one_process(checkpoints, plan):
    run_distributed(world_size=2)(native_worker.run_plan)(plan, *checkpoints)
