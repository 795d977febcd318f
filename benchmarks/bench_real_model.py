"""SmolLM2-135M-Instruct (``make real-model``) against its mHC upcycle (``hf_mhc.upcycle(source, hc_mult=4)``),
side by side in one run: decoding speed, training-step time, bytes held for backward against ``hf-mhc plan``, and
``hf-mhc convert`` against copying the folder.

    .venv/bin/python benchmarks/bench_real_model.py [--model FOLDER] [--only decode train memory convert]
        [--threads N] [--repeats 5] [--new-tokens 48] [--static] [--batch 2] [--tokens 128]
        [--dtypes float32 bfloat16] [--profile] [--convert-repeats 3] [--json PATH]

``--model``: any folder of a residual causal LM that ``hf_mhc.upcycle`` takes (default: the folder ``make real-model``
built, ``tools/real_model.py``'s ``real_model_folder()``), loaded in float32. ``--threads``: torch's threads and
``OMP_NUM_THREADS`` of the ``hf-mhc convert`` processes (default: the environment's, as torch reads it). Sections
(``--only`` picks some; they run in this order):

- ``decode``: greedy decoding of ``--new-tokens`` tokens (default 48) after a chat prompt (``--prompt``, default
  "What is the capital of France?", through the tokenizer's chat template when it has one), batch 1, the dynamic
  cache; with ``--static`` also ``cache_implementation="static"`` with ``torch.compile`` (the first call, compiling,
  timed apart). One warm-up call each, then ``--repeats`` repeats, the two models alternating within each: tokens/s
  of each (the new tokens over the whole ``generate`` call, prefill included; median) and the median, minimum and
  maximum of the per-repeat ratios mHC / residual. Whether the two generated the same tokens (``tokens_equal``) and
  the residual model's answer are recorded.
- ``memory``: the bytes autograd holds for backward after a training forward (labels, no cache) of ``--batch`` x
  ``--tokens`` tokens, parameters excluded (``hf_mhc.activation_count.held_by_case`` on the real models): the
  residual model, the mHC model and the mHC model with ``hc_recompute``; beside each, what ``hf-mhc plan FOLDER
  --hc-mult 4 --dtype float32 --tokens T --batch B`` predicts (``hf_mhc.planning.plan_memory``, on fake tensors) and
  the ratio measured / planned.
- ``train``: one training step (zero the gradients, forward and backward of the loss, AdamW step) on the same
  ``--batch`` x ``--tokens`` tokens, for the residual model, the mHC model and the mHC model with ``hc_recompute``,
  in each of ``--dtypes``: ``float32``, and ``bfloat16`` as ``torch.autocast("cpu", dtype=torch.bfloat16)`` around
  the forward (float32 weights and optimizer). One warm-up step each, then ``--repeats`` repeats, the three
  alternating within each: the median step time of each and its ratio to the residual model's median, with the
  minimum and maximum of the per-repeat ratios. With ``--profile``, one more step of each under ``torch.profiler``
  says where a step's time goes: hf-mhc's ops (``hf_mhc::*``, forward and backward, inclusive), the AdamW step, the
  matrix products (``aten::mm`` / ``addmm`` / ``bmm``, outside hf-mhc's ops), and the rest.
- ``convert``: ``hf-mhc convert FOLDER OUT`` (it verifies the result: logits and greedy decoding) and ``hf-mhc
  convert --no-verify`` against ``shutil.copytree`` of the folder, each in a child process (wall time and peak RSS:
  ``bench_convert.measure``), alternating, ``--convert-repeats`` times (default 3); medians and the ratios to the
  copy.

The peak RSS of this process (``ru_maxrss``, a high-water mark) and its RSS are recorded after loading and after each
section. Prints progress to stderr as it goes, then one markdown table per section headed by the command line; the
results are written as JSON only with ``--json PATH`` (otherwise printed after the tables).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import resource
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_convert import HF_MHC_SCRIPT, measure
from bench_generate import static_compile_options, timed_generate
from bench_training_step import recomputing
from benchlib import add_json_argument, load_average_line, progress, report
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_mhc
from hf_mhc.activation_count import held_by_case
from hf_mhc.planning import plan_memory

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("decode", "memory", "train", "convert")  # the order they run in
HC_MULT = 4
PROMPT = "What is the capital of France?"
COPY_CODE = "import shutil, sys; shutil.copytree(sys.argv[1], sys.argv[2])"
TRAINING_CASES = ("residual", "mhc", "mhc + hc_recompute")  # the names hf-mhc plan gives them too
CONVERT_COMMANDS = ("copy", "convert", "convert --no-verify")
MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def real_model_folder() -> Path:
    """The folder ``make real-model`` built (``tools/real_model.py``); ``OSError`` with a one-line message when it
    is not there."""
    spec = importlib.util.spec_from_file_location("real_model", ROOT / "tools" / "real_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.real_model_folder()


def ratio_spread(values: list[float], baseline: list[float]) -> dict[str, float]:
    """``values`` against ``baseline`` (one of each per repeat): the ratio of their medians, and the median, minimum
    and maximum of the per-repeat ratios."""
    ratios = [value / base for value, base in zip(values, baseline, strict=True)]
    return {"ratio_of_medians": statistics.median(values) / statistics.median(baseline),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def alternate(runs: dict[str, Callable[[], float]], repeats: int, label: str) -> dict[str, list[float]]:
    """Call each of ``runs`` (each returns seconds) in turn, ``repeats`` times; the seconds of each, per repeat."""
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(repeats):
        for name, run in runs.items():
            samples[name].append(run())
        progress(f"{label}: repeat {repeat + 1}/{repeats}: "
                 + "; ".join(f"{name} {1e3 * times[-1]:.1f} ms" for name, times in samples.items()))
    return samples


def threads_text() -> str:
    threads = torch.get_num_threads()
    return f"{threads} thread" + ("" if threads == 1 else "s")


def record_rss(results: dict, phase: str) -> None:
    """Append this process's peak RSS (``ru_maxrss``, KiB on Linux) and current RSS, in MiB, after ``phase``."""
    pages = int(Path("/proc/self/statm").read_text().split()[1]) if Path("/proc/self/statm").exists() else 0
    results["rss"].append({"phase": phase,
                           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                           "rss_mib": pages * resource.getpagesize() / 2**20})


