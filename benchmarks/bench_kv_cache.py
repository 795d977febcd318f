"""KV-cache bytes per token, greedy agreement and decoding speed of transformers' quantized caches on mHC models.

Two models, upcycled to mHC with ``hc_mult=4`` (``--models dense|mla|all``): dense, stories260K
(``../shared/assets/stories260K``, a 5-layer Llama with 4 KV heads of 8), or, when that folder is absent or with
``--tiny``, a random 2-layer Llama; and MLA, a random 2-layer DeepSeek-V3 with DeepSeek-V3's attention widths, whose
cache holds the compressed latent (512) and the shared RoPE key (64) per token and layer. For each cache
(``dynamic``; ``quanto`` 2 and 4 bits; ``hqq`` 4 and 8 bits; ``fp8``, per-tensor):

* bytes per token: of every tensor the cache layers hold after a forward pass over ``--context`` tokens (quanto's
  packed tensors counted by their storage), divided by ``--context``; the upcycled model's source holds the same
  bytes (checked and reported), as attention sees the collapsed stream and caches what the backbone caches;
* greedy agreement: over ``--prompts`` story openings (random prompts for the random models), the number of generated
  tokens equal to the dynamic cache's before the first difference, out of ``--new-tokens``;
* tokens/s: generated tokens over the wall time of ``generate`` (median over the prompts, single process).

Quantization groups: ``q_group_size`` is the largest of 64, 32, 16, 8 dividing the width of one token's cached
states (``num_key_value_heads * head_dim``: 32 for stories260K, where the default 64 fails on odd lengths; 64 for
MLA), and the residual window of full-precision tokens is transformers' default (128), longer than the generations
here: the prompt is quantized, the new tokens are not. ``optimum-quanto`` and ``hqq`` are optional
(``pip install 'hf-mhc[quant]'``); a missing one is reported and skipped::

    .venv/bin/python benchmarks/bench_kv_cache.py [--models all] [--prompts 8] [--new-tokens 48] [--context 256]
                                                   [--tiny] [--json PATH]

Prints each model, cache and prompt to stderr as it goes, then the tables; the results are written as JSON only
with ``--json PATH`` (otherwise printed after the tables).
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from pathlib import Path

import torch
from benchlib import add_json_argument, progress, report
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    QuantizedCache,
)
from transformers.utils import is_hqq_available, is_optimum_quanto_available

import hf_mhc
from hf_mhc.profiling import cache_bytes

STORIES260K = Path(__file__).resolve().parents[2] / "shared" / "assets" / "stories260K"
PROMPTS = [
    "Once upon a time",
    "Once upon a time, there was a little girl named Lily.",
    "Tom and his dog went to the park. They saw a big",
    "One day, a little bird was flying in the sky. It saw",
    "The sun was shining and the children were playing outside. Sara wanted to",
    "There was a big red ball in the garden.",
    "Ben had a toy car. He liked to play with it every day, but one day",
    "Mom said, \"Let's bake a cake!\"",
]
# (backend, nbits, availability check): quanto takes 2 or 4 bits, hqq 1, 2, 3, 4 or 8, fp8 none (per-tensor).
CACHES = [("dynamic", None, None),
          ("quanto", 2, is_optimum_quanto_available), ("quanto", 4, is_optimum_quanto_available),
          ("hqq", 4, is_hqq_available), ("hqq", 8, is_hqq_available),
          ("fp8", None, None)]


def group_size(config) -> int:
    """The largest of 64, 32, 16, 8 dividing the width of one token's cached states (every length then quantizes):
    ``num_key_value_heads * head_dim``, or for MLA the latent and RoPE-key widths."""
    if getattr(config, "kv_lora_rank", None):
        width = math.gcd(config.kv_lora_rank, config.qk_rope_head_dim)
    else:
        width = config.num_key_value_heads * config.head_dim
    return max(g for g in (8, 16, 32, 64) if width % g == 0)


def cache_options(backend: str, nbits: int | None, config) -> dict:
    """``cache_config`` for ``generate(cache_implementation="quantized")`` (fp8 takes no group-wise option)."""
    if backend == "fp8":
        return {"backend": "fp8"}
    return {"backend": backend, "nbits": nbits, "q_group_size": group_size(config)}


def make_cache(model, backend: str, nbits: int | None):
    if backend == "dynamic":
        return DynamicCache(config=model.config)
    options = cache_options(backend, nbits, model.config)
    return QuantizedCache(options.pop("backend"), model.config, **options)


@torch.no_grad()
def cache_bytes_after(model, input_ids: torch.Tensor, backend: str, nbits: int | None) -> int:
    """Bytes the cache layers hold after one forward pass over ``input_ids``."""
    cache = make_cache(model, backend, nbits)
    model(input_ids=input_ids, cache=cache, use_cache=True)
    return cache_bytes(cache)


def load_models(kind: str, tiny: bool):
    """``(source, upcycled mHC model, tokenizer or None, description)`` for ``kind`` "dense" or "mla"."""
    torch.manual_seed(0)
    if kind == "mla":
        # DeepSeek-V3's attention widths (latent 512, RoPE key 64, 128 + 64 query/key and 128 value dims per head),
        # 2 layers, 16 heads, random weights.
        source = DeepseekV3ForCausalLM(DeepseekV3Config(
            vocab_size=101, hidden_size=256, intermediate_size=512, moe_intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=16, num_key_value_heads=16, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
            topk_group=1, first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=128, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, max_position_embeddings=512))
        name = ("random DeepSeek-V3 (MLA: latent 512 + RoPE key 64 cached per token and layer; 2 layers, 16 heads) "
                "upcycled, hc_mult=4")
        return source.eval(), hf_mhc.upcycle(copy.deepcopy(source), hc_mult=4).eval(), None, name
    if not tiny and STORIES260K.is_dir():
        source = AutoModelForCausalLM.from_pretrained(STORIES260K)
        tokenizer = AutoTokenizer.from_pretrained(STORIES260K)
        name = "stories260K (5 layers, 4 KV heads x 8) upcycled, hc_mult=4"
    else:
        source = LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=512))
        tokenizer = None
        name = "random tiny Llama (2 layers, 2 KV heads x 8) upcycled, hc_mult=4"
    model = hf_mhc.upcycle(copy.deepcopy(source), hc_mult=4)
    return source.eval(), model.eval(), tokenizer, name


def encode(tokenizer, text: str, index: int) -> torch.Tensor:
    if tokenizer is not None:
        return tokenizer(text, return_tensors="pt").input_ids
    return torch.randint(3, 101, (1, 8 + index), generator=torch.Generator().manual_seed(index))


def agreement(a: torch.Tensor, b: torch.Tensor) -> int:
    differ = (a != b).nonzero()
    return int(differ[0]) if len(differ) else len(a)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8, help=f"how many of the {len(PROMPTS)} prompts")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--context", type=int, default=256, help="tokens in the forward pass the bytes are counted on")
    parser.add_argument("--tiny", action="store_true", help="the random tiny model even when stories260K is present")
    parser.add_argument("--models", choices=["dense", "mla", "all"], default="all",
                        help="dense: stories260K (or the tiny Llama); mla: DeepSeek-V3's attention (needs deepseek_v3 "
                             "among hf_mhc.SUPPORTED_BACKBONES)")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts must be from 1 to {len(PROMPTS)}, got {args.prompts}")
    if args.new_tokens < 1 or args.context < 1:
        parser.error("--new-tokens and --context must be positive")
    return args


def measure_model(kind: str, args: argparse.Namespace) -> tuple[dict, str]:
    """Every cache on one model: ``(results, table)``."""
    source, model, tokenizer, name = load_models(kind, args.tiny)
    config = model.config
    prompts = [encode(tokenizer, text, i) for i, text in enumerate(PROMPTS[: args.prompts])]
    context = torch.randint(3, config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    results = {"model": name, "q_group_size": group_size(config), "caches": {}}
    references: list[torch.Tensor] = []
    for case, (backend, nbits, available) in enumerate(CACHES, 1):
        label = backend if nbits is None else f"{backend} {nbits}-bit"
        step = f"{kind}: cache {case}/{len(CACHES)}: {label}"
        if available is not None and not available():
            progress(f"{step}: skipped ({backend} is not installed)")
            results["caches"][label] = {"skipped": f"{backend} is not installed"}
            continue
        progress(f"{step}: bytes over {args.context} tokens ...")
        mhc_bytes = cache_bytes_after(model, context, backend, nbits)
        source_bytes = cache_bytes_after(source, context, backend, nbits)
        agreements, speeds = [], []
        options = {} if backend == "dynamic" else {"cache_implementation": "quantized",
                                                   "cache_config": cache_options(backend, nbits, config)}
        for i, prompt in enumerate(prompts):
            progress(f"{step}: prompt {i + 1}/{len(prompts)}")
            start = time.perf_counter()
            out = model.generate(input_ids=prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                 do_sample=False, **options)
            speeds.append(args.new_tokens / (time.perf_counter() - start))
            tokens = out[0, prompt.shape[1]:]
            if backend == "dynamic":
                references.append(tokens)
            agreements.append(agreement(tokens, references[i]))
        results["caches"][label] = {
            "bytes_per_token": mhc_bytes / args.context, "source_bytes_per_token": source_bytes / args.context,
            "agreement": agreements, "agreement_mean": statistics.mean(agreements), "agreement_min": min(agreements),
            "tokens_per_second": statistics.median(speeds)}
    dense = results["caches"]["dynamic"]["bytes_per_token"]
    lines = [f"{name}; q_group_size {group_size(config)}",
             "| cache | bytes/token | of dynamic | source's bytes/token | agreement mean (min) | tokens/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for label, row in results["caches"].items():
        if "skipped" in row:
            lines.append(f"| {label} | skipped: {row['skipped']} | | | | |")
            continue
        lines.append(f"| {label} | {row['bytes_per_token']:.0f} | {row['bytes_per_token'] / dense:.1%} | "
                     f"{row['source_bytes_per_token']:.0f} | {row['agreement_mean']:.1f} ({row['agreement_min']}) "
                     f"/ {args.new_tokens} | {row['tokens_per_second']:.0f} |")
    return results, "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    kinds = ["dense", "mla"] if args.models == "all" else [args.models]
    if "mla" in kinds and "deepseek_v3" not in hf_mhc.SUPPORTED_BACKBONES:
        if args.models == "mla":
            raise SystemExit("bench_kv_cache.py: deepseek_v3 is not an mHC backbone in this hf_mhc")
        progress("mla: skipped (deepseek_v3 is not an mHC backbone in this hf_mhc)")
        kinds.remove("mla")
    results = {"config": {"threads": torch.get_num_threads(), "prompts": args.prompts, "new_tokens": args.new_tokens,
                          "context": args.context, "residual_length": 128}, "models": {}}
    tables = [f"{torch.get_num_threads()} threads; bytes after a {args.context}-token forward pass; greedy agreement "
              f"with the dynamic cache over {args.prompts} prompts x {args.new_tokens} new tokens"]
    for kind in kinds:
        results["models"][kind], table = measure_model(kind, args)
        tables.append(table)
    report("\n\n".join(tables), results, args.json)


if __name__ == "__main__":
    main()
