"""Training-step time of an mHC model against its residual baseline: forward + backward of the loss.

    .venv/bin/python benchmarks/bench_training_step.py [--hidden 1024] [--layers 4] [--tokens 2048] [--n 4] \
        [--repeats 7] [--device cuda] [--dtype bfloat16] [--json PATH]

Models, measured side by side in one run (they alternate, so machine noise hits all of them; medians of repeats):

- ``residual Llama``: the backbone alone;
- ``mHC, hf_mhc.kernels``: ``hf_mhc.upcycle`` of it, as the plugin runs it (memory-light torch kernels on CPU,
  Triton on CUDA);
- ``mHC, hc_recompute``: the same with selective recomputation of the mHC regions;
- ``mHC, plain formula``: the same model with ``hc_implementation="reference"``, the plain formula of
  ``hf_mhc.mhc_reference`` (what a checkpoint loaded as remote code without the plugin runs: autograd through the
  unrolled formula).

The overhead is each mHC row's time over the residual one, minus 1. Prints each repeat to stderr as it runs, then the
table; the results are written as JSON only with ``--json PATH`` (otherwise printed after the table).
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch
from benchlib import add_json_argument, progress, report
from transformers import LlamaConfig, LlamaForCausalLM

import hf_mhc


@contextmanager
def plain_formula(model):
    """Run the model's mHC maps through the reference formula (the remote-code path) while active."""
    previous = model.config.hc_implementation
    model.set_hc_implementation("reference")
    try:
        yield
    finally:
        model.set_hc_implementation(previous)


@contextmanager
def recomputing(model, enabled: bool):
    for layer in model.model.layers:
        layer.hc_recompute = enabled
    try:
        yield
    finally:
        for layer in model.model.layers:
            layer.hc_recompute = False


def training_step(model, ids) -> None:
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids, use_cache=False).loss.backward()
    if ids.is_cuda:
        torch.cuda.synchronize()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the models' dtype (the mHC maps compute in float32 either way)")
    add_json_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=2,
                         max_position_embeddings=args.tokens, attn_implementation="sdpa")
    residual = LlamaForCausalLM(config).to(args.device, getattr(torch, args.dtype)).train()
    mhc = hf_mhc.upcycle(residual, hc_mult=args.n).train()
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), device=args.device)
    runs = {
        "residual Llama": lambda: training_step(residual, ids),
        f"mHC n={args.n}, hf_mhc.kernels": lambda: training_step(mhc, ids),
        f"mHC n={args.n}, hc_recompute": lambda: _with(recomputing(mhc, True), training_step, mhc, ids),
        f"mHC n={args.n}, plain formula": lambda: _with(plain_formula(mhc), training_step, mhc, ids),
    }
    for name, run in runs.items():
        progress(f"warm-up: {name}")
        run()
    samples = {name: [] for name in runs}
    for repeat in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
        progress(f"repeat {repeat + 1}/{args.repeats}: " + "; ".join(
            f"{name}: {1e3 * times[-1]:.0f} ms" for name, times in samples.items()))
    medians = {name: 1e3 * statistics.median(times) for name, times in samples.items()}
    baseline = medians["residual Llama"]
    lines = [f"training step (forward + backward): Llama C={args.hidden}, {args.layers} layers, {args.tokens} tokens, "
             f"{args.dtype}, {args.device} ({torch.get_num_threads()} CPU threads), median of {args.repeats}",
             "| model | median ms | over the residual model |",
             "| --- | ---: | ---: |"]
    for name, value in medians.items():
        overhead = "" if name == "residual Llama" else f"{100 * (value / baseline - 1):+.1f} %"
        lines.append(f"| {name} | {value:.0f} | {overhead} |")
    config = {key: value for key, value in vars(args).items() if key != "json"}
    report("\n".join(lines), {"config": config | {"threads": torch.get_num_threads()}, "median_ms": medians},
           args.json)


def _with(context, function, *args):
    with context:
        return function(*args)


if __name__ == "__main__":
    main()
