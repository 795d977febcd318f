"""``hf_mhc.distributed``: FSDP2 sharding, transformers' ``DistributedConfig`` engine (tensor, pipeline, FSDP2 and
expert parallelism) and pipeline-parallel stages of mHC models, and the torchrun examples that use them.

The multi-process tests start two gloo ranks on loopback with ``torchrun`` (CPU only) and run the worker scripts in
``tests/distributed_workers/`` (or an example); each worker compares its rank's results with a one-process reference.
A launch costs seconds, so each worker runs all its scenarios in one launch (a module-scoped fixture) and several
tests read its output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import (
    EXAMPLES,
    FAMILIES,
    VOCAB,
    WORKERS,
    WORLD_SIZE,
    assert_ordinary_mhc_folder,
    import_script,
    random_mhc,
    remote_code_logits,
    tiny_backbone_config,
    torchrun,
)
from distributed_workers import native_worker
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers_suite import run_distributed

from hf_mhc import MHCConfig, MHCForCausalLM, MHCModel
from hf_mhc.distributed import TiedEmbeddingSync, apply_fsdp2, pipeline_layer_split, split_pipeline

assert_close_to_scale = import_script(WORKERS / "tolerances.py").assert_close_to_scale

needs_distributed = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def run_stages(stages, input_ids: torch.Tensor) -> torch.Tensor:
    activations = input_ids
    for stage in stages:
        activations = stage(activations)
    return activations


def assert_loads_without_the_plugin(folder: Path, work: Path) -> None:
    """``folder`` loads with ``trust_remote_code=True`` where ``hf_mhc`` cannot be imported, to the logits the plugin
    gives (its reference formula against the plugin's kernels: float32 rounding)."""
    ids = torch.randint(3, 60, (2, 9))
    remote = remote_code_logits(folder, ids, work)
    with torch.no_grad():
        expected = MHCForCausalLM.from_pretrained(folder).eval()(ids).logits
    assert (remote - expected).abs().max() <= 1e-4 * expected.abs().max()


@needs_distributed
def test_distributed_config_runs_the_remote_code_a_checkpoint_ships(tmp_path):
    """Where ``hf_mhc`` cannot be imported, a checkpoint loaded with ``trust_remote_code=True`` and a
    ``DistributedConfig`` (pipeline and FSDP2) runs the distribution code it ships and gives the one-process logits."""
    folder = tmp_path / "checkpoint"
    random_mhc(num_hidden_layers=2).save_pretrained(folder)
    assert (folder / "distributed.py").is_file()
    output = torchrun(WORKERS / "remote_code_worker.py", str(folder), cwd=tmp_path)
    for rank in range(WORLD_SIZE):
        for plan in ("pp_size=2", "fsdp_size=2"):
            assert f"rank {rank}: remote code {plan} matches" in output, output[-3000:]


# --- FSDP2 ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp_launch(tmp_path_factory) -> tuple[str, Path]:
    """One launch of ``fsdp_worker.py`` (parity with a checkpoint, then bf16): its output and output folder."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    folder = tmp_path_factory.mktemp("fsdp")
    return torchrun(WORKERS / "fsdp_worker.py", str(folder), cwd=folder), folder


def test_fsdp2_matches_one_process_and_saves_a_full_checkpoint(fsdp_launch):
    output, folder = fsdp_launch
    assert "parity: loss and gradients match" in output and "checkpoint reloads" in output
    assert (folder / "checkpoint" / "model.safetensors").exists()


def test_fsdp2_shards_a_bf16_model_with_float32_hyper_connections(fsdp_launch):
    output, _ = fsdp_launch
    assert "HC kept float32" in output


def test_fsdp2_units_return_no_views(fsdp_launch):
    output, _ = fsdp_launch
    for rank in range(WORLD_SIZE):
        assert f"rank {rank}: 0 view warnings" in output, output[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hyper_connection_outputs_are_not_views_while_training(dtype):
    """FSDP2 hooks a unit's outputs for backward and warns about views (an in-place op on one drops the hook)."""
    config = random_mhc(num_hidden_layers=1).config
    trunk = MHCForCausalLM._from_config(config, dtype=dtype).train().model
    streams = torch.randn(2, 5, 3, 32, dtype=dtype, requires_grad=True)
    outputs = (*trunk.layers[0].attn_hc(streams), trunk.hc_head(streams))
    assert [output._base is None for output in outputs] == [True] * 4


def test_a_sharded_model_saves_an_ordinary_mhc_folder_that_loads_without_the_plugin(fsdp_launch, tmp_path):
    _, folder = fsdp_launch
    assert_ordinary_mhc_folder(folder / "checkpoint")
    assert_loads_without_the_plugin(folder / "checkpoint", tmp_path)


@needs_distributed
def test_apply_fsdp2_rejects_a_model_without_mhc_layers():
    with pytest.raises(ValueError, match="needs an mHC model"):
        apply_fsdp2(torch.nn.Linear(4, 4))


@needs_distributed
def test_apply_fsdp2_without_a_process_group_says_to_initialise_one():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        apply_fsdp2(random_mhc(num_hidden_layers=1))


# --- pipeline stages, in one process --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_chained_stages_compute_the_model(family):
    model = random_mhc(family, num_hidden_layers=3)
    input_ids = torch.randint(3, VOCAB, (2, 10))  # longer than Mistral's sliding window of 6
    with torch.no_grad():
        expected = model(input_ids).logits
        for num_stages in (1, 2, 3):
            torch.testing.assert_close(run_stages(split_pipeline(model, num_stages), input_ids), expected)


def test_stages_carry_the_streams_and_hold_only_their_parameters():
    model = random_mhc(num_hidden_layers=5)
    first, last = split_pipeline(model, 2)
    assert [list(split) for split in pipeline_layer_split(5, 2)] == [[0, 1, 2], [3, 4]]
    first_names, last_names = set(dict(first.named_parameters())), set(dict(last.named_parameters()))
    assert "model.embed_tokens.weight" in first_names and "lm_head.weight" not in first_names
    assert {"lm_head.weight", "model.norm.weight", "model.hc_head.hc_fn"} <= last_names
    assert "model.embed_tokens.weight" not in last_names
    assert {name.split(".")[2] for name in first_names if name.startswith("model.layers.")} == {"0", "1", "2"}
    assert {name.split(".")[2] for name in last_names if name.startswith("model.layers.")} == {"3", "4"}
    assert first_names.isdisjoint(last_names)
    assert first_names | last_names == set(dict(model.named_parameters()))
    assert first.model.layers[0] is model.model.layers[0]  # shared, not copied

    streams = first(torch.randint(3, VOCAB, (2, 7)))
    assert streams.shape == (2, 7, 3, 32)
    assert last(streams).shape == (2, 7, VOCAB)


def test_the_streams_cross_in_the_model_dtype_by_default():
    for dtype in (torch.float32, torch.bfloat16):
        model = MHCForCausalLM._from_config(random_mhc(num_hidden_layers=2).config, dtype=dtype)
        first, last = split_pipeline(model, 2)
        assert first.stream_dtype == last.stream_dtype == dtype
        assert first(torch.randint(3, VOCAB, (2, 7))).dtype == dtype


@pytest.mark.parametrize("family", FAMILIES)
def test_a_bf16_boundary_halves_the_bytes_and_keeps_the_logits_to_bf16_rounding(family):
    """``boundary_dtype=torch.bfloat16`` on a float32 model: the streams (and their gradient) cross in bf16, half
    the bytes, and the receiving stage computes in float32 again. Each of the 2 boundaries rounds the streams once
    (2**-9 of each entry): the logits stay within one bf16 step (2**-8) of the largest float32 logit per boundary
    (measured: 0.4 of one step in all)."""
    model = random_mhc(family, num_hidden_layers=3)
    input_ids = torch.randint(3, VOCAB, (2, 10))
    exact = split_pipeline(model, 3)
    rounded = split_pipeline(model, 3, boundary_dtype=torch.bfloat16)
    with torch.no_grad():
        streams, streams_bf16 = exact[0](input_ids), rounded[0](input_ids)
        expected, logits = run_stages(exact, input_ids), run_stages(rounded, input_ids)
    assert streams.dtype == torch.float32 and streams_bf16.dtype == torch.bfloat16
    assert streams_bf16.numel() * streams_bf16.element_size() * 2 == streams.numel() * streams.element_size()
    assert torch.equal(streams_bf16, streams.to(torch.bfloat16))
    assert logits.dtype == torch.float32
    assert (logits - expected).abs().max() <= 2 * 2.0**-8 * expected.abs().max()
    # Bit-exact: each rounded stage runs the exact stage's code on the same float32 input, then rounds its output.
    with torch.no_grad():  # the receiving stages compute in float32 on the rounded streams
        middle = rounded[1](streams_bf16)
        assert torch.equal(middle, exact[1](streams_bf16.float()).to(torch.bfloat16))
        assert torch.equal(rounded[2](middle), exact[2](middle.float()))

    received = streams_bf16.detach().requires_grad_()
    rounded[1](received).square().sum().backward()
    assert received.grad.dtype == torch.bfloat16  # the gradient sent back is bf16 too


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_running_stages_leaves_the_models_recorded_outputs_alone(family):
    """Stages run the full model's layers: the hidden states and router logits the model records stay one per layer
    after its stages have run."""
    model = random_mhc(family, num_hidden_layers=2)
    model.config.output_hidden_states = True
    model.config.backbone_config.output_router_logits = family == "qwen3_moe"
    input_ids = torch.randint(3, VOCAB, (2, 7))
    with torch.no_grad():
        activations = input_ids
        for stage in split_pipeline(model, 2):  # before the model records anything itself
            activations = stage(activations)
        outputs = model(input_ids)
    torch.testing.assert_close(activations, outputs.logits)
    assert len(outputs.hidden_states) == 3  # the streams entering each layer and leaving the last
    if family == "qwen3_moe":
        assert len(outputs.router_logits) == 1  # its first layer is dense


def test_stage_state_dicts_use_the_full_model_names():
    model = random_mhc(num_hidden_layers=2)
    stages = split_pipeline(model, 2)
    merged = {**stages[0].state_dict(), **stages[1].state_dict()}
    full = model.state_dict()
    assert set(merged) == set(full)
    for name, tensor in merged.items():
        assert torch.equal(tensor, full[name]), name


def test_stages_reject_the_wrong_input():
    first, second = split_pipeline(random_mhc(num_hidden_layers=2), 2)
    with pytest.raises(ValueError, match=r"input_ids \[B, T\]"):
        first(torch.zeros(2, 7, 3, 32))
    with pytest.raises(ValueError, match=r"streams \[B, T, n, C\]"):
        second(torch.randint(3, VOCAB, (2, 7)))


def test_more_stages_than_layers_is_a_one_line_error():
    with pytest.raises(ValueError, match="exceeds the model's 2 decoder layers") as error:
        split_pipeline(random_mhc(num_hidden_layers=2), 3)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="num_stages must be >= 1"):
        split_pipeline(random_mhc(num_hidden_layers=2), 0)
    with pytest.raises(TypeError, match="needs an MHCForCausalLM"):
        split_pipeline(MHCModel(random_mhc(num_hidden_layers=2).config), 1)


