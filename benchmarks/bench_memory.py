"""Bytes saved for backward per token per decoder layer: residual Llama vs its mHC upcycle, with and without
selective recomputation (``hc_recompute``) and gradient checkpointing.

    .venv/bin/python benchmarks/bench_memory.py [--hidden 512] [--layers 4] [--tokens 512] [--n 4] [--device cuda]
        [--dtype bfloat16] [--json PATH]

Counts the distinct storages autograd holds for backward once the forward has returned (what ops save through
``saved_tensors_hooks`` and what checkpoints keep), parameters excluded, on the real model; beside it, what
``hf-mhc plan`` predicts for the same model on fake tensors (``hf_mhc.planning.plan_memory``). On a CUDA device it
also reports each case's peak CUDA memory of one forward + backward above the model and its gradients
(``torch.cuda.max_memory_allocated``). Deterministic, so one run suffices. Prints each case to stderr as it is
measured, then the table; the results are written as JSON only with ``--json PATH`` (otherwise printed after the
table).
"""

from __future__ import annotations

import argparse

import torch
from benchlib import add_json_argument, progress, report
from transformers import LlamaConfig, LlamaForCausalLM

import hf_mhc
from hf_mhc.planning import plan_memory
from hf_mhc.profiling import saved_bytes_for_backward

# The bench's cases that hf-mhc plan also counts, by the plan's name.
PLANNED = {"residual Llama": "residual", "mHC n={n}": "mhc", "mHC n={n}, hc_recompute": "mhc + hc_recompute",
           "mHC n={n}, gradient checkpointing": "mhc + gradient checkpointing",
           "residual Llama, gradient checkpointing": "residual + gradient checkpointing"}


def per_token_per_layer(model, ids, layers: int) -> float:
    model.train()
    saved = saved_bytes_for_backward(lambda: model(ids, labels=ids, use_cache=False).loss,
                                     exclude=tuple(model.parameters()))
    return saved / ids.numel() / layers


def cuda_peak_bytes(model, ids) -> int:
    """Peak CUDA memory of one forward + backward, above what was allocated before (the model, its gradients)."""
    model.train()
    model.zero_grad(set_to_none=False)  # gradients allocated before the baseline: the peak counts activations
    model(ids, labels=ids, use_cache=False).loss.backward()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model(ids, labels=ids, use_cache=False).loss.backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - baseline


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda (adds the peak CUDA memory)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_json_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=2,
                         max_position_embeddings=args.tokens, attn_implementation="sdpa")
    residual = LlamaForCausalLM(config).to(args.device, getattr(torch, args.dtype))
    mhc = hf_mhc.upcycle(residual, hc_mult=args.n)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens), device=args.device)
    cuda = torch.device(args.device).type == "cuda"
    rows, peaks = {}, {}

    def measure(name: str, model) -> None:
        progress(f"case {len(rows) + 1}/6: {name}")
        rows[name] = per_token_per_layer(model, ids, args.layers)
        if cuda:
            peaks[name] = cuda_peak_bytes(model, ids)

    measure("residual Llama", residual)
    measure(f"mHC n={args.n}", mhc)
    for layer in mhc.model.layers:
        layer.hc_recompute = True
    measure(f"mHC n={args.n}, hc_recompute", mhc)
    mhc.activation_checkpointing_enable()
    measure(f"mHC n={args.n}, hc_recompute + gradient checkpointing", mhc)
    for layer in mhc.model.layers:
        layer.hc_recompute = False
    measure(f"mHC n={args.n}, gradient checkpointing", mhc)
    residual.activation_checkpointing_enable()
    measure("residual Llama, gradient checkpointing", residual)

    progress("hf-mhc plan of the same model")
    plan = plan_memory(config, tokens=args.tokens, dtype=args.dtype, hc_mult=args.n)
    planned = {name: plan.activation_bytes[case] / args.tokens / args.layers
               for name, case in ((name.format(n=args.n), case) for name, case in PLANNED.items())}
    element = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    lines = [f"bytes held for backward per token per layer (whole model / tokens / layers): C={args.hidden}, "
             f"{args.layers} layers, {args.tokens} tokens, {args.dtype} (C*{element} = {args.hidden * element:,} "
             f"bytes), {args.device}",
             f"| model | bytes/token/layer | in units of C*{element} | hf-mhc plan |" + (" peak CUDA MiB |" if cuda
                                                                                       else ""),
             "| --- | ---: | ---: | ---: |" + (" ---: |" if cuda else "")]
    lines += [f"| {name} | {value:,.0f} | {value / (element * args.hidden):.1f} | "
              + (f"{planned[name]:,.0f} |" if name in planned else "not planned |")
              + (f" {peaks[name] / 2**20:,.0f} |" if cuda else "") for name, value in rows.items()]
    results = {"config": {key: value for key, value in vars(args).items() if key != "json"},
               "bytes_per_token_per_layer": rows, "planned_bytes_per_token_per_layer": planned}
    if cuda:
        results["peak_bytes"] = peaks
    report("\n".join(lines), results, args.json)


if __name__ == "__main__":
    main()