def chat_input_ids(tokenizer, prompt: str) -> torch.Tensor:
    """``[1, T]`` ids of ``prompt`` as a user turn through the tokenizer's chat template (with the generation prompt),
    or of the prompt itself when the tokenizer has no template."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def training_ids(vocab: int, args: argparse.Namespace) -> torch.Tensor:
    """The ``[batch, tokens]`` random token ids the memory and training sections run on (the same in both)."""
    return torch.randint(0, vocab, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))


def seconds_per_token(model, input_ids: torch.Tensor, new_tokens: int, options: dict) -> float:
    return timed_generate(model, input_ids, new_tokens, **options)[0]


def decode(source, mhc, tokenizer, args: argparse.Namespace) -> dict:
    input_ids = chat_input_ids(tokenizer, args.prompt)
    models = {"residual": source.eval(), "mhc": mhc.eval()}
    runs = []
    caches = [("dynamic", {})] + ([("static + compile", static_compile_options())] if args.static else [])
    for cache, options in caches:
        label = f"decode, {cache} cache"
        first_call, tokens = {}, {}
        for name, model in models.items():
            progress(f"{label}: first call of {name}" + (" (compiling)" if options else ""))
            start = time.perf_counter()
            _, tokens[name] = timed_generate(model, input_ids, args.new_tokens, **options)
            first_call[name] = time.perf_counter() - start
        samples = alternate({name: functools.partial(seconds_per_token, model, input_ids, args.new_tokens, options)
                             for name, model in models.items()}, args.repeats, label)
        per_second = {name: [1 / seconds for seconds in times] for name, times in samples.items()}
        runs.append({"cache": cache, "first_call_s": first_call,
                     "residual_tokens_per_s": statistics.median(per_second["residual"]),
                     "mhc_tokens_per_s": statistics.median(per_second["mhc"]),
                     **ratio_spread(per_second["mhc"], per_second["residual"]),
                     "tokens_equal": bool(torch.equal(tokens["mhc"], tokens["residual"])),
                     "answer": tokenizer.decode(tokens["residual"][0], skip_special_tokens=True)})
    return {"prompt": args.prompt, "chat_template": bool(tokenizer.chat_template),
            "prompt_tokens": input_ids.shape[1], "new_tokens": args.new_tokens, "runs": runs}


def decode_table(section: dict, args: argparse.Namespace) -> list[str]:
    lines = [f"greedy decoding of {section['new_tokens']} tokens after the {section['prompt_tokens']}-token prompt "
             f"{section['prompt']!r}" + (" (chat template)" if section["chat_template"] else "")
             + f", batch 1, float32, {threads_text()}; tokens/s (new tokens over the whole generate call, median of "
             f"{args.repeats})",
             "| cache | residual tokens/s | mHC tokens/s | mHC / residual, median (min-max) | first call s, residual "
             "/ mHC | same tokens |",
             "| --- | ---: | ---: | ---: | ---: | --- |"]
    for run in section["runs"]:
        first = run["first_call_s"]
        lines.append(f"| {run['cache']} | {run['residual_tokens_per_s']:.2f} | {run['mhc_tokens_per_s']:.2f} | "
                     f"{run['ratio_median']:.3f} ({run['ratio_min']:.3f}-{run['ratio_max']:.3f}) | "
                     f"{first['residual']:.1f} / {first['mhc']:.1f} | {run['tokens_equal']} |")
    lines.append(f"residual model's answer: {section['runs'][0]['answer']!r}")
    return lines


def memory(source, mhc, folder: Path, args: argparse.Namespace) -> dict:
    ids = training_ids(source.config.vocab_size, args)
    progress("memory: bytes held for backward by the residual model")
    by_layer = held_by_case(source.train(), ids, ((False, False),))
    progress("memory: bytes held for backward by the mHC model, without and with hc_recompute")
    by_layer += held_by_case(mhc.train(), ids, ((False, False), (True, False)))
    mhc.config.hc_recompute = False  # held_by_case leaves the last case's setting
    progress("memory: hf-mhc plan of the same shapes")
    plan = plan_memory(folder, tokens=args.tokens, batch=args.batch, dtype="float32", hc_mult=HC_MULT)
    rows = []
    for name, counted in zip(TRAINING_CASES, by_layer, strict=True):
        measured, planned = sum(counted.values()), plan.activation_bytes[name]
        rows.append({"case": name, "measured_bytes": measured, "planned_bytes": planned,
                     "measured_over_planned": measured / planned})
    command = shlex.join(["hf-mhc", "plan", str(folder), "--hc-mult", str(HC_MULT), "--dtype", "float32",
                          "--tokens", str(args.tokens), "--batch", str(args.batch), "--json", "PATH"])
    return {"batch": args.batch, "tokens": args.tokens, "dtype": "float32", "plan_command": command, "rows": rows}


def memory_table(section: dict) -> list[str]:
    lines = [f"bytes held for backward after a training forward (parameters excluded), batch {section['batch']} x "
             f"{section['tokens']} tokens, float32; planned: `{section['plan_command']}`",
             "| model | measured bytes | planned bytes | measured / planned |",
             "| --- | ---: | ---: | ---: |"]
    lines += [f"| {row['case']} | {row['measured_bytes']:,} | {row['planned_bytes']:,} | "
              f"{row['measured_over_planned']:.3f} |" for row in section["rows"]]
    return lines


def training_step(model, optimizer, ids: torch.Tensor, autocast: bool) -> float:
    """Seconds of one step: zero the gradients, forward (under bfloat16 autocast when asked) and backward of the loss,
    the optimizer's step."""
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    optimizer.step()
    return time.perf_counter() - start


