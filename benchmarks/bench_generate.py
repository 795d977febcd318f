"""Greedy decoding speed of an upcycled mHC model against its residual source, side by side in one run.

For each hidden size ``C`` (``--hidden``, default 256, 1024 and 2048) and batch (``--batch``, default 1 and 8), a
random Llama with ``--layers`` decoder layers (default 8), ``C / 64`` heads of 64, a quarter as many KV heads,
``8C/3`` MLP width (rounded to 64) and a ``--vocab``-token vocabulary (default 32,000) is upcycled with
``hc_mult=4``; both models then generate ``--new-tokens`` greedy tokens after a ``--prompt``-token prompt with the
dynamic cache, ``--repeats`` times, the models alternating within each repeat (so a slow moment of a shared machine
hits all of them). The mHC model runs twice per repeat: with the CPU decode fast path
(``hf_mhc/kernels/cpu_decode.py``, the default) and with it off (``HF_MHC_CPU_DECODE=0``: the eager torch kernels, as
before it existed). Reported per case: the median time per generated token of each and the median, minimum and
maximum of the per-repeat ratios to the residual model. ``--device cuda`` runs both on a GPU (the CPU decode fast
path does not apply there: its two mHC columns run the same kernels).

``--static`` adds, for the first hidden size and batch, ``cache_implementation="static"`` with ``torch.compile``
(``CompileConfig(fullgraph=True)``, on CPU too): the compile time of the first call, then the same timing. The upcycled
model keeps its source's function, so the two also generate the same tokens; the script checks it (``tokens_equal``).
``--profile`` prints the operators of one mHC generation that took the most time (``torch.profiler``)::

    .venv/bin/python benchmarks/bench_generate.py [--hidden 256 1024 2048] [--batch 1 8] [--layers 8] [--vocab 32000]
        [--new-tokens 32] [--prompt 16] [--repeats 5] [--static] [--profile] [--device cuda] [--dtype bfloat16]
        [--json PATH]

Prints each case and repeat to stderr as it goes, then the table; the results are written as JSON only with ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time

import torch
from benchlib import add_json_argument, load_average_line, progress, report
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

import hf_mhc
from hf_mhc.kernels import cpu_decode


def build_models(hidden: int, layers: int, vocab: int, device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, hf_mhc.MHCForCausalLM]:
    """A random Llama of width ``hidden`` and its mHC upcycle (``hc_mult=4``), both in eval mode on ``device``."""
    torch.manual_seed(0)
    heads = max(1, hidden // 64)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=(8 * hidden // 3 + 63) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 4), max_position_embeddings=4096)
    source = LlamaForCausalLM(config).to(device, dtype).eval()
    return source, hf_mhc.upcycle(copy.deepcopy(source), hc_mult=4).eval()


def timed_generate(model, input_ids: torch.Tensor, new_tokens: int, **options) -> tuple[float, torch.Tensor]:
    """Seconds per generated token of one greedy ``generate``, and the generated tokens."""
    if input_ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, **options)
    if input_ids.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / new_tokens, out[:, input_ids.shape[1]:]


@contextlib.contextmanager
def eager_kernels():
    """The mHC model without the CPU decode fast path (the switch is read at each call)."""
    before = os.environ.get(cpu_decode.ENV_SWITCH)
    os.environ[cpu_decode.ENV_SWITCH] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[cpu_decode.ENV_SWITCH]
        else:
            os.environ[cpu_decode.ENV_SWITCH] = before


def spread(times: list[float], baseline: list[float], name: str) -> dict:
    ratios = [t / b for t, b in zip(times, baseline, strict=True)]
    return {f"{name}_ms_per_token": 1e3 * statistics.median(times), f"{name}_ratio_median": statistics.median(ratios),
            f"{name}_ratio_min": min(ratios), f"{name}_ratio_max": max(ratios)}


def compare(source, model, input_ids, args, label: str, eager_model=None, **options) -> dict:
    """Alternate the residual model, the mHC model and the mHC model without the fast path (``eager_model``, by
    default ``model``) ``--repeats`` times (after one warm-up each); the timings and their ratios to the residual
    model."""
    eager_model = model if eager_model is None else eager_model
    _, expected = timed_generate(source, input_ids, args.new_tokens, **options)
    _, tokens = timed_generate(model, input_ids, args.new_tokens, **options)
    with eager_kernels():
        _, eager_tokens = timed_generate(eager_model, input_ids, args.new_tokens, **options)
    residual, mhc, eager = [], [], []
    for repeat in range(args.repeats):
        progress(f"{label}: repeat {repeat + 1}/{args.repeats}")
        residual.append(timed_generate(source, input_ids, args.new_tokens, **options)[0])
        mhc.append(timed_generate(model, input_ids, args.new_tokens, **options)[0])
        with eager_kernels():
            eager.append(timed_generate(eager_model, input_ids, args.new_tokens, **options)[0])
    return ({"residual_ms_per_token": 1e3 * statistics.median(residual)} | spread(mhc, residual, "mhc")
            | spread(eager, residual, "mhc_eager")
            | {"tokens_equal": bool(torch.equal(tokens, expected) and torch.equal(eager_tokens, expected))})


def static_compile_options() -> dict:
    """``generate`` options for ``cache_implementation="static"`` with ``torch.compile``
    (``CompileConfig(fullgraph=True)``), on CPU too."""
    compile_config = CompileConfig(fullgraph=True)
    compile_config._compile_all_devices = True  # generate compiles only on accelerators unless told (not an argument)
    return {"cache_implementation": "static", "compile_config": compile_config}


def static_compiled(source, model, input_ids, args, label: str) -> dict:
    """``cache_implementation="static"`` with ``torch.compile``: the first call's seconds (compiling), then timings.
    The mHC model without the fast path is a copy compiled with the switch off: a compiled step keeps the path it
    was traced with."""
    options = static_compile_options()
    eager_model = copy.deepcopy(model)
    first = {}
    plain = contextlib.nullcontext
    for name, candidate, switch in (("residual", source, plain), ("mhc", model, plain),
                                    ("mhc_eager", eager_model, eager_kernels)):
        progress(f"{label}: compiling {name}")
        start = time.perf_counter()
        with switch():
            timed_generate(candidate, input_ids, args.new_tokens, **options)
        first[f"{name}_first_call_s"] = time.perf_counter() - start
    return first | compare(source, model, input_ids, args, label, eager_model=eager_model, **options)


def profile_mhc(model, input_ids, args) -> str:
    from torch.profiler import profile

    with profile() as prof:
        timed_generate(model, input_ids, args.new_tokens)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 1024, 2048], help="hidden sizes C")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8], help="batch sizes")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--static", action="store_true", help="also time the static cache with torch.compile")
    parser.add_argument("--profile", action="store_true", help="print the top operators of one mHC generation")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the models' dtype")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if min(args.hidden) < 64 or any(c % 64 for c in args.hidden):
        parser.error("--hidden sizes must be positive multiples of 64 (heads of 64)")
    if min(args.batch + [args.layers, args.vocab, args.new_tokens, args.prompt, args.repeats]) < 1:
        parser.error("--batch, --layers, --vocab, --new-tokens, --prompt and --repeats must be positive")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    results = {"device": args.device, "dtype": args.dtype, "threads": torch.get_num_threads(), "layers": args.layers,
               "vocab": args.vocab, "hc_mult": 4, "new_tokens": args.new_tokens, "prompt": args.prompt,
               "repeats": args.repeats, "load_average_before": os.getloadavg()[0], "cases": []}
    lines = [f"greedy decoding, {args.layers} layers, vocabulary {args.vocab}, hc_mult 4, {args.new_tokens} new "
             f"tokens, {args.dtype} on {args.device}, {torch.get_num_threads()} threads; ms per generated token "
             f"(median of {args.repeats})",
             "| C | batch | cache | residual | mHC | mHC / residual (min-max) | mHC, eager kernels | eager / residual "
             "(min-max) | same tokens |",
             "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    cases = [(hidden, batch) for hidden in args.hidden for batch in args.batch]
    for index, (hidden, batch) in enumerate(cases, 1):
        label = f"case {index}/{len(cases)}: C={hidden} batch={batch}"
        progress(f"{label}: building")
        source, model = build_models(hidden, args.layers, args.vocab, args.device, getattr(torch, args.dtype))
        input_ids = torch.randint(0, args.vocab, (batch, args.prompt),
                                  generator=torch.Generator().manual_seed(index)).to(args.device)
        runs = [("dynamic", compare(source, model, input_ids, args, label))]
        if args.static and index == 1:
            runs.append(("static + compile", static_compiled(source, model, input_ids, args, f"{label} static")))
        if args.profile and index == 1:
            print(profile_mhc(model, input_ids, args), flush=True)
        for cache, run in runs:
            results["cases"].append({"hidden": hidden, "batch": batch, "cache": cache} | run)
            cells = [f"{run['residual_ms_per_token']:.2f}"]
            for name in ("mhc", "mhc_eager"):
                cells += [f"{run[f'{name}_ms_per_token']:.2f}", f"{run[f'{name}_ratio_median']:.3f} "
                          f"({run[f'{name}_ratio_min']:.3f}-{run[f'{name}_ratio_max']:.3f})"]
            lines.append(f"| {hidden} | {batch} | {cache} | {' | '.join(cells)} | {run['tokens_equal']} |")
    lines.append(load_average_line(results))
    report("\n".join(lines), results, args.json)
    return results


if __name__ == "__main__":
    main()
