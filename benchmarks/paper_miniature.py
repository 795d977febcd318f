"""The mHC paper in miniature: a residual Llama and one mHC model per residual-map variant, trained from scratch on
several seeds.

    .venv/bin/python benchmarks/paper_miniature.py [--layers 8] [--hidden 64] [--streams 4] \
        [--steps 150] [--seeds 3] [--variants residual,unconstrained,sinkhorn,permutations,identity] [--lr 3e-3] \
        [--lr-sweep 3e-3,1e-2,3e-2] [--batch-size 8] [--block-size 64] [--log-every 15] [--seed 0] \
        [--json PATH] [--plot PATH.png]

For each of ``--seeds`` seeds (``--seed``, ``--seed + 1``, ...: the initialisation and the order of the batches),
every model trains on the same batches, in the same order, for the same number of tokens:

- ``residual``: a plain ``LlamaForCausalLM`` (one residual stream), the baseline;
- ``unconstrained``, ``sinkhorn``, ``permutations``, ``identity``: ``hf_mhc.upcycle`` of that very model (same
  backbone weights at step 0) with ``hc_residual_map`` set to the variant: Hyper-Connections (no constraint on the
  residual mixing), mHC (Sinkhorn-projected, doubly stochastic), mHC-lite (a convex combination of permutations) and
  streams carried by the identity (only ``pre`` / ``post`` learned). All start out computing the residual model.

The models of one seed train side by side, one step of each in turn (``training_runs.train_arms``), so that their step
times compare on a loaded machine. The model is a deep, narrow Llama: ``--layers`` x ``--hidden`` (defaults 8 x 64),
``hidden / 32`` heads of 32 (full multi-head attention), an MLP of ``8/3 * hidden`` rounded up to a multiple of 32
(192 for 64), RMSNorm eps 1e-5, untied embeddings. Data: Jane Austen's novels from ``../shared/assets/janeausten``
beside the project when present, Python's ``pydoc_data`` topics otherwise (``--dataset GLOB`` for other text files),
tokenised with the stories260K tokenizer (512 tokens, from ``../shared/assets/stories260K``) or bytes (256 tokens;
``--tokenizer``). The last 10 % of the tokens are held out; training batches are random blocks of the first 90 %.

Optimiser and records: ``training_runs.Schedule`` and ``training_runs.Arm`` (AdamW, 5 % warm-up, cosine decay to
10 %, clipping at ``--grad-clip``; every ``--log-every`` steps the training and held-out loss, gradient norm,
composite gains and training time). A loss spike is a step whose loss exceeds twice the median of the previous 50
steps' losses (from step 11 on); a non-finite loss ends that model's run (``diverged_at_step``). The summary gives,
per variant over seeds, the final held-out loss, its difference to the residual model of the same seed, the
tokens-per-second ratio to it and the held-out loss reached within the residual model's training time (equal
compute: the last logged point within that time).

``--lr-sweep LR,LR,...`` repeats the whole comparison at each learning rate (the stress test: raise the rate until
the baseline and unconstrained HC diverge or spike). Progress goes to stderr, the tables to stdout; the results are
written as JSON only with ``--json PATH`` (``runs[variant][seed]`` and ``summary[variant]``, under ``sweep[lr]``
with ``--lr-sweep``) and the figure only with ``--plot PATH.png``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from benchlib import add_json_argument, progress, report
from training_runs import (
    BASELINE,
    GAIN_BLOCKS,
    Schedule,
    UsageError,
    check_block_size,
    check_clip_and_plot,
    check_streams,
    default_dataset,
    llama_config,
    load_text,
    plot_seeds,
    split_corpus,
    summarize,
    summary_table,
    tokenize,
    train_arms,
)
from transformers import LlamaConfig, LlamaForCausalLM

import hf_mhc
from hf_mhc.mhc_reference import RESIDUAL_MAPS

VARIANTS = (BASELINE, "unconstrained", "sinkhorn", "permutations", "identity")
PROG = "paper_miniature.py"


def build(variants: list[str], config: LlamaConfig, streams: int, seed: int) -> dict[str, torch.nn.Module]:
    """The models of one seed: the residual Llama initialised from ``seed`` and its upcycled mHC per variant."""
    torch.manual_seed(seed)
    residual = LlamaForCausalLM(config)
    return {variant: residual if variant == BASELINE else
            hf_mhc.upcycle(residual, hc_mult=streams, hc_residual_map=variant) for variant in variants}


def check_variants(text: str) -> list[str]:
    variants = [name.strip() for name in text.split(",") if name.strip()]
    known = (BASELINE, *RESIDUAL_MAPS)
    unknown = [name for name in variants if name not in known]
    if unknown or not variants:
        raise UsageError(f"--variants: unknown variant {', '.join(unknown) or '(none given)'}; the installed hf_mhc "
                         f"knows {', '.join(known)}")
    return list(dict.fromkeys(variants))


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(value) for value in text.split(",") if value.strip()]
    except ValueError:
        raise UsageError(f"--lr-sweep {text}: expected comma-separated learning rates, e.g. 3e-3,1e-2") from None
    if not rates or not all(math.isfinite(rate) and rate > 0 for rate in rates):
        raise UsageError(f"--lr-sweep {text}: expected positive learning rates, e.g. 3e-3,1e-2")
    return rates


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", metavar="GLOB", default=default_dataset(),
                        help="text files to train on (default: ../shared/assets/janeausten/*.txt when present, "
                             "Python's pydoc_data topics otherwise)")
    parser.add_argument("--tokenizer", choices=("auto", "stories260K", "bytes"), default="auto",
                        help="auto: stories260K when ../shared/assets/stories260K is present, bytes otherwise")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--streams", type=int, default=4, help="hc_mult of the mHC models")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seeds", type=int, default=3, help="repeat every variant on this many seeds")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)} (default: all)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lr-sweep", metavar="LR,LR,...", default=None,
                        help="run the whole comparison at each of these learning rates (instead of --lr)")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="clip gradients to this norm (0: no clipping)")
    parser.add_argument("--seed", type=int, default=0, help="the first seed")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=15)
    parser.add_argument("--plot", type=Path, metavar="PATH.png", default=None,
                        help="write the figure (held-out loss against step and time, composite gain) to PATH.png")
    add_json_argument(parser)
    return parser.parse_args(argv)


def prepare(args: argparse.Namespace) -> tuple[dict[str, torch.Tensor], dict]:
    text, source = load_text(args.dataset)
    ids, vocab_size, tokenizer = tokenize(text, args.tokenizer)
    train_ids, blocks = split_corpus(ids, args.block_size)
    data = {"train": train_ids, "heldout_blocks": blocks, "gain_blocks": blocks[:GAIN_BLOCKS]}
    return data, {"dataset": source, "tokenizer": tokenizer, "vocab_size": vocab_size, "tokens": ids.numel(),
                  "train_tokens": train_ids.numel(), "heldout_tokens": ids.numel() - train_ids.numel()}


def check_args(args: argparse.Namespace) -> list[str]:
    """Validate ``args``; return the variants."""
    for name in ("layers", "hidden", "steps", "seeds", "batch_size", "log_every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_block_size(args.block_size)
    if args.hidden % 32:
        raise UsageError(f"--hidden must be a multiple of 32 (heads of 32), got {args.hidden}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    check_clip_and_plot(args.grad_clip, args.plot)
    variants = check_variants(args.variants)
    check_streams("--streams", args.streams, variants)
    return variants


def stability_table(runs: dict[str, dict[str, dict]]) -> str:
    """Per variant, over seeds: the largest composite gain, the loss spikes, divergences and the step time."""
    lines = ["| variant | max composite gain (fwd / bwd) | loss spikes | diverged | median ms / step |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for variant, seeds in runs.items():
        forward = max(run["max_composite_forward_gain"] for run in seeds.values())
        backward = max(run["max_composite_backward_gain"] for run in seeds.values())
        gains = f"{forward:.4g} / {backward:.4g}" + (" (by definition)" if variant == BASELINE else "")
        spikes = sum(len(run["loss_spikes"]) for run in seeds.values())
        diverged = [f"seed {seed} at step {run['diverged_at_step']}" for seed, run in seeds.items()
                    if run["diverged_at_step"] is not None]
        times = sorted(run["median_step_ms"] for run in seeds.values())
        lines.append(f"| {variant} | {gains} | {spikes} | {', '.join(diverged) or 0} | "
                     f"{times[len(times) // 2]:.0f} ({times[0]:.0f} to {times[-1]:.0f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        variants = check_args(args)
        rates = parse_rates(args.lr_sweep) if args.lr_sweep is not None else [args.lr]
        data, data_info = prepare(args)
    except UsageError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    config = llama_config(args.layers, args.hidden, data_info["vocab_size"], args.block_size)
    seeds = list(range(args.seed, args.seed + args.seeds))
    progress(f"data: {data_info['dataset']}, {data_info['tokenizer']} tokenizer, {data_info['train_tokens']} "
             f"training / {data_info['heldout_tokens']} held-out tokens; model: Llama {args.layers} x {args.hidden}, "
             f"{config.num_attention_heads} heads, MLP {config.intermediate_size}, n = {args.streams} streams; "
             f"seeds {', '.join(map(str, seeds))}; {torch.get_num_threads()} CPU threads")
    header = (f"paper in miniature: Llama {args.layers} layers x {args.hidden}, n = {args.streams} streams, "
              f"{args.steps} steps of {args.batch_size} x {args.block_size} tokens, {data_info['tokenizer']} tokens "
              f"of {data_info['dataset']}, seeds {', '.join(map(str, seeds))}, {torch.get_num_threads()} CPU threads")
    sweep, tables = {}, []
    for lr in rates:
        schedule = Schedule(steps=args.steps, lr=lr, grad_clip=args.grad_clip, batch_size=args.batch_size,
                            block_size=args.block_size, log_every=args.log_every)
        by_seed = {seed: train_arms(build(variants, config, args.streams, seed), data, schedule, seed,
                                    f"lr {lr:g}: seed {seed}") for seed in seeds}
        runs = {variant: {str(seed): by_seed[seed][variant] for seed in seeds} for variant in variants}
        summary = summarize(runs)
        sweep[f"{lr:g}"] = {"runs": runs, "summary": summary}
        tables.append(summary_table(summary, f"\nlr {lr:g}, final held-out loss over {len(seeds)} seeds:"))
        tables.append(stability_table(runs))
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()
                if key not in ("json", "plot")}
    results = {
        "command": " ".join(["benchmarks/paper_miniature.py", *(sys.argv[1:] if argv is None else argv)]),
        "config": settings | data_info | {"threads": torch.get_num_threads(), "heads": config.num_attention_heads,
                                          "intermediate_size": config.intermediate_size},
    }
    if args.lr_sweep is None:
        results |= sweep[f"{rates[0]:g}"]
    else:
        results["sweep"] = sweep
    if args.plot is not None:
        plot_seeds({f"lr {lr}": entry["runs"] for lr, entry in sweep.items()}, args.plot, header)
    report("\n".join([header, *tables]), results, args.json)


if __name__ == "__main__":
    main()
