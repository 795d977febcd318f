"""Every GPU claim of hf-mhc measured in one command, on a CUDA machine (``make gpu-check [ARGS=--quick]``).

    .venv/bin/python benchmarks/gpu_check.py [--quick] [--dry-run] [--out gpu-check]

Runs, each in its own process (a failing step does not stop the next), printing each step and its time:

1. ``tests``: every test that takes ``HF_MHC_TEST_DEVICE=cuda``, on CUDA tensors with the compiled Triton kernels (the
   ops and residual maps, n = 1 to 8, float32, bfloat16 and float16; ``apply_mhc_kernels`` on transformers'
   DeepSeek-V4, GLM-5-Next and HY-V4; greedy generation; the static cache under fullgraph ``torch.compile``), and
   every Triton kernel compiled to sm_90 and sm_80 cubins without register spills (not with ``--quick``);
2. ``kernels``: the device's device-to-device copy bandwidth, then ``bench_kernels.py`` with it as the peak (each
   kernel's achieved fraction of it) and the fused site, forward + backward, against transformers' DeepSeek-V4 path
   at n = 4, C = 4096, bfloat16;
3. ``training_step``: an mHC model's training step against its residual source (bfloat16, C = 2048; the paper
   reports 6.7 % more training time at n = 4);
4. ``generate``: greedy decoding, mHC against residual, with the dynamic cache and with the static cache under
   ``torch.compile``;
5. ``memory``: bytes saved for backward and peak CUDA memory, mHC against residual, with and without
   ``hc_recompute``;
6. ``vllm``, where this Python can import vLLM (with hf-mhc installed beside it, docs/serving.md): ``bench_vllm.py``,
   SmolLM2-135M-Instruct (``make real-model``) and its upcycle served by vLLM in bfloat16, the mHC model by the native
   model (vLLM's compiled mHC kernels) and by the Transformers backend, at 1 and 16 clients.

Each step writes one JSON file into ``--out`` (``summary.json`` beside them: each step's command, seconds and exit
status), then a summary table goes to stdout. The exit status is 1 when any step failed. Without CUDA it refuses in
one line before doing anything; ``--dry-run`` lists the steps and exits 0 on any machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
# The tests that honour HF_MHC_TEST_DEVICE=cuda (the ops and residual maps at every n and dtype, apply_mhc_kernels on
# transformers' DeepSeek-V4 / GLM-5-Next / HY-V4, greedy generation, the static cache under fullgraph torch.compile),
# then the compile-for-a-real-GPU check (it needs no GPU, but belongs with the GPU claims; --quick leaves it out).
CUDA_TESTS = ["tests/test_kernels.py", "tests/test_monkey_patch.py",
              "tests/test_generation.py::test_greedy_dict_outputs",
              "tests/test_generation.py::test_static_cache_and_fullgraph_compile_equal_the_dynamic_cache"]
COMPILE_TEST = "tests/test_triton_gpu_compile.py"


class Step(NamedTuple):
    """One step: a command run from the repository root, the JSON file it writes into the results folder, and the
    environment variables it sets."""

    name: str
    what: str
    command: list[str]
    result: str
    env: dict[str, str] = {}  # shared by the steps that set none; never mutated


def steps(out: Path, quick: bool) -> list[Step]:
    """The steps of a run, their sizes chosen to fit an H100 / H200-class GPU in 8 minutes (3 with ``quick``), and
    the ``vllm`` step's few minutes more where it runs."""
    python = sys.executable
    tests_json = out / "tests.json"
    # Run from tests/ (see run): from the root, `python -m` would let kernels/ shadow the `kernels` package that
    # transformers imports.
    pytest_args = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
                   "--junit-xml", str(out / "tests.xml")]
    tests = [*pytest_args, *(str(ROOT / test) for test in CUDA_TESTS + ([] if quick else [COMPILE_TEST]))]

    def script(name: str, *args: str) -> list[str]:
        result = out / f"{name.removeprefix('bench_')}.json"
        return [python, str(BENCHMARKS / f"{name}.py"), *args, "--json", str(result)]

    repeats = "5" if quick else "15"
    return [
        Step("tests", "the CUDA test suite (HF_MHC_TEST_DEVICE=cuda)", tests, tests_json.name,
             env={"HF_MHC_TEST_DEVICE": "cuda"}),
        Step("kernels", "copy bandwidth, then each kernel's fraction of it and the site vs DeepSeek-V4 (n=4, C=4096)",
             script("bench_kernels", "--device", "cuda", "--n", "4", "--hidden", "4096", "--dtype", "bfloat16",
                    "--tokens", "8192" if quick else "16384", "--repeats", repeats, "--peak-gbps", "copy"),
             "kernels.json"),
        Step("training_step", "training step, mHC vs residual (bf16, C=2048; the paper: +6.7 %)",
             script("bench_training_step", "--device", "cuda", "--dtype", "bfloat16", "--hidden", "2048",
                    "--layers", "4" if quick else "8", "--tokens", "4096" if quick else "8192",
                    "--repeats", repeats),
             "training_step.json"),
        Step("generate", "greedy decoding, mHC vs residual (dynamic cache; static cache + torch.compile)",
             script("bench_generate", "--device", "cuda", "--dtype", "bfloat16", "--hidden", "2048",
                    "--batch", "1", *([] if quick else ["8"]), "--layers", "8", "--new-tokens", "32" if quick else "64",
                    "--repeats", "3" if quick else "5", "--static"),
             "generate.json"),
        Step("memory", "bytes saved for backward and peak CUDA memory, mHC vs residual, hc_recompute",
             script("bench_memory", "--device", "cuda", "--dtype", "bfloat16", "--hidden", "2048",
                    "--layers", "4", "--tokens", "4096"),
             "memory.json"),
    ] + ([Step("vllm", "vLLM serving, mHC vs residual (SmolLM2-135M-Instruct, bf16; native and Transformers backend)",
               script("bench_vllm", "--vllm-python", python, "--dtype", "bfloat16", "--concurrency", "1", "16",
                      "--repeats", "3" if quick else "5"),
               "vllm.json")] if importlib.util.find_spec("vllm") is not None else [])


