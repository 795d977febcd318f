"""vLLM serving throughput and latency of an upcycled mHC model against its residual source, on each path vLLM can
serve it by.

The residual causal LM of ``--model FOLDER`` (default: SmolLM2-135M-Instruct of ``make real-model``) and its mHC
upcycle (``hc_mult=4``) are each served, in float32 (or ``--dtype bfloat16``; the HC parameters stay float32), by
vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``, run by the Python of the vLLM
environment: ``--vllm-python``, default ``.venv/vllm/bin/python`` of ``make vllm-env``), on loopback, the two servers
side by side: the residual model by
vLLM's own model of its family, the mHC model by each of ``--paths``: ``native`` (hf-mhc's vLLM plugin, vLLM's
choice) and ``transformers`` (vLLM's Transformers backend, ``--model-impl transformers``). For each concurrency
(``--concurrency``, default 1, 4 and 16) and repeat, ``concurrency`` clients of the ``openai`` package send
``--requests-per-client`` greedy completions of a ``--prompt``-token prompt each (the end-of-sequence token ignored:
every answer is ``--new-tokens`` long), to the residual server, then the mHC one, alternating within the repeat so
that a slow moment of a shared machine hits both (``bench_serve.py``'s bursts). Reported per path and concurrency:
generated tokens per second of each, the median, minimum and maximum of the per-repeat mHC / residual ratios, and
the p50 and p99 of the request latencies of all repeats::

    .venv/bin/python benchmarks/bench_vllm.py [--model FOLDER] [--paths native transformers] [--concurrency 1 4 16]
        [--requests-per-client 2] [--new-tokens 32] [--prompt 16] [--repeats 3] [--dtype float32] [--eager]
        [--json PATH]

vLLM compiles its models unless ``--eager`` (``--enforce-eager``). Prints each case and repeat to stderr as it goes,
then the table; the results are written as JSON only with ``--json``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_real_model import real_model_folder
from bench_serve import free_port, measure, save_models, stop_server, table_row
from benchlib import add_json_argument, load_average_line, progress, report
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parents[1]

DEFAULT_VLLM_PYTHON = REPO / ".venv" / "vllm" / "bin" / "python"
PATHS = {"native": "auto", "transformers": "transformers"}  # --paths: vLLM's --model-impl for the mHC model
STARTUP_TIMEOUT_S = 600
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": ""}


def start_vllm_server(python: Path, model: Path, model_impl: str, dtype: str, eager: bool, log: Path
                      ) -> subprocess.Popen:
    """Start vLLM's OpenAI-compatible server of ``model`` on 127.0.0.1 (:func:`wait_until_healthy` waits for it);
    the requests' model name is ``str(model)``."""
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", dtype,
               "--max-model-len", "1024", "--model-impl", model_impl, "--trust-remote-code", "--host", "127.0.0.1",
               "--port", str(free_port()), *(["--enforce-eager"] if eager else [])]
    with open(log, "w") as output:
        return subprocess.Popen(command, env={**os.environ, **VLLM_ENV}, stdout=output, stderr=subprocess.STDOUT)


