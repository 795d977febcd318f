"""Fine-tune an mHC causal LM with pipeline parallelism (hf_mhc.distributed.split_pipeline and a
torch.distributed.pipelining schedule), then save it.

    torchrun --nproc_per_node=2 examples/pipeline_finetune.py --steps 20 --output-dir outputs/pipeline
    torchrun --nproc_per_node=4 examples/pipeline_finetune.py --model MHC_FOLDER --schedule interleaved1f1b \\
        --batch-size 16 --microbatches 8 --save-every 100 --output-dir OUT
    python examples/pipeline_finetune.py --model MHC_FOLDER --output-dir OUT     # one process, no pipeline

Stages: ``split_pipeline(model, S)`` cuts the model into S stages of consecutive decoder layers (stage 0 also holds
the embedding, the last stage ``hc_head``, the final norm and ``lm_head``); the mHC streams ``[B, T, n, C]`` travel
between them. --schedule gpipe and 1f1b give rank r stage r (S = world size); interleaved1f1b and dualpipev give every
rank two stages (S = 2 x world size): rank r holds stages r and r + world size (interleaved, looped) or r and
S - 1 - r (DualPipeV, V-shaped). Backend: NCCL on GPUs (one per rank), gloo on CPU.

Each step feeds --batch-size sequences, cut into --microbatches, through the schedule: the gradient is the mean over
the microbatches of each one's mean next-token loss. Every rank then clips its gradients by the global norm (the
squared norms of all stages all-reduced) and steps AdamW on its stages, with a linear warm-up and a cosine decay of
the learning rate. Run without torchrun (or with one rank), the script trains the whole model in one process on the
same microbatches with the same gradient accumulation, so it reaches the weights of the pipelined run.

Tied embeddings (``lm_head.weight is embed_tokens.weight``, as in stories260K) stay tied: the first and the last
stage each hold a copy of the weight, and after each backward both get the sum of their gradients (over their two
ranks, ``hf_mhc.distributed.TiedEmbeddingSync``), so both take the same AdamW step and stay equal; the saved folder
keeps ``tie_word_embeddings: true`` and one tensor. --untie-word-embeddings gives ``lm_head`` its own copy before
training instead (in every mode, so all modes train the same parameters), saved with ``tie_word_embeddings: false``.

--model: an mHC folder (or a residual one with --upcycle). Default: ../shared/assets/stories260K upcycled when that
folder exists. --dataset: a Hugging Face Hub dataset id, or local .txt / .json / .jsonl / .csv / .parquet files (a
path, a glob or a folder). Default: Jane Austen's novels from ../shared/assets/janeausten when present, else Python's
own help texts (pydoc_data). Texts are tokenised, joined with EOS and cut into --block-size blocks, which every step
draws from a --seed shuffle (reshuffled after each pass over the data); null and empty texts are skipped.

Output (--output-dir, new or empty unless --overwrite or --resume): rank 0 gathers every stage's state dict (their
tensors keep the full model's names) and writes an ordinary mHC folder that ``AutoModelForCausalLM.from_pretrained``
loads, with the tokenizer and ``trainer_state.json`` (the run's options and the loss, learning rate and gradient norm
of every step). Every --save-every steps the same goes to OUTPUT_DIR/checkpoint-STEP, plus ``optimizer.pt`` (every
rank's AdamW state), ``scheduler.pt`` and ``rng_state_RANK.pth``, written into a hidden .checkpoint-STEP.partial-*
folder that is renamed when the save is complete: a save that fails (a full disk) stops the run with one line and
leaves nothing, a killed one leaves only that hidden folder.

--resume continues the newest complete checkpoint (or the given one) on the same number of ranks with the same
options, and reaches the losses and weights of an uninterrupted run. It says which checkpoint it takes and which newer
folders it skipped (incomplete ones, interrupted saves); it deletes nothing. An incomplete checkpoint-STEP (no whole
trainer_state.json, which a save writes last) of a step it will save again is set aside first, renamed to
incomplete-checkpoint-STEP.XXXX, with one line saying so; a complete one there (or a file) is never replaced or moved:
--resume refuses to run. A checkpoint with a file missing, cut short or damaged is refused with one line naming the
file. --steps may grow: the warm-up stays the saved run's (a --warmup-steps given must match it), the first
resumed step keeps the learning rate the saved run would have used, and from the next one the cosine decay runs to the
new --steps, as Trainer does. --overwrite first deletes the earlier run's results from --output-dir (as
examples/finetune.py).

Bad input (a missing --model, unusable dataset files or no text in them, --microbatches that do not divide
--batch-size or that the schedule cannot run, more stages than decoder layers, a non-empty --output-dir, ...) stops
every rank with one "pipeline_finetune.py: error: ..." line before any process group is started.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pickle
import random
import sys
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import SafetensorError
from transformers import AutoTokenizer, get_cosine_schedule_with_warmup, set_seed

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helpers of finetune.py, fsdp2_finetune.py, example_utils

import example_utils  # noqa: E402
import finetune  # noqa: E402  (dataset loading, the --model / --output-dir checks)
from example_utils import STATE_FILE, add_example_option  # noqa: E402
from fsdp2_finetune import start_distributed  # noqa: E402

import hf_mhc  # noqa: E402
from hf_mhc.common import first_line  # noqa: E402
from hf_mhc.distributed import TiedEmbeddingSync, split_pipeline  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "dualpipev")
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved1f1b": 2, "dualpipev": 2}
# The options a resumed run must share with the run it continues (--steps may grow); it must also run on as many ranks
# (world_size, which torchrun sets). A checkpoint's trainer_state.json holds all of SAVED_OPTIONS.
RUN_OPTIONS = ("schedule", "microbatches", "batch_size", "block_size", "seed", "lr", "warmup_steps", "weight_decay",
               "max_grad_norm")
SAVED_OPTIONS = (*RUN_OPTIONS, "world_size", "steps", "num_stages")
TORCH_LOAD_ERRORS = (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError)


def parse_args(argv: list[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="pipeline_finetune.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    finetune.add_model_and_data_arguments(parser, block_size=64)
    train = parser.add_argument_group("training")
    train.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule (default 1f1b)")
    add_example_option(train, "--steps", default=20)
    train.add_argument("--batch-size", type=int, default=4, help="sequences per step (default 4)")
    train.add_argument("--microbatches", type=int, default=2,
                       help="microbatches per step; must divide --batch-size (default 2)")
    train.add_argument("--lr", type=example_utils.learning_rate, default=5e-4,
                       help="peak AdamW learning rate (default 5e-4)")
    add_example_option(train, "--warmup-steps")
    add_example_option(train, "--weight-decay")
    train.add_argument("--max-grad-norm", type=float, default=1.0,
                       help="clip the global gradient norm to this (default 1.0; 0: no clipping)")
    add_example_option(train, "--seed")
    train.add_argument("--output-dir", required=True, help="new or empty folder for the trained model")
    train.add_argument("--overwrite", action="store_true",
                       help="reuse the --output-dir of an earlier run: delete its results first")
    train.add_argument("--save-every", type=int, default=0,
                       help="save a checkpoint every N steps to OUTPUT_DIR/checkpoint-N (default 0: none)")
    add_example_option(train, "--resume")
    train.add_argument("--untie-word-embeddings", action="store_true",
                       help="give a tied lm_head its own copy of the embedding before training (default: keep it tied)")
    parser.set_defaults(lora=False)  # finetune.py's checks also serve its LoRA mode
    args = parser.parse_args(argv)

    if args.model is None:
        if not example_utils.STORIES260K.is_dir():
            parser.error("--model is required (the default ../shared/assets/stories260K is not present)")
        args.model, args.upcycle = str(example_utils.STORIES260K), True
    for name in ("steps", "batch_size", "microbatches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.save_every < 0 or args.max_grad_norm < 0:
        parser.error("--save-every and --max-grad-norm must be >= 0")
    if args.hc_mult is not None and not args.upcycle:
        parser.error("--hc-mult only applies with --upcycle (an mHC checkpoint keeps its own number of streams)")
    if args.resume is not None and args.overwrite:
        parser.error("--resume continues the run in --output-dir, --overwrite replaces it: choose one")
    if args.batch_size % args.microbatches:
        parser.error(f"--microbatches {args.microbatches} does not divide --batch-size {args.batch_size}: choose a "
                     "divisor (each microbatch gets batch-size / microbatches sequences)")
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun sets it; the process group comes later
    args.num_stages = STAGES_PER_RANK[args.schedule] * args.world_size if args.world_size > 1 else 1
    schedule_error = microbatch_error(args.schedule, args.microbatches, args.world_size, args.num_stages)
    if schedule_error is not None:
        parser.error(schedule_error)
    return parser, args


def microbatch_error(schedule: str, microbatches: int, world_size: int, num_stages: int) -> str | None:
    """Why ``schedule`` cannot run ``microbatches`` on ``world_size`` ranks (torch's own conditions), else None."""
    if world_size < 2:
        return None
    if schedule == "1f1b" and microbatches < num_stages:
        return f"--schedule 1f1b needs --microbatches >= the {num_stages} stages, got {microbatches}"
    if schedule == "dualpipev" and microbatches < num_stages:
        return f"--schedule dualpipev needs --microbatches >= the {num_stages} stages (2 per rank), got {microbatches}"
    rounds = max(1, microbatches // world_size)
    if schedule == "interleaved1f1b" and microbatches % rounds:
        return (f"--schedule interleaved1f1b runs --microbatches in rounds of {world_size} (one per rank): use a "
                f"multiple of {world_size} or fewer than {world_size}, got {microbatches}")
    return None


def local_stage_indices(schedule: str, rank: int, world_size: int) -> list[int]:
    """The stages rank ``rank`` holds, in the order its schedule takes them."""
    if STAGES_PER_RANK[schedule] == 1:
        return [rank]
    if schedule == "interleaved1f1b":
        return [rank, rank + world_size]
    return [rank, 2 * world_size - 1 - rank]  # dualpipev: V-shaped, rank 0 holds the first and the last stage


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits [B, T, V]`` predicting ``labels [B, T]`` one position ahead."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def batch_indices(step: int, batch_size: int, num_blocks: int, seed: int) -> list[int]:
    """The blocks of step ``step`` (0-based): consecutive positions of a stream of shuffles of all blocks, one
    shuffle (seeded by ``seed`` and the pass) per pass, so a resumed run draws the blocks of an uninterrupted one."""
    indices = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_blocks)
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        indices.append(int(order[offset]))
    return indices


def untie_lm_head(model: hf_mhc.MHCForCausalLM) -> bool:
    """Give a tied ``lm_head`` its own copy of the embedding (and say so in the config); whether it was tied."""
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        return False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    model.config.backbone_config.tie_word_embeddings = False
    return True


def stage_ranks(schedule: str, world_size: int, num_stages: int) -> list[int]:
    """The rank that runs each stage (the inverse of :func:`local_stage_indices`)."""
    ranks = [0] * num_stages
    for rank in range(world_size):
        for index in local_stage_indices(schedule, rank, world_size):
            ranks[index] = rank
    return ranks


def clip_global_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float, distributed: bool,
                          duplicate: torch.nn.Parameter | None = None) -> float:
    """Scale the gradients of ``parameters`` (this rank's, summed over all ranks when ``distributed``) to a global
    L2 norm of at most ``max_norm`` (``0``: no clipping); return the norm before clipping. The squares are summed
    in float64, so the norm does not depend on how the parameters are split into stages; ``duplicate`` (the last
    stage's copy of a tied embedding, whose first copy is counted) is scaled but not counted."""
    gradients = [parameter.grad for parameter in parameters if parameter.grad is not None]
    device = gradients[0].device if gradients else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for parameter in parameters:
        if parameter.grad is not None and parameter is not duplicate:
            squares += torch.linalg.vector_norm(parameter.grad, dtype=torch.float64).square()
    if distributed:
        dist.all_reduce(squares)
    norm = squares.sqrt()
    if max_norm > 0:
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for gradient in gradients:
            gradient.mul_(coefficient.to(gradient.dtype))
    return norm.item()


