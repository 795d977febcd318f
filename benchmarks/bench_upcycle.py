"""Time and peak memory of ``hf_mhc.upcycle`` on an in-memory bfloat16 Llama, against ``copy.deepcopy`` of it.

``upcycle`` copies every backbone tensor once and adds the float32 HC tensors, so a deep copy of the source is the
floor it is measured against. Each measurement runs in its own child process, which builds the source model
(random bfloat16 weights, no download) and then reports the wall time of the step and its peak RSS above the RSS
the source already took (``ru_maxrss``). The two steps alternate ``--repeats`` times; medians are reported::

    .venv/bin/python benchmarks/bench_upcycle.py [--layers 16] [--hidden 1024] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = """
import copy, json, resource, sys, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM
import hf_mhc

step, layers, hidden = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
config = LlamaConfig(hidden_size=hidden, intermediate_size=11 * hidden // 4, num_hidden_layers=layers,
                     num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256, vocab_size=32000,
                     dtype="bfloat16")
torch.set_default_dtype(torch.bfloat16)
source = LlamaForCausalLM(config)
torch.set_default_dtype(torch.float32)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
result = hf_mhc.upcycle(source, hc_mult=4) if step == "upcycle" else copy.deepcopy(source)
seconds = time.perf_counter() - start
extra_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
source_mib = sum(p.numel() * p.element_size() for p in source.parameters()) / 2**20
print(json.dumps({"seconds": seconds, "peak_rss_above_source_mib": extra_mib, "source_mib": source_mib}))
"""


def measure(step: str, layers: int, hidden: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, step, str(layers), str(hidden)], capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    runs = {"copy.deepcopy": [], "hf_mhc.upcycle": []}
    for _ in range(args.repeats):
        runs["copy.deepcopy"].append(measure("deepcopy", args.layers, args.hidden))
        runs["hf_mhc.upcycle"].append(measure("upcycle", args.layers, args.hidden))
    source_mib = runs["hf_mhc.upcycle"][0]["source_mib"]
    results = {"config": {"layers": args.layers, "hidden": args.hidden, "dtype": "bfloat16", "hc_mult": 4,
                          "source_mib": source_mib, "repeats": args.repeats}, "steps": {}}
    print(f"bfloat16 Llama, {args.layers} layers, C = {args.hidden}: {source_mib:.0f} MiB of weights; "
          f"median of {args.repeats}, each run in a fresh process")
    print("| step | seconds | peak RSS above the source, MiB |")
    print("| --- | ---: | ---: |")
    for step, samples in runs.items():
        row = {key: statistics.median(sample[key] for sample in samples)
               for key in ("seconds", "peak_rss_above_source_mib")}
        results["steps"][step] = row
        print(f"| {step} | {row['seconds']:.2f} | {row['peak_rss_above_source_mib']:.0f} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
