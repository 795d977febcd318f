"""transformers' own distributed engine on mHC models: ``from_pretrained(folder, distributed_config=DistributedConfig(
tp_size=..., pp_size=..., fsdp_size=..., ep_size=...))``, two gloo ranks on CPU.

mHC models take the backbone's plans (``MHCConfig.base_model_{tp,ep,fsdp,pp}_plan``) and keep their float32 HC modules
out of the TP and EP plans (replicated); with pipeline parallelism the stages exchange the streams ``[B, T, n, C]``.
All plans run in one launch of ``distributed_workers/native_worker.py`` (a module-scoped fixture), each test reads
its line.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_backbone_config
from test_distributed import WORKERS, WORLD_SIZE, torchrun

from hf_mhc import MHCConfig, MHCForCausalLM


def test_mhc_config_advertises_the_backbones_plans():
    backbone = tiny_backbone_config("qwen3_moe")
    config = MHCConfig(backbone_config=backbone)
    assert config.base_model_tp_plan == type(backbone).base_model_tp_plan
    assert config.base_model_ep_plan == type(backbone).base_model_ep_plan
    assert config.base_model_fsdp_plan == type(backbone).base_model_fsdp_plan
    assert list(config.base_model_pp_plan) == ["embed_tokens", "layers", "hc_head", "norm"]
    model = MHCForCausalLM(config)
    assert model.tp_plan["lm_head"] == "colwise_gather_output"
    assert model.ep_plan == {f"model.{pattern}": style for pattern, style in type(backbone).base_model_ep_plan.items()}
    assert model.fsdp_plan["lm_head"] == "keep_full_weight" and model.pp_plan["lm_head"] == (["hidden_states"],
                                                                                            ["logits"])
    for plan in (model.tp_plan, model.ep_plan, model.fsdp_plan):
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
def native_launch(tmp_path_factory) -> str:
    """One launch of the worker: a 4-layer dense (Llama) and a 2-layer MoE (Qwen3-MoE) checkpoint, every plan."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    folder = tmp_path_factory.mktemp("native")
    torch.manual_seed(0)
    dense = tiny_backbone_config("llama", vocab_size=96, num_hidden_layers=4)
    moe = tiny_backbone_config("qwen3_moe", vocab_size=96)
    for name, backbone in (("dense", dense), ("moe", moe)):
        MHCForCausalLM(MHCConfig(backbone_config=backbone, hc_mult=3, hc_init="deepseek_v4")).save_pretrained(
            folder / name)
    return torchrun(WORKERS / "native_worker.py", str(folder / "dense"), str(folder / "moe"), cwd=folder)


@pytest.mark.parametrize("plan", ["tp_size=2", "pp_size=2", "fsdp_size=2", "fsdp_size=2, ep_size=2"])
def test_distributed_config_matches_one_process(native_launch, plan):
    for rank in range(WORLD_SIZE):
        assert f"rank {rank}: {plan} matches (" in native_launch, native_launch[-3000:]
