"""Fine-tune an mHC causal LM with pipeline parallelism (hf_mhc.distributed.split_pipeline, Schedule1F1B), then
save it.

    torchrun --nproc_per_node=2 examples/pipeline_finetune.py --steps 20 --output-dir outputs/pipeline
    torchrun --nproc_per_node=4 examples/pipeline_finetune.py --model MHC_FOLDER --batch-size 16 --microbatches 8 \\
        --output-dir OUT

Rank r holds stage r of ``split_pipeline(model, world_size)``: consecutive decoder layers, stage 0 also the
embedding, the last stage also ``hc_head``, the final norm and ``lm_head``. Between the stages travel the mHC streams
``[B, T, n, C]``. Each step feeds --batch-size sequences, cut into --microbatches, through the 1F1B schedule, and
every rank steps AdamW on its own stage. Backend: NCCL on GPUs (one per rank), gloo on CPU.

Tied embeddings (``lm_head.weight is embed_tokens.weight``, as in stories260K) sit on the first and the last stage:
``untie_word_embeddings=True`` gives the last stage its own copy of ``lm_head``, trained separately from then on, so
the saved folder has ``tie_word_embeddings: false``.

--model, --dataset: as in examples/fsdp2_finetune.py (default: stories260K upcycled, or a tiny random Llama; Jane
Austen's novels, or pydoc_data). Output (--output-dir, empty or new unless --overwrite): rank 0 gathers every stage's
state dict, whose tensors keep their full-model names, and writes an ordinary mHC folder that
``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared helpers of fsdp2_finetune.py

from fsdp2_finetune import (  # noqa: E402
    check_block_size,
    load_model,
    parse_args,
    start_distributed,
    token_blocks,
)


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits [B, T, V]`` predicting ``labels [B, T]`` one position ahead."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from hf_mhc.distributed import split_pipeline

    def microbatch_option(parser):
        parser.add_argument("--microbatches", type=int, default=2,
                            help="microbatches per step; must divide --batch-size (default 2)")

    parser, args = parse_args(__doc__, argv, "sequences per step, split into --microbatches (default 4)",
                              microbatch_option)
    if args.microbatches < 1 or args.batch_size % args.microbatches:
        parser.error(f"--microbatches {args.microbatches} must be >= 1 and divide --batch-size {args.batch_size}")
    rank, world_size, device = start_distributed()
    if world_size < 2:
        sys.exit("a pipeline needs 2 or more ranks: torchrun --nproc_per_node=2 ...")
    model, tokenizer, description = load_model(args)
    check_block_size(model, args.block_size)
    if world_size > len(model.model.layers):
        sys.exit(f"{world_size} ranks but the model has {len(model.model.layers)} decoder layers: use fewer ranks")
    blocks = token_blocks(tokenizer, args.dataset, args.steps * args.batch_size, args.block_size)
    is_first, is_last = rank == 0, rank == world_size - 1
    if is_first:
        print(f"model: {description}; {world_size} stages, {args.batch_size} sequences of {args.block_size} per "
              f"step in {args.microbatches} microbatches")

    was_tied = model.lm_head.weight is model.model.embed_tokens.weight
    stages = split_pipeline(model.train(), num_stages=world_size, untie_word_embeddings=True)
    stage_module = stages[rank].to(device)
    schedule = Schedule1F1B(PipelineStage(stage_module, rank, world_size, device),
                            n_microbatches=args.microbatches, loss_fn=next_token_loss)
    optimizer = torch.optim.AdamW(stage_module.parameters(), lr=args.lr)
    for step in range(args.steps):
        batch = blocks[step * args.batch_size : (step + 1) * args.batch_size].to(device)
        losses: list[torch.Tensor] = []
        if is_first:
            schedule.step(batch)
        elif is_last:
            schedule.step(target=batch, losses=losses)
        else:
            schedule.step()
        optimizer.step()
        optimizer.zero_grad()
        if is_last:
            loss = torch.stack(losses).mean().item()
            if not math.isfinite(loss):
                sys.exit(f"step {step + 1}: the loss is {loss}; lower --lr")
            print(f"step {step + 1}/{args.steps}: loss {loss:.4f}", flush=True)

    # Stage state dicts use the full model's names: rank 0 gathers them and saves one folder.
    local_state = {name: tensor.detach().cpu() for name, tensor in stage_module.state_dict().items()}
    gathered: list[dict[str, torch.Tensor]] | None = [{} for _ in range(world_size)] if is_first else None
    dist.gather_object(local_state, gathered, dst=0)
    if is_first:
        state = {name: tensor for stage_state in gathered for name, tensor in stage_state.items()}
        if was_tied and world_size > 1:  # lm_head was trained as the last stage's own copy
            model.config.tie_word_embeddings = False
            model.config.backbone_config.tie_word_embeddings = False
        model.save_pretrained(args.output_dir, state_dict=state)
        tokenizer.save_pretrained(args.output_dir)
        print(f"saved {args.output_dir}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
