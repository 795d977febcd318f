"""Time and peak memory of ``hf_mhc.upcycle`` on an in-memory bfloat16 Llama, against ``copy.deepcopy`` of it.

``upcycle`` copies every backbone tensor once and adds the float32 HC tensors, so a deep copy of the source is the
floor it is measured against. Each measurement runs in its own child process, which builds the source model
(random bfloat16 weights, no download) and then reports the wall time of the step and its peak RSS above the RSS
the source already took (``ru_maxrss``). The two steps alternate ``--repeats`` times; medians are reported::

    .venv/bin/python benchmarks/bench_upcycle.py [--layers 16] [--hidden 1024] [--repeats 3] [--json PATH]

Prints each run to stderr as it finishes, then the table; the results are written as JSON only with ``--json PATH``
(otherwise printed after the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from benchlib import add_json_argument, progress, report

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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    add_json_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs = {"copy.deepcopy": [], "hf_mhc.upcycle": []}
    for repeat in range(args.repeats):
        for name, step in (("copy.deepcopy", "deepcopy"), ("hf_mhc.upcycle", "upcycle")):
            progress(f"repeat {repeat + 1}/{args.repeats}: {name} ...")
            runs[name].append(measure(step, args.layers, args.hidden))
            progress(f"    {runs[name][-1]['seconds']:.2f} s, {runs[name][-1]['peak_rss_above_source_mib']:.0f} MiB "
                     "above the source")
    source_mib = runs["hf_mhc.upcycle"][0]["source_mib"]
    results = {"config": {"layers": args.layers, "hidden": args.hidden, "dtype": "bfloat16", "hc_mult": 4,
                          "source_mib": source_mib, "repeats": args.repeats}, "steps": {}}
    lines = [f"bfloat16 Llama, {args.layers} layers, C = {args.hidden}: {source_mib:.0f} MiB of weights; "
             f"median of {args.repeats}, each run in a fresh process",
             "| step | seconds | peak RSS above the source, MiB |",
             "| --- | ---: | ---: |"]
    for step, samples in runs.items():
        row = {key: statistics.median(sample[key] for sample in samples)
               for key in ("seconds", "peak_rss_above_source_mib")}
        results["steps"][step] = row
        lines.append(f"| {step} | {row['seconds']:.2f} | {row['peak_rss_above_source_mib']:.0f} |")
    report("\n".join(lines), results, args.json)


if __name__ == "__main__":
    main()
