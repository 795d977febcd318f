"""Pipeline-parallel worker (one process per rank, gloo on CPU): ``pipeline_worker.py WORK SCHEDULE [SCHEDULE ...]``.

For each SCHEDULE in turn, every rank

1. builds the same tied model (``lm_head.weight is embed_tokens.weight``) as a one-process reference, runs one
   training step of that schedule on its stage(s) of ``split_pipeline``, sums the tied embedding's gradient over the
   ranks of the first and the last stage (``TiedEmbeddingSync``) and checks the loss, the logits and the gradients of
   its parameters against the reference. No optimizer step is taken, so all three are float32 sums in another order
   (per microbatch, then accumulated), compared to ``FLOAT32_RTOL`` of each tensor's largest entry. Then it takes
   ``STEPS`` AdamW steps, the reference too: after every step the two copies of the tied embedding are bit-equal, and
   at the end every parameter is within what AdamW's steps allow of the reference's;
2. runs ``examples/pipeline_finetune.py`` (its ``main``, in this launch's process group) with the options in
   ``WORK/finetune_args.json`` (which save a checkpoint at step 2), saving to ``WORK/SCHEDULE``.

Then the first SCHEDULE's run is resumed from its ``checkpoint-2`` into ``WORK/resumed``. The test compares the
saved folders with a one-process run of the example.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest's tiny configs

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import VOCAB, import_script, tiny_backbone_config  # noqa: E402
from tolerances import FLOAT32_RTOL, adamw_parameter_atol, assert_close_to_scale, gradient_atol  # noqa: E402
from torch.distributed.pipelining import (  # noqa: E402
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from hf_mhc import MHCConfig, MHCForCausalLM  # noqa: E402
from hf_mhc.distributed import TiedEmbeddingSync, split_pipeline  # noqa: E402

NUM_LAYERS = 4
N_MICROBATCHES = 4
BATCH, LENGTH = 8, 10
STEPS, LR = 3, 1e-3  # AdamW steps after the gradient check
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pipeline_finetune.py"


def shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of ``logits [B, T, V]`` against ``labels [B, T]``."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def build_schedule(name: str, rank: int, world_size: int, stage_modules: list) -> tuple[object, list[int]]:
    """The schedule over this rank's stages, and their stage indices."""
    if name in ("gpipe", "1f1b"):
        schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
        stage = PipelineStage(stage_modules[rank], rank, world_size, torch.device("cpu"))
        return schedule_class(stage, N_MICROBATCHES, loss_fn=shifted_cross_entropy), [rank]
    num_stages = 2 * world_size
    if name == "interleaved1f1b":
        local, schedule_class = [rank, rank + world_size], ScheduleInterleaved1F1B  # looped: stage s on rank s % W
    elif name == "dualpipev":
        local, schedule_class = [rank, num_stages - 1 - rank], ScheduleDualPipeV  # V-shaped: rank 0 first and last
    else:
        raise ValueError(f"unknown schedule {name!r}")
    stages = [PipelineStage(stage_modules[i], i, num_stages, torch.device("cpu")) for i in local]
    return schedule_class(stages, N_MICROBATCHES, loss_fn=shifted_cross_entropy), local


def stage_ranks(name: str, world_size: int) -> list[int]:
    """The rank running each stage (inverse of :func:`build_schedule`'s placement)."""
    if name in ("gpipe", "1f1b"):
        return list(range(world_size))
    if name == "interleaved1f1b":
        return [stage % world_size for stage in range(2 * world_size)]
    return [*range(world_size), *reversed(range(world_size))]  # dualpipev