def cpu_copy(value):
    """``value`` (a state dict: nested dicts, lists and tensors) with every tensor detached onto the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: cpu_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cpu_copy(item) for item in value)
    return value


def rng_state() -> dict:
    state = {"python": random.getstate(), "cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Resumed(NamedTuple):
    """The checkpoint a run continues from, and this rank's training state loaded from it."""

    checkpoint: Path
    skipped: str  # a note on the newer folders left alone, "" when none
    in_the_way: list[tuple[Path, str]]  # incomplete checkpoints this run would save again, to set aside, and why
    global_step: int
    log_history: list[dict]
    optimizer: dict
    scheduler: dict
    rng: dict


def load_torch_file(parser: argparse.ArgumentParser, checkpoint: Path, name: str, **kwargs):
    """``torch.load`` of ``checkpoint / name``; a file that does not load ends in one ``parser.error`` line."""
    try:
        return torch.load(checkpoint / name, weights_only=True, **kwargs)
    except TORCH_LOAD_ERRORS as error:
        parser.error(f"--resume {checkpoint}: {name} does not load ({first_line(error)})")


def resume_point(parser: argparse.ArgumentParser, args: argparse.Namespace, out: Path) -> Resumed | None:
    """The checkpoint --resume names (``None`` without --resume), checked before any process group: complete, saved
    with this run's options, whole (every rank's file there and readable), and no later checkpoint of this run
    already in ``out`` (an incomplete one there is to be set aside, see :class:`Resumed`). Sets a --warmup-steps not
    given to the saved run's."""
    if args.resume is None:
        return None
    checkpoint, state, skipped = example_utils.checkpoint_to_resume(parser, args.resume, out)
    saved = state.get("options") if isinstance(state, dict) else None
    if not (isinstance(saved, dict) and set(SAVED_OPTIONS) <= set(saved) and isinstance(state.get("global_step"), int)
            and isinstance(state.get("log_history"), list)):
        parser.error(f"--resume {checkpoint}: its {STATE_FILE} is not one this script writes (no global_step, "
                     "options and log_history)")
    if args.warmup_steps is None:
        args.warmup_steps = saved["warmup_steps"]
    differing = [f"--{name.replace('_', '-')} {saved[name]!r} (now {getattr(args, name)!r})"
                 for name in RUN_OPTIONS if saved[name] != getattr(args, name)]
    if saved["world_size"] != args.world_size:
        differing.append(f"ranks (torchrun --nproc-per-node) {saved['world_size']} (now {args.world_size})")
    if differing:
        parser.error(f"--resume {checkpoint} was saved by a run with {', '.join(differing)}: run it as that run ran")
    step = state["global_step"]
    if step >= args.steps:
        parser.error(f"--resume {checkpoint} is at step {step}, not before --steps {args.steps}")
    again = [out / f"checkpoint-{later}" for later in range(step + 1, args.steps)
             if args.save_every and later % args.save_every == 0]
    in_the_way = example_utils.incomplete_in_the_way(parser, checkpoint, step,
                                                     [folder for folder in again if os.path.lexists(folder)])
    weights = "model.safetensors.index.json" if (checkpoint / "model.safetensors.index.json").exists() else (
        "model.safetensors")
    ranks = range(args.world_size)
    for name in ("config.json", weights, "optimizer.pt", "scheduler.pt", *(f"rng_state_{rank}.pth" for rank in ranks)):
        if not (checkpoint / name).exists():
            parser.error(f"--resume {checkpoint}: {name} is missing; not a whole checkpoint")
    damaged = example_utils.damaged_file(checkpoint)
    if damaged is not None:
        parser.error(f"--resume {checkpoint}: {damaged}")
    rank = int(os.environ.get("RANK", "0"))
    optimizer = load_torch_file(parser, checkpoint, "optimizer.pt", mmap=True)
    if not (isinstance(optimizer, dict) and isinstance(optimizer.get("ranks"), list)
            and len(optimizer["ranks"]) == args.world_size):
        parser.error(f"--resume {checkpoint}: optimizer.pt holds no AdamW state for each of the {args.world_size} "
                     "ranks")
    rng = [load_torch_file(parser, checkpoint, f"rng_state_{index}.pth") for index in ranks]  # every rank checks all
    return Resumed(checkpoint=checkpoint, skipped=skipped, in_the_way=in_the_way, global_step=step,
                   log_history=state["log_history"], optimizer=optimizer["ranks"][rank],
                   scheduler=load_torch_file(parser, checkpoint, "scheduler.pt"), rng=rng[rank])