def precision_name(dtype: str) -> str:
    """How a ``--dtypes`` entry trains: ``float32``, or ``bfloat16 autocast``."""
    return f"{dtype} autocast" if dtype == "bfloat16" else dtype


def train(source, mhc, args: argparse.Namespace) -> dict:
    ids = training_ids(source.config.vocab_size, args)
    models = {"residual": source.train(), "mhc": mhc.train()}
    optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-5) for name, model in models.items()}

    def step(name: str, autocast: bool) -> float:
        model_name = name.split(" + ")[0]
        context = recomputing(mhc, True) if name.endswith("hc_recompute") else contextlib.nullcontext()
        with context:
            return training_step(models[model_name], optimizers[model_name], ids, autocast)

    rows = []
    for dtype in args.dtypes:
        label = f"train, {precision_name(dtype)}"
        runs = {name: functools.partial(step, name, dtype == "bfloat16") for name in TRAINING_CASES}
        for name, run in runs.items():
            progress(f"{label}: warm-up step of {name}")
            run()
        samples = alternate(runs, args.repeats, label)
        for name, times in samples.items():
            rows.append({"dtype": dtype, "case": name, "median_ms": 1e3 * statistics.median(times),
                         **ratio_spread(times, samples["residual"])})
            if args.profile:
                progress(f"{label}: profiled step of {name}")
                rows[-1]["profile_ms"] = profiled_step(runs[name])
    return {"batch": args.batch, "tokens": args.tokens, "optimizer": "AdamW", "rows": rows}


