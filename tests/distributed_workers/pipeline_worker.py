"""Pipeline-parallel worker (one process per rank, gloo on CPU): ``pipeline_worker.py SCHEDULE [SCHEDULE ...]``.

For each SCHEDULE in turn, every rank builds the same model as a one-process reference, runs one training step of
that schedule on its stage(s) of ``split_pipeline`` and checks the loss, the logits and the gradients of its
parameters against the reference. No optimizer step is taken, so all three are float32 sums in another order
(per microbatch, then accumulated), compared to ``FLOAT32_RTOL`` of each tensor's largest entry.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's tiny configs

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import VOCAB, tiny_backbone_config  # noqa: E402
from tolerances import FLOAT32_RTOL, assert_close_to_scale, gradient_atol  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # noqa: E402

from hf_mhc import MHCConfig, MHCForCausalLM  # noqa: E402
from hf_mhc.distributed import split_pipeline  # noqa: E402

NUM_LAYERS = 4
N_MICROBATCHES = 4
BATCH, LENGTH = 8, 10


def shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of ``logits [B, T, V]`` against ``labels [B, T]``."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def build_schedule(name: str, rank: int, world_size: int, stage_modules: list) -> tuple[object, list[int]]:
    """The schedule over this rank's stages, and their stage indices."""
    if name in ("gpipe", "1f1b"):
        schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
        stage = PipelineStage(stage_modules[rank], rank, world_size, torch.device("cpu"))
        return schedule_class(stage, N_MICROBATCHES, loss_fn=shifted_cross_entropy), [rank]
    if name == "dualpipev":
        from torch.distributed.pipelining.schedules import ScheduleDualPipeV

        num_stages = 2 * world_size
        local = [rank, num_stages - 1 - rank]  # V-shaped: rank 0 holds the first and the last stage
        stages = [PipelineStage(stage_modules[i], i, num_stages, torch.device("cpu")) for i in local]
        return ScheduleDualPipeV(stages, N_MICROBATCHES, loss_fn=shifted_cross_entropy), local
    raise ValueError(f"unknown schedule {name!r}")


def check_schedule(schedule_name: str, rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    config = MHCConfig(
        backbone_config=tiny_backbone_config("llama", num_hidden_layers=NUM_LAYERS),
        hc_mult=3,
        hc_init="deepseek_v4",  # random HC maps: every coefficient is token-dependent
    )
    model = MHCForCausalLM(config).train()
    reference = MHCForCausalLM(config).train()
    reference.load_state_dict(model.state_dict())
    input_ids = torch.randint(3, VOCAB, (BATCH, LENGTH))

    reference_logits = reference(input_ids).logits
    reference_loss = shifted_cross_entropy(reference_logits, input_ids)
    reference_loss.backward()

    num_stages = 2 * world_size if schedule_name == "dualpipev" else world_size
    stage_modules = split_pipeline(model, num_stages)
    schedule, local_stages = build_schedule(schedule_name, rank, world_size, stage_modules)
    holds_first, holds_last = 0 in local_stages, num_stages - 1 in local_stages
    losses: list[torch.Tensor] = []
    step_kwargs = {"target": input_ids, "losses": losses} if holds_last else {}
    output = schedule.step(input_ids, **step_kwargs) if holds_first else schedule.step(**step_kwargs)

    if holds_last:
        assert len(losses) == N_MICROBATCHES, losses
        assert_close_to_scale(torch.stack(losses).mean(), reference_loss, rtol=FLOAT32_RTOL, name="loss")
        assert_close_to_scale(output, reference_logits, rtol=FLOAT32_RTOL, name="logits")

    reference_parameters = dict(reference.named_parameters())
    atol = gradient_atol([parameter.grad for parameter in reference_parameters.values()])
    local_names, worst = [], 0.0  # worst: the largest fraction of its tolerance a gradient used
    for index in local_stages:
        for name, parameter in stage_modules[index].named_parameters():
            local_names.append(name)
            assert parameter.grad is not None, f"stage {index}: {name} got no gradient"
            used = assert_close_to_scale(parameter.grad, reference_parameters[name].grad, rtol=FLOAT32_RTOL,
                                         atol=atol, name=f"stage {index}: {name}.grad")
            worst = max(worst, used)

    gathered: list[tuple[list[str], float]] = [([], 0.0) for _ in range(world_size)]
    dist.all_gather_object(gathered, (local_names, worst))
    all_names = [name for names, _ in gathered for name in names]
    assert len(all_names) == len(set(all_names)), "a parameter lives on two stages"
    assert set(all_names) == set(reference_parameters), set(reference_parameters) ^ set(all_names)
    if rank == 0:
        worst = max(used for _, used in gathered)
        print(f"{schedule_name}: loss {reference_loss.item():.6f}, {len(all_names)} parameters match "
              f"(at most {worst:.1%} of the tolerance)")


def main(schedule_names: list[str]) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for schedule_name in schedule_names:
        check_schedule(schedule_name, rank, world_size)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
