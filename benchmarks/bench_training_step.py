"""Training-step time of an mHC model against its residual baseline: forward + backward of the loss.

    .venv/bin/python benchmarks/bench_training_step.py [--hidden 1024] [--layers 4] [--tokens 2048] [--n 4]

Models, measured side by side in one run (they alternate, so machine noise hits all of them; medians of repeats):

- ``residual Llama``: the backbone alone;
- ``mHC, hf_mhc.kernels``: ``hf_mhc.upcycle`` of it, as the plugin runs it (memory-light torch kernels on CPU,
  Triton on CUDA);
- ``mHC, hc_recompute``: the same with selective recomputation of the mHC regions;
- ``mHC, plain formula``: the same model with its three mHC calls swapped for ``hf_mhc.mhc_reference`` (what a
  checkpoint loaded as remote code without the plugin runs: autograd through the unrolled formula).

The overhead is each mHC row's time over the residual one, minus 1. Writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_mhc
from hf_mhc import mhc_reference, modeling_mhc


@contextmanager
def plain_formula():
    """Route the model's mHC calls through the reference formula (the remote-code path) while active."""
    names = ("mhc_coeffs_pre", "mhc_post_res", "mhc_head")
    plugin_ops = {name: getattr(modeling_mhc, name) for name in names}
    for name in names:
        setattr(modeling_mhc, name, getattr(mhc_reference, name))
    try:
        yield
    finally:
        for name, op in plugin_ops.items():
            setattr(modeling_mhc, name, op)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=2,
                         max_position_embeddings=args.tokens, attn_implementation="sdpa")
    residual = LlamaForCausalLM(config).to(args.device).train()
    mhc = hf_mhc.upcycle(residual, hc_mult=args.n).train()
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), device=args.device)
    runs = {
        "residual Llama": lambda: training_step(residual, ids),
        f"mHC n={args.n}, hf_mhc.kernels": lambda: training_step(mhc, ids),
        f"mHC n={args.n}, hc_recompute": lambda: _with(recomputing(mhc, True), training_step, mhc, ids),
        f"mHC n={args.n}, plain formula": lambda: _with(plain_formula(), training_step, mhc, ids),
    }
    for run in runs.values():  # warm-up
        run()
    samples = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - start)
    medians = {name: 1e3 * statistics.median(times) for name, times in samples.items()}
    baseline = medians["residual Llama"]
    print(f"training step (forward + backward): Llama C={args.hidden}, {args.layers} layers, {args.tokens} tokens, "
          f"fp32, {args.device} ({torch.get_num_threads()} CPU threads), median of {args.repeats}")
    print("| model | median ms | over the residual model |")
    print("| --- | ---: | ---: |")
    for name, value in medians.items():
        overhead = "" if name == "residual Llama" else f"+{100 * (value / baseline - 1):.0f} %"
        print(f"| {name} | {value:.0f} | {overhead} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": vars(args) | {"json": None, "threads": torch.get_num_threads()},
                                         "median_ms": medians}, indent=2) + "\n")


def _with(context, function, *args):
    with context:
        return function(*args)


if __name__ == "__main__":
    main()
