"""Accelerate's and Trainer's FSDP2 keep the mHC hyper-connection (HC) modules float32 (``hf_mhc.accelerate_fsdp2``).

One launch of ``distributed_workers/accelerate_fsdp2_worker.py`` on two gloo ranks, in the environment that
``accelerate launch --config_file examples/accelerate/fsdp2.yaml`` gives its processes (as Accelerate's own launcher
computes it), runs three scenarios: Accelerate without the hook ("plain"), with it ("accelerate"), and ``Trainer``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import WORKERS, tiny_backbone_config, torchrun

from hf_mhc import MHCConfig, MHCForCausalLM
from hf_mhc.accelerate_fsdp2 import install, shard_hyper_connections

TESTS = Path(__file__).resolve().parent
FSDP2_YAML = TESTS.parent / "examples" / "accelerate" / "fsdp2.yaml"
# The worker's reference runs the same computation as the sharded model (same shapes, same bf16 backbone, float32 HC
# modules), so the HC gradients differ only by the order of the two-rank float32 mean: measured 0 (bitwise equal).
# The distributed tests' float32 tolerance, 1e-4 of each tensor's largest entry, leaves room for other CPUs.
HC_GRADIENT_RTOL = 1e-4


def launch_environment() -> dict[str, str]:
    """The FSDP and mixed-precision variables ``accelerate launch --config_file fsdp2.yaml`` sets, plus
    ``ACCELERATE_USE_CPU`` (as ``--cpu`` would) for the gloo ranks."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(FSDP2_YAML), "--num_processes", "2",
                                                 "--main_process_port", "0", "train.py"])
    args, _, _ = _validate_launch_command(args)
    environment = prepare_multi_gpu_env(args)
    return {**{k: v for k, v in environment.items() if k.startswith(("FSDP_", "ACCELERATE_"))},
            "ACCELERATE_USE_CPU": "true"}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Each scenario's ``RESULT`` line, by scenario name."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    folder = tmp_path_factory.mktemp("accelerate_fsdp2")
    with pytest.MonkeyPatch.context() as patch:
        for name, value in launch_environment().items():
            patch.setenv(name, value)
        output = torchrun(WORKERS / "accelerate_fsdp2_worker.py", str(folder), cwd=folder)
    lines = [json.loads(line.split("RESULT ", 1)[1]) for line in output.splitlines() if line.startswith("RESULT ")]
    return {line.pop("scenario"): line for line in lines}


def test_fsdp2_yaml_is_bf16_fsdp2_with_one_unit_per_decoder_layer():
    environment = launch_environment()
    assert environment["ACCELERATE_USE_FSDP"] == "true" and environment["FSDP_VERSION"] == "2"
    assert environment["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert environment["FSDP_AUTO_WRAP_POLICY"] == "TRANSFORMER_BASED_WRAP"
    assert environment["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "MHCDecoderLayer"


@pytest.mark.parametrize("scenario", ["accelerate", "cpu_ram_efficient_loading", "trainer"])
def test_hc_parameters_stay_float32_shards_and_compute_in_float32(results, scenario):
    result = results[scenario]
    assert result["hc_shards"] == ["DTensor torch.float32"]
    assert result["hc_parameters"] == ["torch.float32"], "HC parameters were gathered in another dtype"
    assert result["maps"] == ["torch.float32"]
    assert result["hc_gradients"] == ["DTensor torch.float32"]
    assert result["backbone_weights"] == ["torch.bfloat16"], "the backbone left the bf16 policy"


def test_trainer_takes_a_finite_step(results):
    assert math.isfinite(results["trainer"]["loss"])


@pytest.mark.parametrize("scenario", ["accelerate", "cpu_ram_efficient_loading"])
def test_hc_gradients_match_the_one_process_bf16_model(results, scenario):
    result = results[scenario]
    assert result["hc_gradient_error"] <= HC_GRADIENT_RTOL, result


def test_plain_accelerate_gathers_the_hc_parameters_in_bf16(results):
    """Without the hook, Accelerate's one bf16 policy rounds the HC weights before the maps (which are still computed
    in float32, from the rounded weights) and reduces their gradients in bf16: every HC gradient moves."""
    result = results["plain"]
    assert result["hc_shards"] == ["DTensor torch.float32"]  # Accelerate's float32 master weights
    assert result["hc_parameters"] == ["torch.bfloat16"]
    assert result["hc_gradient_least_error"] > HC_GRADIENT_RTOL, result


def test_install_is_idempotent():
    import accelerate.accelerator
    import accelerate.utils.fsdp_utils as fsdp_utils

    hooked = accelerate.accelerator.fsdp2_prepare_model, fsdp_utils.fsdp2_prepare_auto_wrap_policy
    install()
    assert (accelerate.accelerator.fsdp2_prepare_model, fsdp_utils.fsdp2_prepare_auto_wrap_policy) == hooked
    assert hooked[0].__wrapped__ is fsdp_utils.fsdp2_prepare_model
    assert hooked[1].__wrapped__.__module__ == "accelerate.utils.fsdp_utils"


def test_only_hyper_connection_modules_are_sharded_here():
    """A model without HC modules is left to Accelerate, and so are HC modules in the plugin's ``ignored_modules``."""
    assert shard_hyper_connections(accelerator=None, model=torch.nn.Linear(4, 4)) == 0
    model = MHCForCausalLM(MHCConfig(backbone_config=tiny_backbone_config("llama"), hc_mult=2))
    plugin = SimpleNamespace(ignored_modules=r"model\.(layers\.\d+\.(attn|ffn)_hc|hc_head)")
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
    assert shard_hyper_connections(accelerator, model) == 0
