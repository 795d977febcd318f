"""FSDP2 worker (one process per rank, gloo on CPU): ``fsdp_worker.py OUTPUT_DIR``. Runs both scenarios in one launch.

- parity: a sharded float32 model, each rank on its half of the global batch, against one process on the whole batch.
  Before any optimizer step the loss and every gradient agree to float32 rounding (``FLOAT32_RTOL`` of each tensor's
  scale); after three AdamW steps the parameters agree within the bound AdamW itself justifies
  (``adamw_parameter_atol``). The full state dict gathered on rank 0 saves with ``save_pretrained`` to
  ``OUTPUT_DIR/checkpoint``, reloads to exactly the gathered tensors and to the sharded model's logits.
- bf16: a bf16 model (tied embeddings) whose HC modules stay float32 shards, trains with a bf16 mixed-precision
  policy, keeps its HC parameters (and their gradients) in float32, and matches the one-process loss to bf16 rounding.

Every warning is recorded; each rank prints how many said that an FSDP2 unit "returned a view tensor".
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's tiny configs

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from conftest import VOCAB, tiny_backbone_config  # noqa: E402
from tolerances import (  # noqa: E402
    BFLOAT16_RTOL,
    FLOAT32_RTOL,
    adamw_parameter_atol,
    assert_close_to_scale,
    gradient_atol,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from hf_mhc import MHCConfig, MHCForCausalLM  # noqa: E402
from hf_mhc.distributed import apply_fsdp2  # noqa: E402

STEPS = 3
LR = 1e-3
GLOBAL_BATCH, LENGTH = 4, 12
VIEW_WARNING = "returned a view tensor"


def tiny_config(**backbone_overrides) -> MHCConfig:
    return MHCConfig(
        backbone_config=tiny_backbone_config("llama", **backbone_overrides),
        hc_mult=3,
        hc_init="deepseek_v4",  # random HC maps: every coefficient is token-dependent and gets a real gradient
    )


def twin_models(config: MHCConfig, dtype: torch.dtype) -> tuple[MHCForCausalLM, MHCForCausalLM]:
    """Two models with the same weights: one to shard, one to train in this process as the reference."""
    torch.manual_seed(0)
    model = MHCForCausalLM._from_config(config, dtype=dtype).train()
    reference = MHCForCausalLM._from_config(config, dtype=dtype).train()
    reference.load_state_dict(model.state_dict())
    return model, reference


def local_rows(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per_rank = batch.shape[0] // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]


def parity(output_dir: Path, rank: int, world_size: int) -> None:
    model, reference = twin_models(tiny_config(), torch.float32)
    batches = [torch.randint(3, VOCAB, (GLOBAL_BATCH, LENGTH)) for _ in range(STEPS)]
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=LR)
    apply_fsdp2(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)

    for module in (model, model.model.layers[0], model.model.layers[1].ffn_hc, model.model.hc_head):
        assert isinstance(module, FSDPModule), f"{type(module).__name__} is not an FSDP unit"
    for name, parameter in model.named_parameters():
        assert isinstance(parameter, DTensor), f"{name} is not sharded"

    reference_parameters = dict(reference.named_parameters())
    worst_gradient = 0.0  # the largest fraction of its tolerance a gradient used
    for step, batch in enumerate(batches):
        reference_loss = reference(batch, labels=batch).loss
        reference_loss.backward()
        local = local_rows(batch, rank, world_size)
        loss = model(local, labels=local).loss
        loss.backward()
        if step == 0:  # equal parameters: only the order of the sums differs
            mean_loss = loss.detach().clone()
            dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)  # equal halves: the mean of the means
            assert_close_to_scale(mean_loss, reference_loss, rtol=FLOAT32_RTOL, name="loss")
            atol = gradient_atol([parameter.grad for parameter in reference_parameters.values()])
            for name, parameter in model.named_parameters():
                gradient = parameter.grad.full_tensor()  # a collective: every rank, same order
                used = assert_close_to_scale(gradient, reference_parameters[name].grad, rtol=FLOAT32_RTOL,
                                             atol=atol, name=f"{name}.grad")
                worst_gradient = max(worst_gradient, used)
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        optimizer.step()
        optimizer.zero_grad()

    atol = adamw_parameter_atol(LR, STEPS)
    for name, parameter in model.named_parameters():
        assert_close_to_scale(parameter.full_tensor(), reference_parameters[name], rtol=0.0, atol=atol, name=name)

    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    probe = torch.randint(3, VOCAB, (2, LENGTH))
    with torch.no_grad():
        sharded_logits = model(probe).logits  # a collective: every rank runs it
    if rank == 0:
        assert set(full_state) == set(reference.state_dict()), set(full_state) ^ set(reference.state_dict())
        checkpoint = output_dir / "checkpoint"
        model.save_pretrained(checkpoint, state_dict=full_state)
        reloaded = MHCForCausalLM.from_pretrained(checkpoint).eval()
        reloaded_state = reloaded.state_dict()
        for name, tensor in full_state.items():
            assert torch.equal(reloaded_state[name], tensor), f"{name} changed in the checkpoint"
        with torch.no_grad():
            reloaded_logits = reloaded(probe).logits
        # The same parameters on one rank: the same sums, up to the order of a few reductions.
        assert_close_to_scale(sharded_logits, reloaded_logits, rtol=FLOAT32_RTOL, name="logits")
        print(f"parity: loss and gradients match (at most {worst_gradient:.1%} of the tolerance), "
              f"{STEPS} AdamW steps within {atol:.2g}, checkpoint reloads")


def bf16(rank: int, world_size: int) -> None:
    model, reference = twin_models(tiny_config(tie_word_embeddings=True), torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    hc_names = {name for name, p in model.named_parameters() if p.dtype == torch.float32}
    expected_hc = {name for name in hc_names if "_hc." in name or ".hc_head." in name}
    assert hc_names and hc_names == expected_hc, f"float32 parameters outside the HC modules: {hc_names}"

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    apply_fsdp2(model, mp_policy=policy, reshard_after_forward=False)  # ZeRO-2 for the layers
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batch = torch.randint(3, VOCAB, (GLOBAL_BATCH, LENGTH))
    reference_loss = reference(batch, labels=batch).loss

    local = local_rows(batch, rank, world_size)
    loss = model(local, labels=local).loss
    loss.backward()
    for name, parameter in model.named_parameters():
        expected_dtype = torch.float32 if name in hc_names else torch.bfloat16
        assert parameter.dtype == expected_dtype, f"{name}: {parameter.dtype}"
        assert parameter.grad is not None and parameter.grad.dtype == expected_dtype, f"{name}: gradient"
        assert torch.isfinite(parameter.grad.full_tensor()).all(), f"{name}: non-finite gradient"
    optimizer.step()
    mean_loss = loss.detach().float()
    dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
    assert_close_to_scale(mean_loss, reference_loss.detach().float(), rtol=BFLOAT16_RTOL, name="bf16 loss")
    with torch.no_grad():
        after_step = model(local, labels=local).loss.float()
    assert torch.isfinite(after_step), after_step
    if rank == 0:
        print(f"bf16: loss {mean_loss.item():.4f} (reference {reference_loss.item():.4f}), HC kept float32")


def main(output_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parity(Path(output_dir), rank, world_size)
        bf16(rank, world_size)
    views = sorted({str(warning.message) for warning in caught if VIEW_WARNING in str(warning.message)})
    print(f"rank {rank}: {len(views)} view warnings" + "".join(f"\n  {message}" for message in views))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
