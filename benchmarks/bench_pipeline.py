"""Pipeline stage-boundary traffic and step time of an mHC model against its residual baseline, on 2 gloo CPU ranks.

    .venv/bin/python benchmarks/bench_pipeline.py [--hidden 256] [--layers 4] [--tokens 128] [--batch 8] \
        [--microbatches 4] [--n 4] [--repeats 7] [--json PATH]

The script starts two ranks itself (child processes on loopback, gloo) and, in one run, pipelines three models cut
into 2 stages the same way (``hf_mhc.distributed.pipeline_layer_split``), with ``Schedule1F1B``:

- ``residual Llama``: a random transformers ``LlamaForCausalLM``, cut into two minimal stage modules here (the
  embedding and the first layers; the other layers, the final norm and ``lm_head``). ``hidden [B, T, C]`` crosses;
- ``mHC n=N``: ``hf_mhc.upcycle`` of that model (the same backbone weights), cut by ``split_pipeline``: the streams
  ``[B, T, n, C]`` cross, in float32 like the model;
- ``mHC n=N, bf16 boundary``: the same with ``split_pipeline(..., boundary_dtype=torch.bfloat16)``.

Bytes per microbatch are counted on the tensors the stages actually send: every send op that ``PipelineStage``
hands to ``torch.distributed`` (activations forward from stage 0, their gradient backward from stage 1) is summed,
and divided by the microbatches. The step time is one ``schedule.step`` (forward and backward of every microbatch on
both ranks, between two barriers; no optimizer step) on rank 0. The models alternate within every repeat, so machine
noise hits all of them; the table gives medians and the spread (min - max) over the repeats, and each mHC row's time
over the residual one (the median and spread of the per-repeat ratios). Progress goes to stderr, then the table; the
results are written as JSON only with ``--json PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from benchlib import add_json_argument, progress, report
from torch import nn

WORLD_SIZE = 2
RESULT_PREFIX = "result: "
PROGRESS_PREFIX = "progress: "


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--n", type=int, default=4, help="mHC streams")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // WORLD_SIZE),
                        help="torch threads per rank (default: the CPU cores / 2)")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)  # set for the child processes
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.batch % args.microbatches or args.microbatches < WORLD_SIZE:
        parser.error(f"--microbatches must divide --batch and be >= {WORLD_SIZE} (1F1B on {WORLD_SIZE} stages)")
    return args


class ResidualStage(nn.Module):
    """One stage of a transformers ``LlamaForCausalLM``: ``input_ids [B, T]`` or ``hidden [B, T, C]`` in,
    ``hidden [B, T, C]`` or (last stage) ``logits [B, T, vocab]`` out. Causal attention, positions ``0 .. T-1``."""

    def __init__(self, model, layer_indices: range, is_first: bool, is_last: bool):
        super().__init__()
        self.embed_tokens = model.model.embed_tokens if is_first else None
        self.layers = nn.ModuleList(model.model.layers[index] for index in layer_indices)
        self.rotary_emb = model.model.rotary_emb
        self.norm = model.model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(inputs) if self.embed_tokens is not None else inputs
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden, position_ids=position_ids)
        for layer in self.layers:  # attention_mask=None: SDPA's causal attention
            hidden = layer(hidden, attention_mask=None, position_ids=position_ids,
                           position_embeddings=position_embeddings)
        return hidden if self.lm_head is None else self.lm_head(self.norm(hidden))


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def count_sent_bytes(stage, counter: dict[str, int]) -> None:
    """Add the bytes of every tensor ``stage`` sends (forward activations, backward gradients) to ``counter``."""
    for direction in ("fwd", "bwd"):
        build_ops = getattr(stage, f"get_{direction}_send_ops")

        def counted(chunk_id: int, build_ops=build_ops, direction=direction):
            ops = build_ops(chunk_id)
            counter[direction] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            return ops

        setattr(stage, f"get_{direction}_send_ops", counted)


def rank_main(args: argparse.Namespace) -> None:
    """One rank: build the three pipelines, time them, and (rank 0) print the results as one JSON line."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from transformers import LlamaConfig, LlamaForCausalLM

    import hf_mhc
    from hf_mhc.distributed import pipeline_layer_split, split_pipeline

    torch.set_num_threads(args.threads)
    rank = args.rank
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=WORLD_SIZE)
    say = (lambda message: print(PROGRESS_PREFIX + message, flush=True)) if rank == 0 else (lambda message: None)

    torch.manual_seed(0)  # the same weights and batch on both ranks
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                         num_key_value_heads=max(1, args.hidden // 128), max_position_embeddings=args.tokens,
                         attn_implementation="sdpa", tie_word_embeddings=False)
    residual = LlamaForCausalLM(config).train()
    mhc = hf_mhc.upcycle(residual, hc_mult=args.n).train()
    input_ids = torch.randint(0, config.vocab_size, (args.batch, args.tokens))
    splits = pipeline_layer_split(args.layers, WORLD_SIZE)
    modules = {
        "residual Llama": ResidualStage(residual, splits[rank], rank == 0, rank == WORLD_SIZE - 1),
        f"mHC n={args.n}": split_pipeline(mhc, WORLD_SIZE)[rank],
        f"mHC n={args.n}, bf16 boundary": split_pipeline(mhc, WORLD_SIZE, boundary_dtype=torch.bfloat16)[rank],
    }
    counters, schedules = {}, {}
    for name, module in modules.items():
        stage = PipelineStage(module, rank, WORLD_SIZE, torch.device("cpu"))
        counters[name] = {"fwd": 0, "bwd": 0}
        count_sent_bytes(stage, counters[name])
        schedules[name] = (Schedule1F1B(stage, n_microbatches=args.microbatches, loss_fn=next_token_loss), module)

    def step(name: str) -> float:
        schedule, module = schedules[name]
        module.zero_grad(set_to_none=True)
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(input_ids)
        else:
            schedule.step(target=input_ids, losses=[])
        dist.barrier()
        return time.perf_counter() - start

    for name in modules:
        say(f"warm-up: {name}")
        step(name)
    for counter in counters.values():
        counter.update(fwd=0, bwd=0)  # count one step exactly
    for name in modules:
        step(name)
    sent = {}
    for name, counter in counters.items():
        totals = torch.tensor([counter["fwd"], counter["bwd"]], dtype=torch.float64)
        dist.all_reduce(totals)  # stage 0 sends forward, stage 1 backward
        sent[name] = {"forward": int(totals[0]) // args.microbatches, "backward": int(totals[1]) // args.microbatches}

    samples = {name: [] for name in modules}
    for repeat in range(args.repeats):
        for name in modules:
            samples[name].append(step(name))
        say(f"repeat {repeat + 1}/{args.repeats}: " + "; ".join(
            f"{name}: {1e3 * times[-1]:.0f} ms" for name, times in samples.items()))
    if rank == 0:
        print(RESULT_PREFIX + json.dumps({"bytes_per_microbatch": sent, "step_s": samples}), flush=True)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(argv: list[str], threads: int) -> dict:
    """Start the two ranks (this script with ``--rank``), relay rank 0's progress, return its results."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    script = str(Path(__file__).resolve())
    children = [subprocess.Popen([sys.executable, script, *argv, "--rank", str(rank), "--port", str(port)],
                                 stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True, env=env)
                for rank in range(WORLD_SIZE)]
    result = None
    for line in children[0].stdout:
        if line.startswith(PROGRESS_PREFIX):
            progress(line.removeprefix(PROGRESS_PREFIX).rstrip())
        elif line.startswith(RESULT_PREFIX):
            result = json.loads(line.removeprefix(RESULT_PREFIX))
    errors = [child.stderr.read() for child in children]
    codes = [child.wait() for child in children]
    if any(codes) or result is None:
        failed = next(rank for rank, code in enumerate(codes) if code) if any(codes) else 0
        raise RuntimeError(f"rank {failed} of bench_pipeline.py failed:\n{errors[failed][-4000:]}")
    return result


def spread(values: list[float], scale: float = 1.0) -> str:
    return f"{scale * min(values):.0f} - {scale * max(values):.0f}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return
    child_argv = [item for name in ("hidden", "layers", "tokens", "batch", "microbatches", "n", "repeats", "threads")
                  for item in (f"--{name}", str(getattr(args, name)))]
    progress(f"starting {WORLD_SIZE} gloo ranks, {args.threads} thread(s) each")
    result = run_ranks(child_argv, args.threads)
    sent, samples = result["bytes_per_microbatch"], result["step_s"]
    names = list(samples)
    baseline = names[0]
    tokens = args.batch // args.microbatches * args.tokens
    ratios = {name: [seconds / base for seconds, base in zip(samples[name], samples[baseline], strict=True)]
              for name in names[1:]}
    lines = [f"pipeline, 2 stages on {WORLD_SIZE} gloo CPU ranks ({args.threads} thread(s) each), Schedule1F1B: Llama "
             f"C={args.hidden}, {args.layers} layers, {args.batch} x {args.tokens} tokens in {args.microbatches} "
             f"microbatches ({tokens} tokens each), fp32 weights; median (min - max) of {args.repeats}",
             "| model | KiB per microbatch forward | backward | bytes per token | step ms | over the residual |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in names:
        forward, backward = sent[name]["forward"], sent[name]["backward"]
        median = 1e3 * statistics.median(samples[name])
        over = "" if name == baseline else (f"x{statistics.median(ratios[name]):.2f} "
                                            f"({min(ratios[name]):.2f} - {max(ratios[name]):.2f})")
        lines.append(f"| {name} | {forward / 1024:.0f} | {backward / 1024:.0f} | {forward // tokens} | "
                     f"{median:.0f} ({spread(samples[name], 1e3)}) | {over} |")
    config = {key: value for key, value in vars(args).items() if key not in ("json", "rank", "port")}
    results = {
        "config": config | {"tokens_per_microbatch": tokens},
        "bytes_per_microbatch": sent,
        "step_ms": {name: {"median": 1e3 * statistics.median(times), "min": 1e3 * min(times),
                           "max": 1e3 * max(times), "samples": [1e3 * seconds for seconds in times]}
                    for name, times in samples.items()},
        "step_time_over_residual": {name: {"median": statistics.median(values), "min": min(values),
                                           "max": max(values)} for name, values in ratios.items()},
    }
    report("\n".join(lines), results, args.json)


if __name__ == "__main__":
    main()