def test_tied_embeddings_stay_tied_across_stages_or_untie_on_request():
    """The first stage holds the weight, the last a copy; ``TiedEmbeddingSync`` gives both the sum of their
    gradients (here all stages run in one process: a local sum), so they take the same step."""
    model = random_mhc(num_hidden_layers=3, tie_word_embeddings=True)
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.weight is embedding
    stages = split_pipeline(model, 3)
    first, middle, last = stages
    assert first.tied_embedding is embedding and middle.tied_embedding is None
    assert last.tied_embedding is last.lm_head.weight and last.tied_embedding is not embedding
    assert torch.equal(last.tied_embedding, embedding)
    tied = TiedEmbeddingSync(stages, stage_ranks=[0, 0, 0])
    assert tied.copies == [first.tied_embedding, last.tied_embedding] and tied.duplicate is last.tied_embedding
    input_ids = torch.randint(3, VOCAB, (2, 7))
    logits = last(middle(first(input_ids)))
    torch.testing.assert_close(logits, model(input_ids).logits)
    logits.square().mean().backward()
    tied.all_reduce_grad()
    stage_gradients = first.tied_embedding.grad.clone(), last.tied_embedding.grad.clone()
    model.zero_grad()
    model(input_ids).logits.square().mean().backward()  # the full model's: the sum of both uses
    assert torch.equal(*stage_gradients)
    assert_close_to_scale(stage_gradients[0], embedding.grad, rtol=1e-5, name="tied gradient")
    assert split_pipeline(model, 1)[0].tied_embedding is None  # one stage: the tie needs no copy

    untied_first, untied_last = split_pipeline(model, 2, untie_word_embeddings=True)
    assert untied_last.lm_head.weight is not embedding and torch.equal(untied_last.lm_head.weight, embedding)
    assert untied_first.tied_embedding is None and untied_last.tied_embedding is None
    assert TiedEmbeddingSync([untied_first, untied_last], stage_ranks=[0, 0]).copies == []
    assert model.lm_head.weight is embedding  # the source model stays tied
    with torch.no_grad():
        torch.testing.assert_close(untied_last(untied_first(input_ids)), model(input_ids).logits)


