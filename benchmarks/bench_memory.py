"""Bytes saved for backward per token per decoder layer: residual Llama vs its mHC upcycle, with and without
selective recomputation (``hc_recompute``) and gradient checkpointing.

    .venv/bin/python benchmarks/bench_memory.py [--hidden 512] [--layers 4] [--tokens 512] [--n 4]

Counts the distinct storages autograd keeps (``saved_tensors_hooks``), parameters excluded: deterministic, so one
run suffices. Writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_mhc
from hf_mhc.kernels.profiling import saved_bytes_for_backward


def per_token_per_layer(model, ids, layers: int) -> float:
    model.train()
    saved = saved_bytes_for_backward(lambda: model(ids, labels=ids, use_cache=False).loss,
                                     exclude=tuple(model.parameters()))
    return saved / ids.numel() / layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=int(2.75 * args.hidden),
                         num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=2,
                         max_position_embeddings=args.tokens, attn_implementation="sdpa")
    residual = LlamaForCausalLM(config)
    mhc = hf_mhc.upcycle(residual, hc_mult=args.n)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens))
    rows = {"residual Llama": per_token_per_layer(residual, ids, args.layers)}
    rows[f"mHC n={args.n}"] = per_token_per_layer(mhc, ids, args.layers)
    for layer in mhc.model.layers:
        layer.hc_recompute = True
    rows[f"mHC n={args.n}, hc_recompute"] = per_token_per_layer(mhc, ids, args.layers)
    mhc.activation_checkpointing_enable()
    rows[f"mHC n={args.n}, hc_recompute + gradient checkpointing"] = per_token_per_layer(mhc, ids, args.layers)
    for layer in mhc.model.layers:
        layer.hc_recompute = False
    rows[f"mHC n={args.n}, gradient checkpointing"] = per_token_per_layer(mhc, ids, args.layers)
    residual.gradient_checkpointing_enable()
    rows["residual Llama, gradient checkpointing"] = per_token_per_layer(residual, ids, args.layers)

    print(f"bytes saved for backward per token per layer: C={args.hidden}, {args.layers} layers, {args.tokens} tokens, "
          f"fp32 (C*4 = {args.hidden * 4:,} bytes)")
    print("| model | bytes/token/layer | in units of C*4 |")
    print("| --- | ---: | ---: |")
    for name, value in rows.items():
        print(f"| {name} | {value:,.0f} | {value / (4 * args.hidden):.1f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"config": vars(args) | {"json": None}, "bytes_per_token_per_layer": rows},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
