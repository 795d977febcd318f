"""Bytes saved for backward per token per decoder layer: residual Llama vs its mHC upcycle, with and without
selective recomputation (``hc_recompute``) and gradient checkpointing.

    .venv/bin/python benchmarks/bench_memory.py [--hidden 512] [--layers 4] [--tokens 512] [--n 4] [--json PATH]

Counts the distinct storages autograd keeps (``saved_tensors_hooks``), parameters excluded: deterministic, so one
run suffices. Prints each case to stderr as it is measured, then the table; the results are written as JSON only
with ``--json PATH`` (otherwise printed after the table).
"""

from __future__ import annotations

import argparse

import torch
from benchlib import add_json_argument, progress, report
from transformers import LlamaConfig, LlamaForCausalLM

import hf_mhc
from hf_mhc.kernels.profiling import saved_bytes_for_backward


def per_token_per_layer(model, ids, layers: int) -> float:
    model.train()
    saved = saved_bytes_for_backward(lambda: model(ids, labels=ids, use_cache=False).loss,
                                     exclude=tuple(model.parameters()))
    return saved / ids.numel() / layers


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--n", type=int, default=4)
    add_json_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=2,
                         max_position_embeddings=args.tokens, attn_implementation="sdpa")
    residual = LlamaForCausalLM(config)
    mhc = hf_mhc.upcycle(residual, hc_mult=args.n)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens))
    rows = {}

    def measure(name: str, model) -> None:
        progress(f"case {len(rows) + 1}/6: {name}")
        rows[name] = per_token_per_layer(model, ids, args.layers)

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

    lines = [f"bytes saved for backward per token per layer: C={args.hidden}, {args.layers} layers, {args.tokens} "
             f"tokens, fp32 (C*4 = {args.hidden * 4:,} bytes)",
             "| model | bytes/token/layer | in units of C*4 |",
             "| --- | ---: | ---: |"]
    lines += [f"| {name} | {value:,.0f} | {value / (4 * args.hidden):.1f} |" for name, value in rows.items()]
    results = {"config": {key: value for key, value in vars(args).items() if key != "json"},
               "bytes_per_token_per_layer": rows}
    report("\n".join(lines), results, args.json)


if __name__ == "__main__":
    main()