def summarize_tests(xml: Path, target: Path, returncode: int) -> None:
    """``tests.json``: pytest's counts and the failing tests' ids, from its JUnit XML (which is then removed)."""
    import xml.etree.ElementTree as ElementTree

    summary: dict = {"exit_status": returncode}
    if xml.exists():
        suite = ElementTree.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        summary |= {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
        summary["failed"] = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
                             if case.find("failure") is not None or case.find("error") is not None]
        xml.unlink()
    target.write_text(json.dumps(summary, indent=2) + "\n")


def run(step: Step, out: Path) -> dict:
    start = time.perf_counter()
    result = subprocess.run(step.command, cwd=ROOT / "tests" if step.name == "tests" else ROOT,
                            env=os.environ | step.env)
    seconds = time.perf_counter() - start
    if step.name == "tests":
        summarize_tests(out / "tests.xml", out / step.result, result.returncode)
    return {"step": step.name, "seconds": round(seconds, 1), "exit_status": result.returncode,
            "result": step.result, "command": [Path(part).name if "/" in part else part for part in step.command]}


def headline(step: str, path: Path) -> str:
    """One line of what a step measured, from its JSON."""
    if not path.exists():
        return "no result"
    data = json.loads(path.read_text())
    if step == "tests":
        return f"{data.get('tests', 0)} tests, {data.get('failures', 0) + data.get('errors', 0)} failed"
    if step == "kernels":
        fractions = ", ".join(f"{row['op']} {100 * row['fraction_of_peak']:.0f} %" for row in data["kernels"]
                              if row["backend"] != "liger" and row["fraction_of_peak"])
        return f"copy {data['peak_gbps']:.0f} GB/s; {fractions}; site {data['speedup']:.2f}x DeepSeek-V4"
    if step == "training_step":
        medians = data["median_ms"]
        baseline = medians.pop("residual Llama")
        return "; ".join(f"{name} +{100 * (value / baseline - 1):.1f} %" for name, value in medians.items())
    if step == "generate":
        return "; ".join(f"C={case['hidden']} batch {case['batch']} {case['cache']}: {case['mhc_ratio_median']:.2f}x"
                         for case in data["cases"])
    if step == "vllm":
        return "; ".join(f"{case['path']} {clients} clients: {run['throughput_ratio_median']:.2f}x"
                         for case in data["cases"] for clients, run in case.items() if isinstance(run, dict))
    if step == "memory":
        peak = data.get("peak_bytes", {})
        return "; ".join(f"{name} {value / 2**20:.0f} MiB peak" for name, value in peak.items())
    return ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats: 3 minutes, not 8")
    parser.add_argument("--dry-run", action="store_true", help="list the steps and their commands; run nothing")
    parser.add_argument("--out", type=Path, default=ROOT / "gpu-check", help="the results folder (default gpu-check/)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out.resolve()
    plan = steps(out, args.quick)
    if args.dry_run:
        for number, step in enumerate(plan, start=1):
            env = "".join(f"{key}={value} " for key, value in step.env.items())
            print(f"[{number}/{len(plan)}] {step.name}: {step.what} -> {out / step.result}\n    {env}"
                  + " ".join(step.command))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: error: no CUDA device (torch.cuda.is_available() is False); nothing was run",
              file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    print(f"gpu-check on {device}, torch {torch.__version__}, results in {out}", flush=True)
    done = []
    for number, step in enumerate(plan, start=1):
        print(f"[{number}/{len(plan)}] {step.name}: {step.what}", flush=True)
        done.append(run(step, out))
        print(f"[{number}/{len(plan)}] {step.name}: exit status {done[-1]['exit_status']}, "
              f"{done[-1]['seconds']:.0f} s", flush=True)
    failed = [row["step"] for row in done if row["exit_status"]]
    (out / "summary.json").write_text(json.dumps(
        {"device": device, "torch": torch.__version__, "quick": args.quick, "steps": done, "failed": failed},
        indent=2) + "\n")
    print("\n| step | seconds | status | result |\n| --- | ---: | --- | --- |")
    for row in done:
        status = "ok" if row["exit_status"] == 0 else f"FAILED ({row['exit_status']})"
        print(f"| {row['step']} | {row['seconds']:.0f} | {status} | {headline(row['step'], out / row['result'])} |")
    print(f"total {sum(row['seconds'] for row in done):.0f} s; " + (f"failed: {', '.join(failed)}" if failed
                                                                     else "every step passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
