"""transformers' own distributed engine on mHC checkpoints, one job per plan for the rank processes of
``tests/transformers_suite.py`` (gloo on CPU): ``run_plan(rank, plan, dense_checkpoint, moe_checkpoint)``. Each plan
loads with ``from_pretrained(folder, distributed_config=DistributedConfig(...))`` and is compared with the same folder
loaded in one process:

- ``tp_size=2`` (dense): the attention and MLP projections are sharded ``DTensor``s, the float32 HC parameters are
  replicated; logits, loss and every gradient agree.
- ``pp_size=2`` (dense, and a Qwen3 whose full and sliding layers fall on different stages): each stage holds its
  layers (and ``hc_head`` the last), the streams ``[B, T, n, C]`` cross the stage boundary; logits agree and greedy
  ``generate`` gives the same tokens (also for a left-padded row).
- ``fsdp_size=2`` (dense), each rank on its half of the batch: logits and every gradient, before any optimizer step.
- ``fsdp_size=2, fsdp_mixed_precision=True`` (dense): the backbone's units gathered in bf16, the HC units in
  float32 (FSDP units of their own, made by ``hf_mhc.distributed``); float32 HC gradients.
- ``fsdp_size=2, ep_size=2`` (MoE): each rank holds half of the experts; logits and every gradient.

Each rank prints ``rank R: PLAN matches (...)``: the largest logit error as a fraction of ``max|logits|``, the largest
gradient error as a fraction of the largest gradient entry, and how much of its tolerance (``FLOAT32_RTOL`` of each
tensor's scale plus ``GRADIENT_FLOOR``, see ``tolerances.py``) the worst gradient used.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parent))  # tolerances

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tolerances import FLOAT32_RTOL, assert_close_to_scale, gradient_atol  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402
from transformers.distributed.pipeline_parallel import PipelineIdentityLayer  # noqa: E402

import hf_mhc  # noqa: E402, F401  (registers model_type "mhc")

BATCH, LENGTH, NEW_TOKENS = 2, 9, 6


def is_hc(name: str) -> bool:
    return "_hc." in name or ".hc_head." in name


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def reference_run(checkpoint: str, input_ids: torch.Tensor):
    """The one-process model of ``checkpoint``, its logits and its gradients of the loss on ``input_ids``."""
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    logits = reference(input_ids).logits.detach()
    reference(input_ids, labels=input_ids).loss.backward()
    return reference, logits, {name: param.grad for name, param in reference.named_parameters()}


def check_gradients(model, expected: dict[str, torch.Tensor]) -> str:
    """Every gradient of ``model`` (gathered from its shards) against ``expected``; returns the largest error as a
    fraction of the largest expected gradient entry, and the largest fraction of its tolerance any tensor used."""
    atol = gradient_atol(list(expected.values()))
    scale = max(grad.abs().max().item() for grad in expected.values())
    error = used = 0.0
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        used = max(used, assert_close_to_scale(grad, expected[name], rtol=FLOAT32_RTOL, atol=atol,
                                               name=f"gradient of {name}"))
        error = max(error, (grad - expected[name]).abs().max().item() / scale)
    return f"gradients {error:.1e} of the largest, {used:.0%} of the tolerance"


def check_tensor_parallel(checkpoint: str, input_ids: torch.Tensor) -> str:
    reference, expected_logits, expected_grads = reference_run(checkpoint, input_ids)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(tp_size=2))
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert isinstance(q_proj, DTensor), type(q_proj)
    assert q_proj.to_local().shape[0] * 2 == reference.model.layers[0].self_attn.q_proj.weight.shape[0]
    for name, param in model.named_parameters():
        if is_hc(name):
            assert not isinstance(param, DTensor) and param.dtype == torch.float32, name
    logits = model(input_ids).logits
    assert_close_to_scale(logits, expected_logits, rtol=FLOAT32_RTOL, name="logits")
    model(input_ids, labels=input_ids).loss.backward()
    return f"logits {relative_error(logits, expected_logits):.1e}, {check_gradients(model, expected_grads)}"


def check_pipeline_parallel(checkpoint: str, input_ids: torch.Tensor) -> str:
    reference = AutoModelForCausalLM.from_pretrained(checkpoint).eval()
    model, loading = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(pp_size=2),
                                                          output_loading_info=True)
    model.eval()
    # A stage's tensors load there, the others' are skipped: hc_head's belong to the last stage, as the norm's.
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    rank, layers = dist.get_rank(), model.model.layers
    owned = [i for i, layer in enumerate(layers) if not isinstance(layer, PipelineIdentityLayer)]
    assert owned == list(range(*model._pp_stage.layer_range_for_rank(rank, len(layers)))), owned
    assert isinstance(model.model.hc_head, PipelineIdentityLayer) == (rank == 0)
    expected_parameters = dict(reference.named_parameters())
    for name, param in model.named_parameters():  # each stage loads its own tensors, the HC ones float32
        assert torch.equal(param, expected_parameters[name]), f"{name} was not loaded on rank {rank}"
        assert param.dtype == torch.float32 or not is_hc(name), name
    with torch.no_grad():
        logits = model(input_ids).logits
        expected_logits = reference(input_ids).logits
    assert_close_to_scale(logits, expected_logits, rtol=FLOAT32_RTOL, name="logits")
    # A left-padded row: each stage sizes its masks by a cache layer of its own (the first stage's are empty there).
    padding = torch.ones_like(input_ids)
    padding[1, :3] = 0
    greedy = dict(max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=padding, pad_token_id=0)
    tokens = model.generate(input_ids, **greedy)
    expected_tokens = reference.generate(input_ids, **greedy)
    assert torch.equal(tokens, expected_tokens), f"greedy tokens {tokens.tolist()} != {expected_tokens.tolist()}"
    return f"logits {relative_error(logits, expected_logits):.1e}, greedy tokens of a padded batch equal"


def check_fully_sharded(checkpoint: str, input_ids: torch.Tensor, **parallel) -> str:
    """Data parallel: rank r runs rows r of ``input_ids``, the reference all of them (equal token counts, so the mean
    of the two losses is the reference's loss and the averaged gradients are its gradients)."""
    reference, expected_logits, expected_grads = reference_run(checkpoint, input_ids)
    config = DistributedConfig(fsdp_size=2, **parallel)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=config)
    full_shapes = {name: param.shape for name, param in reference.named_parameters()}
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), name
        assert param.dtype == torch.float32 or not is_hc(name), name
        if ".experts." in name:  # expert parallel: this rank holds half of the experts
            assert param.to_local().shape[0] * 2 == full_shapes[name][0], (name, param.to_local().shape)
    assert config.ep_size == 1 or any(".experts." in name for name in full_shapes)
    rows = input_ids[dist.get_rank()::2]
    logits = model(rows).logits
    assert_close_to_scale(logits, expected_logits[dist.get_rank()::2], rtol=FLOAT32_RTOL, name="logits")
    model(rows, labels=rows).loss.backward()
    error = relative_error(logits, expected_logits[dist.get_rank()::2])
    return f"logits {error:.1e}, {check_gradients(model, expected_grads)}"


