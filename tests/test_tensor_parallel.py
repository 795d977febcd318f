"""Tensor parallelism through transformers' own engine (``DistributedConfig(tp_size=2)``), two gloo ranks on CPU.

mHC models take the backbone's TP plan (``MHCConfig.base_model_tp_plan``) and keep their HC modules replicated.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from conftest import tiny_backbone_config
from test_distributed import WORKERS, torchrun

from hf_mhc import MHCConfig, MHCForCausalLM


def test_mhc_config_advertises_the_backbones_tp_plan():
    backbone = tiny_backbone_config("qwen3")
    config = MHCConfig(backbone_config=backbone)
    assert config.base_model_tp_plan == type(backbone).base_model_tp_plan
    model = MHCForCausalLM(config)
    assert model.tp_plan["lm_head"] == "colwise_gather_output"
    assert not any("hc" in pattern for pattern in model.tp_plan)


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_tp_size_2_matches_one_process(tmp_path):
    config = MHCConfig(backbone_config=tiny_backbone_config("llama", vocab_size=96), hc_mult=3, hc_init="deepseek_v4")
    MHCForCausalLM(config).save_pretrained(tmp_path / "checkpoint")
    output = torchrun(WORKERS / "tp_worker.py", str(tmp_path / "checkpoint"), cwd=tmp_path)
    assert output.count("tensor-parallel logits and gradients match") == 2