def check_args_before_work(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """Every check that needs no process group: paths, the checkpoint to resume, the model, the data. Returns the
    output folder, the :class:`Resumed` point (or None), the model, the tokenizer, the token blocks and a description
    of the data."""
    out = finetune.check_paths(parser, args)
    resumed = resume_point(parser, args, out)
    if args.warmup_steps is None:
        args.warmup_steps = args.steps // 10
    model = finetune.load_model(parser, args)
    if resumed is not None:
        finetune.check_resume_fits(parser, args, str(resumed.checkpoint), model)
        model = example_utils.load_causal_lm(parser, str(resumed.checkpoint), option="--resume", dtype=torch.float32)
        if args.untie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight:
            parser.error(f"--resume {resumed.checkpoint} kept its word embeddings tied: drop --untie-word-embeddings")
    num_layers = len(model.model.layers)
    if args.num_stages > num_layers:
        fewer = " or a schedule of one stage per rank (gpipe, 1f1b)" if args.num_stages > args.world_size else ""
        parser.error(f"--schedule {args.schedule} on {args.world_size} ranks makes {args.num_stages} stages, but the "
                     f"model has {num_layers} decoder layers: use fewer ranks{fewer}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    except (OSError, ValueError, TypeError) as exc:
        parser.error(f"no tokenizer for {args.tokenizer or args.model} ({first_line(exc)}); pass --tokenizer")
    positions = model.config.backbone_config.max_position_embeddings
    if args.block_size > positions:
        parser.error(f"--block-size {args.block_size} exceeds the model's {positions} positions")
    texts, corpus = finetune.load_texts(parser, args)
    blocks = example_utils.dataset_token_blocks(texts, tokenizer, args.text_column, args.block_size)
    if len(blocks) < args.batch_size:
        parser.error(f"the dataset ({corpus}) gives {len(blocks)} blocks of {args.block_size} tokens, fewer than "
                     f"--batch-size {args.batch_size}: add text or lower --block-size")
    return out, resumed, model, tokenizer, blocks.with_format("torch")["input_ids"], corpus


def write_torch_files(torch_objects: dict[str, object], folder: Path) -> None:
    """``torch.save`` each of ``torch_objects`` (file name: object) into ``folder`` through an open file, so that a
    full disk raises ``OSError`` (No space left on device)."""
    for name, value in torch_objects.items():
        with open(folder / name, "wb") as file:
            torch.save(value, file)


def main(argv: list[str] | None = None) -> int:
    parser, args = parse_args(argv)
    set_seed(args.seed)
    out, resumed, model, tokenizer, blocks, corpus = check_args_before_work(parser, args)
    untied = args.untie_word_embeddings and untie_lm_head(model)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    pipelined = args.world_size > 1

    if pipelined:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleDualPipeV,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        owns_group = not dist.is_initialized()  # the tests call main() inside the group of their own launch
        if owns_group:
            rank, world_size, device = start_distributed()
        else:
            rank, world_size = dist.get_rank(), dist.get_world_size()
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else (
                torch.device("cpu"))
        stage_indices = local_stage_indices(args.schedule, rank, world_size)
        stage_modules = split_pipeline(model.train(), args.num_stages)
        tied_embedding = TiedEmbeddingSync(stage_modules, stage_ranks(args.schedule, world_size, args.num_stages))
        modules = [stage_modules[index].to(device) for index in stage_indices]
        stages = [PipelineStage(module, index, args.num_stages, device)
                  for module, index in zip(modules, stage_indices, strict=True)]
        schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B,
                          "dualpipev": ScheduleDualPipeV}[args.schedule]
        schedule = schedule_class(stages if len(stages) > 1 else stages[0], n_microbatches=args.microbatches,
                                  loss_fn=next_token_loss)
        holds_first, holds_last = 0 in stage_indices, args.num_stages - 1 in stage_indices
    else:
        rank, world_size = 0, 1
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        modules = [split_pipeline(model.train(), 1)[0].to(device)]  # the whole model, as one stage
        stage_indices, holds_first, holds_last, tied_embedding = [0], True, True, None
    parameters = [parameter for module in modules for parameter in module.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=args.lr, weight_decay=args.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, args.steps)
    start_step, log_history = 0, []
    if resumed is not None:
        optimizer.load_state_dict(resumed.optimizer)
        scheduler.load_state_dict(resumed.scheduler)  # its lr_lambda stays this run's: the decay to this --steps
        set_rng_state(resumed.rng)
        start_step, log_history = resumed.global_step, resumed.log_history

    if rank == 0:
        if args.overwrite and out.is_dir():
            removed, _ = finetune.clear_earlier_run(out, checkpoints=True)
            print(f"--overwrite: deleted the earlier run's {', '.join(removed) or 'nothing'} from {out}")
        how = (f"{args.num_stages} stages on {world_size} ranks, {args.schedule}" if pipelined
               else "one process, no pipeline")
        print(f"model: {args.model}: mHC, n = {model.config.hc_mult} streams, {len(model.model.layers)} layers"
              f"{'; lm_head untied from the embedding' if untied else ''}"
              f"{'; tied embeddings, kept equal on the first and last stage' if tied and pipelined else ''}; {how}")
        print(f"data: {corpus}: {len(blocks)} blocks of {args.block_size} tokens; {args.batch_size} sequences per step "
              f"in {args.microbatches} microbatches")
        if resumed is not None:
            print(f"resuming from {resumed.checkpoint} at step {start_step}{resumed.skipped}", flush=True)

    def write(folder: Path, step: int, gathered: list[dict], with_training_state: bool) -> None:
        """Write the merged model, the tokenizer, (for a checkpoint) every rank's training state and, last, the
        trainer state into ``folder``, then read back what was written: a save that a full disk cut short raises."""
        merged = {name: tensor for rank_state in gathered for name, tensor in rank_state["model"].items()}
        if model.config.tie_word_embeddings:  # the last stage's copy of the tied embedding: saved once
            merged.pop("lm_head.weight", None)
        model.save_pretrained(folder, state_dict=merged)
        tokenizer.save_pretrained(folder)
        torch_files = {}
        if with_training_state:
            torch_files = {
                "optimizer.pt": {"ranks": [rank_state["optimizer"] for rank_state in gathered]},
                "scheduler.pt": scheduler.state_dict(),
                **{f"rng_state_{index}.pth": rank_state["rng"] for index, rank_state in enumerate(gathered)},
            }
        write_torch_files(torch_files, folder)
        options = {name: getattr(args, name) for name in SAVED_OPTIONS}
        trainer_state = {"global_step": step, "options": options, "log_history": log_history}
        with open(folder / STATE_FILE, "w", encoding="utf-8") as file:
            file.write(json.dumps(trainer_state, indent=2) + "\n")
        written = [*sorted(folder.glob("model*.safetensors")), *(folder / name for name in torch_files),
                   folder / STATE_FILE]
        damaged = example_utils.first_file_error(written)
        if damaged is not None:
            raise OSError(f"written, but {damaged}")

    def save(folder: Path, step: int, with_training_state: bool) -> str | None:
        """Rank 0 writes the merged model (and, for a checkpoint, every rank's training state) to ``folder``; a
        checkpoint all at once (:func:`example_utils.atomic_folder`). Every rank returns why the save failed, or
        None."""
        local = {
            "model": {name: tensor.cpu() for module in modules for name, tensor in module.state_dict().items()},
            "optimizer": cpu_copy(optimizer.state_dict()) if with_training_state else None,
            "rng": rng_state(),
        }
        gathered = [local]
        if pipelined:
            gathered = [None] * world_size if rank == 0 else None
            dist.gather_object(local, gathered, dst=0)
        error = None
        if rank == 0:
            try:
                if with_training_state:
                    with example_utils.atomic_folder(folder) as partial:
                        write(partial, step, gathered, with_training_state)
                else:
                    write(folder, step, gathered, with_training_state)
            except (OSError, RuntimeError, SafetensorError) as exc:
                error = f"cannot save {folder}: {first_line(exc)}"
            else:
                print(f"saved {folder}", flush=True)
        if pipelined:
            verdict = [error]
            dist.broadcast_object_list(verdict, src=0)
            error = verdict[0]
        return error

    def stop(message: str) -> int:
        """End the run on every rank (rank 0 prints ``message``): exit status 1."""
        if rank == 0:
            print(message, file=sys.stderr, flush=True)
        if pipelined and owns_group:
            dist.destroy_process_group()
        return 1

    if resumed is not None:  # a killed save's checkpoint-STEP, which this run saves again: set aside by rank 0
        error = None
        if rank == 0 and resumed.in_the_way:
            try:
                print("\n".join(example_utils.set_aside_incomplete(resumed.in_the_way)), flush=True)
            except OSError as exc:
                error = f"{parser.prog}: error: --resume: cannot set aside an incomplete checkpoint: {first_line(exc)}"
        if pipelined:
            verdict = [error]
            dist.broadcast_object_list(verdict, src=0)
            error = verdict[0]
        if error is not None:
            return stop(error)

    for step in range(start_step, args.steps):
        batch = blocks[batch_indices(step, args.batch_size, len(blocks), args.seed)].to(device)
        losses: list[torch.Tensor] = []
        if pipelined:
            step_kwargs = {"target": batch, "losses": losses} if holds_last else {}
            schedule.step(batch, **step_kwargs) if holds_first else schedule.step(**step_kwargs)
            tied_embedding.all_reduce_grad()
        else:  # the same microbatches, each loss's gradient accumulated, then divided by their number
            for microbatch in batch.tensor_split(args.microbatches):
                loss = next_token_loss(modules[0](microbatch), microbatch)
                loss.backward()
                losses.append(loss.detach())
            for parameter in parameters:
                if parameter.grad is not None:
                    parameter.grad.div_(args.microbatches)
        loss_sum = torch.stack(losses).sum().double() if holds_last else torch.zeros((), dtype=torch.float64,
                                                                                     device=device)
        if pipelined:
            dist.all_reduce(loss_sum)  # only the rank holding the last stage adds its losses
        mean_loss = loss_sum.item() / args.microbatches
        duplicate = None if tied_embedding is None else tied_embedding.duplicate  # the tied embedding counts once
        grad_norm = clip_global_grad_norm(parameters, args.max_grad_norm, pipelined, duplicate)
        learning_rate = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if not math.isfinite(mean_loss):  # every rank sees the same loss and stops
            return stop(f"step {step + 1}: the loss is {mean_loss}; lower --lr")
        log_history.append({"step": step + 1, "loss": mean_loss, "lr": learning_rate, "grad_norm": grad_norm})
        if rank == 0:
            print(f"step {step + 1}/{args.steps}: loss {mean_loss:.6f}, grad norm {grad_norm:.4f}, "
                  f"lr {learning_rate:.3e}", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            error = save(out / f"checkpoint-{step + 1}", step + 1, with_training_state=True)
            if error is not None:
                return stop(f"{parser.prog}: error: {error} (nothing of it is kept; --resume continues from the "
                            "newest complete checkpoint)")

    error = save(out, args.steps, with_training_state=False)
    if error is not None:
        return stop(f"{parser.prog}: error: {error} (--resume continues from the newest complete checkpoint)")
    if pipelined and owns_group:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