def check_fully_sharded_bf16(checkpoint: str, input_ids: torch.Tensor) -> str:
    """``fsdp_mixed_precision=True`` gathers transformers' units in bf16; the HC units are gathered, computed and
    reduced in float32 all the same."""
    reference, expected_logits, _ = reference_run(checkpoint, input_ids)
    model = AutoModelForCausalLM.from_pretrained(
        checkpoint, distributed_config=DistributedConfig(fsdp_size=2, fsdp_mixed_precision=True))
    gathered = {}

    def record(name, parameter_name):
        def hook(module, args):  # after FSDP's own pre-forward hook: the gathered parameter
            gathered.setdefault(name, getattr(module, parameter_name).dtype)
        return hook

    layer = model.model.layers[0]
    for name, module, parameter_name in (("attn_hc", layer.attn_hc, "fn"), ("hc_head", model.model.hc_head, "hc_fn"),
                                         ("q_proj", layer.self_attn.q_proj, "weight")):
        module.register_forward_pre_hook(record(name, parameter_name))
    rows = input_ids[dist.get_rank()::2]
    logits = model(rows).logits
    assert gathered == {"attn_hc": torch.float32, "hc_head": torch.float32, "q_proj": torch.bfloat16}, gathered
    # bf16 weights and activations in the backbone: within a few bf16 steps of the float32 logits.
    assert_close_to_scale(logits.float(), expected_logits[dist.get_rank()::2], rtol=2 ** -5, name="bf16 logits")
    model(rows, labels=rows).loss.backward()
    for name, param in model.named_parameters():
        if is_hc(name):
            assert isinstance(param.grad, DTensor) and param.grad.dtype == torch.float32, name
    error = relative_error(logits, expected_logits[dist.get_rank()::2])
    return f"HC units gathered in float32, the backbone's in bf16; logits {error:.1e}"