def check_schedule(schedule_name: str, rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    config = MHCConfig(
        backbone_config=tiny_backbone_config("llama", num_hidden_layers=NUM_LAYERS, tie_word_embeddings=True),
        hc_mult=3,
        hc_init="deepseek_v4",  # random HC maps: every coefficient is token-dependent
    )
    model = MHCForCausalLM(config).train()
    reference = MHCForCausalLM(config).train()
    reference.load_state_dict(model.state_dict())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    input_ids = torch.randint(3, VOCAB, (BATCH, LENGTH))

    def reference_step() -> tuple[torch.Tensor, torch.Tensor]:
        logits = reference(input_ids).logits
        loss = shifted_cross_entropy(logits, input_ids)
        loss.backward()
        return logits, loss

    reference_logits, reference_loss = reference_step()

    num_stages = world_size if schedule_name in ("gpipe", "1f1b") else 2 * world_size
    stage_modules = split_pipeline(model, num_stages)
    tied = TiedEmbeddingSync(stage_modules, stage_ranks(schedule_name, world_size))
    schedule, local_stages = build_schedule(schedule_name, rank, world_size, stage_modules)
    holds_first, holds_last = 0 in local_stages, num_stages - 1 in local_stages

    def pipelined_step() -> tuple[list[torch.Tensor], torch.Tensor | None]:
        losses: list[torch.Tensor] = []
        step_kwargs = {"target": input_ids, "losses": losses} if holds_last else {}
        output = schedule.step(input_ids, **step_kwargs) if holds_first else schedule.step(**step_kwargs)
        tied.all_reduce_grad()
        return losses, output

    losses, output = pipelined_step()
    if holds_last:
        assert len(losses) == N_MICROBATCHES, losses
        assert_close_to_scale(torch.stack(losses).mean(), reference_loss, rtol=FLOAT32_RTOL, name="loss")
        assert_close_to_scale(output, reference_logits, rtol=FLOAT32_RTOL, name="logits")

    reference_parameters = dict(reference.named_parameters())  # the tied weight once, as model.embed_tokens.weight
    atol = gradient_atol([parameter.grad for parameter in reference_parameters.values()])
    # This rank's parameters by the reference's name: a copy of the tied embedding is model.embed_tokens.weight.
    local: list[tuple[str, torch.nn.Parameter]] = [
        ("model.embed_tokens.weight" if parameter is stage_modules[index].tied_embedding else name, parameter)
        for index in local_stages for name, parameter in stage_modules[index].named_parameters()]
    worst = 0.0  # the largest fraction of its tolerance a gradient used
    for name, parameter in local:
        assert parameter.grad is not None, f"{name} got no gradient"
        used = assert_close_to_scale(parameter.grad, reference_parameters[name].grad, rtol=FLOAT32_RTOL, atol=atol,
                                     name=f"{name}.grad")
        worst = max(worst, used)

    gathered: list[tuple[list[str], float]] = [([], 0.0) for _ in range(world_size)]
    dist.all_gather_object(gathered, ([name for name, _ in local], worst))
    all_names = [name for names, _ in gathered for name in names]
    assert set(all_names) == set(reference_parameters), set(reference_parameters) ^ set(all_names)
    assert all_names.count("model.embed_tokens.weight") == 2, "the first and the last stage each hold a copy"
    assert len(all_names) == len(set(all_names)) + 1, "a parameter other than the embedding lives on two stages"

    # AdamW steps: the copies of the tied embedding on the first and the last stage stay bit-equal.
    optimizer = torch.optim.AdamW([parameter for _, parameter in local], lr=LR)
    reference_optimizer = torch.optim.AdamW(reference_parameters.values(), lr=LR)
    for step in range(STEPS):
        optimizer.step()
        reference_optimizer.step()
        copies: list[list[torch.Tensor]] = [[] for _ in range(world_size)]
        dist.all_gather_object(copies, [weight.detach().clone() for weight in tied.copies])
        held = [weight for rank_copies in copies for weight in rank_copies]
        assert len(held) == 2 and torch.equal(held[0], held[1]), f"step {step + 1}: the tied copies differ"
        if step + 1 < STEPS:
            optimizer.zero_grad(set_to_none=True)
            reference_optimizer.zero_grad(set_to_none=True)
            reference_step()
            pipelined_step()
    for name, parameter in local:
        assert_close_to_scale(parameter, reference_parameters[name], rtol=FLOAT32_RTOL,
                              atol=adamw_parameter_atol(LR, STEPS), name=f"{name} after {STEPS} steps")
    if rank == 0:
        worst = max(used for _, used in gathered)
        print(f"{schedule_name}: loss {reference_loss.item():.6f}, {len(set(all_names))} parameters match "
              f"(at most {worst:.1%} of the tolerance); tied copies bit-equal after each of {STEPS} steps")


def run_example(work: Path, output: str, *extra: str) -> None:
    example = import_script(EXAMPLE)
    argv = [*json.loads((work / "finetune_args.json").read_text()), "--output-dir", str(work / output), *extra]
    assert example.main(argv) == 0


def main(work: Path, schedule_names: list[str]) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for schedule_name in schedule_names:
        check_schedule(schedule_name, rank, world_size)
        dist.barrier()
        run_example(work, schedule_name, "--schedule", schedule_name)
        dist.barrier()
    first = schedule_names[0]
    if rank == 0:  # an interrupted run: only its checkpoint at step 2
        shutil.copytree(work / first / "checkpoint-2", work / "resumed" / "checkpoint-2")
    dist.barrier()
    run_example(work, "resumed", "--schedule", first, "--resume")
    dist.barrier()
    if rank == 0:
        print(f"{first}: resumed from checkpoint-2")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