# --- the torchrun examples ------------------------------------------------------------------------------------------


def example_module(name: str):
    """``examples/<name>.py`` imported as a module (its helpers, without running it)."""
    return import_script(EXAMPLES / f"{name}.py")


def changed_parameters(trained: torch.nn.Module, initial: torch.nn.Module) -> set[str]:
    initial_state = initial.state_dict()
    assert set(trained.state_dict()) == set(initial_state)
    return {name for name, tensor in trained.state_dict().items() if not torch.equal(tensor, initial_state[name])}


@needs_distributed
def test_fsdp2_example_trains_and_saves_an_ordinary_mhc_folder(tmp_path):
    out = tmp_path / "out"
    output = torchrun(EXAMPLES / "fsdp2_finetune.py", "--steps", "2", "--batch-size", "2", "--block-size", "32",
                      "--output-dir", str(out), cwd=tmp_path)
    assert "step 2/2: loss" in output and f"saved {out}" in output, output[-3000:]
    assert_ordinary_mhc_folder(out)
    example = example_module("fsdp2_finetune")
    _, args = example.parse_args("", ["--output-dir", str(tmp_path / "unused")], "")
    initial, _, _ = example.load_model(args)  # the default model the run started from
    trained = AutoModelForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    assert type(trained) is MHCForCausalLM
    changed = changed_parameters(trained, initial)
    assert "model.layers.0.attn_hc.fn" in changed and "model.layers.0.mlp.up_proj.weight" in changed