def is_mhc_op(event) -> bool:
    return event.name.startswith("hf_mhc::")


def under_mhc_op(event) -> bool:
    """Whether a profiler event ran inside one of hf-mhc's ops."""
    parent = event.cpu_parent
    while parent is not None and not is_mhc_op(parent):
        parent = parent.cpu_parent
    return parent is not None


def profiled_step(run: Callable[[], float]) -> dict[str, float]:
    """Milliseconds of one training step under ``torch.profiler``, split into hf-mhc's ops (every ``hf_mhc::`` op,
    forward and backward, with what it calls), the optimizer's step, the matrix products outside hf-mhc's ops, and the
    rest."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        step_ms = 1e3 * run()
    events = profiler.events()
    mhc_ops = sum(event.cpu_time_total for event in events if is_mhc_op(event) and not under_mhc_op(event)) / 1e3
    optimizer = sum(event.cpu_time_total for event in events if event.name.startswith("Optimizer.step#")) / 1e3
    matmuls = sum(event.self_cpu_time_total for event in events
                  if event.name in MATMULS and not under_mhc_op(event)) / 1e3
    return {"step": step_ms, "hf_mhc_ops": mhc_ops, "optimizer": optimizer, "matmuls": matmuls,
            "rest": step_ms - mhc_ops - optimizer - matmuls}


def train_table(section: dict, args: argparse.Namespace) -> list[str]:
    lines = [f"training step (zero_grad, forward + backward of the loss, AdamW step), batch {section['batch']} x "
             f"{section['tokens']} tokens, {threads_text()}; median of {args.repeats}; ratio to "
             "the residual median (min-max of the per-repeat ratios)",
             "| precision | model | median ms | / residual (min-max) |",
             "| --- | --- | ---: | ---: |"]
    for row in section["rows"]:
        lines.append(f"| {precision_name(row['dtype'])} | {row['case']} | {row['median_ms']:.0f} | "
                     f"{row['ratio_of_medians']:.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f}) |")
    profiled = [row for row in section["rows"] if "profile_ms" in row]
    if profiled:
        parts = ("step", "hf_mhc_ops", "optimizer", "matmuls", "rest")
        lines += ["", "one more step of each under torch.profiler, ms: hf-mhc's ops (forward and backward, inclusive), "
                  "the AdamW step, matrix products outside hf-mhc's ops, the rest",
                  "| precision | model | " + " | ".join(parts) + " |", "| --- | --- |" + " ---: |" * len(parts)]
        for row in profiled:
            lines.append(f"| {precision_name(row['dtype'])} | {row['case']} | "
                         + " | ".join(f"{row['profile_ms'][part]:.0f}" for part in parts) + " |")
    return lines


def convert(folder: Path, args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONVERT_COMMANDS}
    with tempfile.TemporaryDirectory(prefix="bench-real-model-") as tmp:
        out = Path(tmp) / "out"
        commands = {
            "copy": [sys.executable, "-c", COPY_CODE, str(folder), str(out)],
            "convert": [str(HF_MHC_SCRIPT), "convert", str(folder), str(out), "--hc-mult", str(HC_MULT)],
            "convert --no-verify": [str(HF_MHC_SCRIPT), "convert", str(folder), str(out), "--hc-mult", str(HC_MULT),
                                    "--no-verify"],
        }
        for repeat in range(args.convert_repeats):
            for name, command in commands.items():
                progress(f"convert: repeat {repeat + 1}/{args.convert_repeats}: {name}")
                runs[name].append(measure(command))
                shutil.rmtree(out)
    median = {name: {key: statistics.median(run[key] for run in results) for key in results[0]}
              for name, results in runs.items()}
    return {"repeats": args.convert_repeats, "median": median, "runs": runs,
            "ratio_to_copy_seconds": {name: median[name]["seconds"] / median["copy"]["seconds"]
                                      for name in CONVERT_COMMANDS[1:]}}


def convert_table(section: dict, folder: Path) -> list[str]:
    median, ratio = section["median"], section["ratio_to_copy_seconds"]
    lines = [f"`hf-mhc convert` of {folder} (hc_mult {HC_MULT}) against `shutil.copytree` of it, each in a fresh "
             f"process; medians of {section['repeats']}",
             "| command | seconds | / copy | peak RSS MB |",
             "| --- | ---: | ---: | ---: |",
             f"| `shutil.copytree` | {median['copy']['seconds']:.2f} | 1 | {median['copy']['peak_rss_mb']:.0f} |"]
    lines += [f"| `hf-mhc {name}` | {median[name]['seconds']:.2f} | {ratio[name]:.2f} | "
              f"{median[name]['peak_rss_mb']:.0f} |" for name in CONVERT_COMMANDS[1:]]
    return lines


def rss_table(results: dict) -> list[str]:
    lines = ["this process's memory after each phase (peak: ru_maxrss, a high-water mark)",
             "| after | peak RSS MiB | RSS MiB |", "| --- | ---: | ---: |"]
    return lines + [f"| {row['phase']} | {row['peak_rss_mib']:,.0f} | {row['rss_mib']:,.0f} |"
                    for row in results["rss"]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, metavar="FOLDER",
                        help="a residual causal LM folder (default: the one make real-model built)")
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION",
                        help=f"the sections to run, among {', '.join(SECTIONS)} (default: all)")
    parser.add_argument("--threads", type=int, help="torch threads (default: the environment's OMP_NUM_THREADS)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of decode and train (default 5)")
    parser.add_argument("--prompt", default=PROMPT, help=f"the user turn decoded after (default {PROMPT!r})")
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy tokens generated (default 48)")
    parser.add_argument("--static", action="store_true", help="also decode with the static cache and torch.compile")
    parser.add_argument("--batch", type=int, default=2, help="sequences of memory and train (default 2)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sequence of memory and train (default 128)")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16"], default=["float32", "bfloat16"],
                        help="train in float32 and/or under bfloat16 autocast (default both)")
    parser.add_argument("--profile", action="store_true",
                        help="one more training step of each model under torch.profiler: where its time goes")
    parser.add_argument("--convert-repeats", type=int, default=3, help="repeats of convert (default 3)")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if min(args.repeats, args.new_tokens, args.batch, args.tokens, args.convert_repeats, args.threads or 1) < 1:
        parser.error("--threads, --repeats, --new-tokens, --batch, --tokens and --convert-repeats must be positive")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the hf-mhc convert processes
    try:
        folder = args.model if args.model is not None else real_model_folder()
    except OSError as error:
        sys.exit(f"bench_real_model.py: error: {error}")
    if not (folder / "config.json").is_file():
        sys.exit(f"bench_real_model.py: error: --model: no config.json in {folder}")
    threads = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']} " if "OMP_NUM_THREADS" in os.environ else ""
    command = threads + shlex.join([".venv/bin/python", "benchmarks/bench_real_model.py", *argv])
    sections = [name for name in SECTIONS if name in args.only]
    results = {"command": command, "model": str(folder), "hc_mult": HC_MULT, "threads": torch.get_num_threads(),
               "repeats": args.repeats, "sections": sections, "load_average_before": os.getloadavg()[0], "rss": []}
    lines = [f"command: `{command}`"]
    if set(sections) & {"decode", "memory", "train"}:
        progress(f"loading {folder} and upcycling it to hc_mult={HC_MULT}")
        torch.manual_seed(0)
        source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        mhc = hf_mhc.upcycle(source, hc_mult=HC_MULT)
        results |= {"residual_parameters": sum(p.numel() for p in source.parameters()),
                    "mhc_parameters": sum(p.numel() for p in mhc.parameters())}
        lines.append(f"{folder.name}: {source.config.num_hidden_layers} layers, hidden {source.config.hidden_size}, "
                     f"{results['residual_parameters']:,} parameters; upcycled to hc_mult {HC_MULT}: "
                     f"{results['mhc_parameters']:,}")
        record_rss(results, "loading both models")
    if "decode" in sections:
        results["decode"] = decode(source, mhc, AutoTokenizer.from_pretrained(folder), args)
        lines += ["", *decode_table(results["decode"], args)]
        record_rss(results, "decode")
    if "memory" in sections:  # before train, whose hc_recompute runs set each layer's own switch
        results["memory"] = memory(source, mhc, folder, args)
        lines += ["", *memory_table(results["memory"])]
        record_rss(results, "memory")
    if "train" in sections:
        results["train"] = train(source, mhc, args)
        lines += ["", *train_table(results["train"], args)]
        record_rss(results, "train")
    if "convert" in sections:
        results["convert"] = convert(folder, args)
        lines += ["", *convert_table(results["convert"], folder)]
    if results["rss"]:
        lines += ["", *rss_table(results)]
    lines += ["", load_average_line(results)]
    report("\n".join(lines), results, args.json)
    return results


if __name__ == "__main__":
    main()