PLANS = {
    "tp_size=2": lambda checkpoints, input_ids: check_tensor_parallel(checkpoints["dense"], input_ids),
    # Mixed: a stage whose layers are all of one attention kind while the model has two.
    "pp_size=2": lambda checkpoints, input_ids: "; ".join(
        check_pipeline_parallel(checkpoints[name], input_ids) for name in ("dense", "mixed")),
    "fsdp_size=2": lambda checkpoints, input_ids: check_fully_sharded(checkpoints["dense"], input_ids),
    "fsdp_size=2, fsdp_mixed_precision": lambda checkpoints, input_ids: check_fully_sharded_bf16(
        checkpoints["dense"], input_ids),
    "fsdp_size=2, ep_size=2": lambda checkpoints, input_ids: check_fully_sharded(checkpoints["moe"], input_ids,
                                                                                ep_size=2),
}


def held_parameter_bytes(model) -> int:
    """Bytes of this rank's parameter shards (``DTensor.to_local()``; a tied parameter once)."""
    return sum((param.to_local() if isinstance(param, DTensor) else param).nbytes for param in model.parameters())


def check_planned_parameter_bytes(rank: int, checkpoints: list[str]) -> None:
    """``hf_mhc.planning.plan_memory``'s parameter bytes per device equal what the rank holding the most holds of each
    float32 checkpoint, under ``tp_size=2`` and under ``fsdp_size=2``. (Rank 0 holds the longest slice of every
    parameter, ``torch.chunk``'s; FSDP2 pads the other ranks' to it once it runs, and the plan counts that.)"""
    from hf_mhc.planning import plan_memory

    for checkpoint in checkpoints:
        for parallel, layout in (({"tp_size": 2}, {"tp": 2}), ({"fsdp_size": 2}, {"fsdp": 2})):
            model = AutoModelForCausalLM.from_pretrained(checkpoint, distributed_config=DistributedConfig(**parallel))
            held = [0, 0]
            dist.all_gather_object(held, held_parameter_bytes(model))
            planned = plan_memory(checkpoint, tokens=4, dtype="float32", **layout).parameter_bytes_per_device
            assert max(held) == planned, (checkpoint, parallel, held, planned)
            print(f"rank {rank}: {Path(checkpoint).name} {parallel}: ranks hold {held} B, planned {planned} B")


def run_plan(rank: int, plan: str, checkpoints: dict[str, str]) -> None:
    """Check ``plan`` (a key of ``PLANS``) on this rank of a 2-rank process group, on ``checkpoints`` (folders by
    name: ``dense``, ``mixed``, ``moe``)."""
    torch.manual_seed(0)
    summary = PLANS[plan](checkpoints, torch.randint(3, 90, (BATCH, LENGTH)))
    print(f"rank {rank}: {plan} matches ({summary})", flush=True)