def test_the_examples_refuse_a_non_empty_output_dir_and_a_missing_model(tmp_path, capsys):
    example = example_module("fsdp2_finetune")
    (tmp_path / "old.txt").write_text("kept")
    with pytest.raises(SystemExit):
        example.parse_args("", ["--output-dir", str(tmp_path)], "")
    assert "is not empty: pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "old.txt").read_text() == "kept"
    with pytest.raises(SystemExit):
        example.parse_args("", ["--output-dir", str(tmp_path / "new"), "--model", str(tmp_path / "missing")], "")
    assert "no such folder" in capsys.readouterr().err


# --- transformers' DistributedConfig: tensor, pipeline, FSDP2 and expert parallelism ---------------------------------
# Each plan is one job of distributed_workers/native_worker.py for the rank processes that transformers_suite starts
# once for the session (the parallelism mixins use them too).


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
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """mHC checkpoints with random (DeepSeek-V4) HC maps: a 4-layer dense Llama, a 4-layer Qwen3 with two full
    layers then two sliding-window ones, and a 2-layer MoE (Qwen3-MoE)."""
    folder = tmp_path_factory.mktemp("native")
    torch.manual_seed(0)
    backbones = {
        "dense": tiny_backbone_config("llama", vocab_size=96, num_hidden_layers=4),
        "mixed": tiny_backbone_config("qwen3", vocab_size=96, num_hidden_layers=4, use_sliding_window=True,
                                      sliding_window=4, max_window_layers=2),
        "moe": tiny_backbone_config("qwen3_moe", vocab_size=96),
    }
    assert backbones["mixed"].layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2
    for name, backbone in backbones.items():
        MHCForCausalLM(MHCConfig(backbone_config=backbone, hc_mult=3, hc_init="deepseek_v4")).save_pretrained(
            folder / name)
    return {name: str(folder / name) for name in backbones}


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
@pytest.mark.parametrize("plan", list(native_worker.PLANS))
def test_distributed_config_matches_one_process(checkpoints, plan):
    run_distributed(world_size=2)(native_worker.run_plan)(plan, checkpoints)