def wait_until_healthy(process: subprocess.Popen, log: Path) -> str:
    """Poll the server ``process`` on ``/health`` (bounded) until it answers; its base URL."""
    url = f"http://127.0.0.1:{process.args[process.args.index('--port') + 1]}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return url
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"vLLM's server did not answer /health in {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def served_by(log: Path) -> str:
    """Which implementation serves the model of a server's ``log``: hf-mhc's plugin's line, else the class vLLM
    resolved (``--model-impl transformers`` bypasses the plugin)."""
    lines = log.read_text().splitlines()
    plugin = [line.split("hf-mhc: ", 1)[1].strip() for line in lines if "hf-mhc: serving" in line]
    resolved = [f"vLLM's {line.split(marker, 1)[1].strip()}" for line in lines
                if (marker := "Resolved architecture: ") in line]
    return (plugin or resolved or ["no line naming it"])[0]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, metavar="FOLDER", default=None,
                        help="a residual causal LM folder (default: the one make real-model builds)")
    parser.add_argument("--vllm-python", type=Path, default=DEFAULT_VLLM_PYTHON,
                        help=f"the Python of an environment with vLLM and hf-mhc (default {DEFAULT_VLLM_PYTHON})")
    parser.add_argument("--paths", nargs="+", choices=list(PATHS), default=list(PATHS))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the servers' dtype (the HC parameters stay float32)")
    parser.add_argument("--eager", action="store_true", help="serve without vLLM's compilation (--enforce-eager)")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.model is None:
        try:
            args.model = real_model_folder()
        except OSError as error:
            parser.error(f"--model: {error}")
    if not (args.model / "config.json").is_file():
        parser.error(f"--model: no config.json in {args.model} (make real-model builds the default)")
    if not args.vllm_python.is_file():
        parser.error(f"--vllm-python: no {args.vllm_python} (make vllm-env builds the default)")
    if min(args.concurrency + [args.requests_per_client, args.new_tokens, args.prompt, args.repeats]) < 1:
        parser.error("--concurrency, --requests-per-client, --new-tokens, --prompt and --repeats must be positive")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    results = {"model": str(args.model), "dtype": args.dtype, "hc_mult": 4, "new_tokens": args.new_tokens,
               "prompt": args.prompt, "requests_per_client": args.requests_per_client, "repeats": args.repeats,
               "eager": args.eager, "load_average_before": os.getloadavg()[0], "cases": []}
    lines = [f"vLLM, {args.model.name} against its mHC upcycle (hc_mult 4), {args.dtype}, "
             f"{'eager' if args.eager else 'compiled'}; {args.new_tokens} greedy tokens after {args.prompt} prompt "
             f"tokens, {args.requests_per_client} requests per client; tokens/s median of {args.repeats} repeats, "
             "latency p50 / p99 of all requests (s)",
             "| mHC served by | clients | residual tok/s | mHC tok/s | mHC / residual (min-max) | residual p50 / p99 | "
             "mHC p50 / p99 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    with tempfile.TemporaryDirectory() as scratch:
        progress("saving the models")
        folders = save_models(Path(scratch), 0, 0, args.model)
        tokenizer = AutoTokenizer.from_pretrained(folders["residual"])
        words = "Once upon a time there was a little girl who loved to play in the park with her friends".split()
        prompt = tokenizer.decode(tokenizer(" ".join(words * args.prompt)).input_ids[: args.prompt])
        for path_index, path in enumerate(args.paths, 1):
            label = f"path {path_index}/{len(args.paths)}: {path}"
            progress(f"{label}: starting the servers")
            logs = {name: Path(scratch) / f"{name}-{path}.log" for name in folders}
            servers = {}
            try:
                for name, folder in folders.items():  # both start at once; each is waited for
                    impl = PATHS[path] if name == "mhc" else "auto"
                    servers[name] = start_vllm_server(args.vllm_python, folder, impl, args.dtype, args.eager,
                                                      logs[name])
                urls = {name: wait_until_healthy(process, logs[name]) for name, process in servers.items()}
                results["cases"].append({"path": path, "served_by": served_by(logs["mhc"])})
                progress(f"{label}: {results['cases'][-1]['served_by']}")
                for concurrency in args.concurrency:
                    run = measure(urls, folders, prompt, concurrency, args, f"{label}: concurrency {concurrency}",
                                  {"ignore_eos": True})
                    results["cases"][-1] |= {str(concurrency): run}
                    lines.append(table_row(path, run))
            finally:
                for process in servers.values():
                    stop_server(process)
    lines.append(load_average_line(results))
    report("\n".join(lines), results, args.json)
    return results


if __name__ == "__main__":
    main()
