"""Serving throughput and latency of an upcycled mHC model against its residual source, through the same server.

A random Llama (``--hidden`` C, ``--layers`` layers, heads of 64, a quarter as many KV heads, ``8C/3`` MLP width
rounded to 64) with stories260K's tokenizer (``../shared/assets/stories260K``, 512 tokens), or the residual causal
LM of ``--model FOLDER`` with its own tokenizer (float32), and its mHC upcycle (``hc_mult=4``) are saved with no
end-of-sequence token (every answer is ``--new-tokens`` long) and each served by ``hf-mhc serve`` (transformers'
server; ``--modes``: sequential generation and/or ``--continuous-batching``), the two servers side by side, on
``--threads`` threads each. For each concurrency (``--concurrency``, default 1, 4 and 16) and repeat,
``concurrency`` clients of the ``openai`` package send ``--requests-per-client`` greedy completions of a
``--prompt``-token prompt each, to the residual server, then the mHC one, then the residual one... alternating within
the repeat so that a slow moment of a shared machine hits both. Reported per mode and concurrency: generated tokens
per second (all requests' tokens over the wall time of the burst) of each, the median, minimum and maximum of the
per-repeat mHC / residual ratios, and the p50 and p99 of the request latencies of all repeats (p99 is the largest
of fewer than 100 requests)::

    .venv/bin/python benchmarks/bench_serve.py [--model FOLDER | --hidden 512 --layers 8]
        [--modes sequential continuous-batching] [--concurrency 1 4 16] [--requests-per-client 2]
        [--new-tokens 32] [--prompt 16] [--repeats 3] [--threads 1] [--json PATH]

Prints each case and repeat to stderr as it goes, then the table; the results are written as JSON only with ``--json``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from benchlib import add_json_argument, load_average_line, progress, report
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import hf_mhc

STORIES260K = Path(__file__).resolve().parents[2] / "shared" / "assets" / "stories260K"
MODES = {"sequential": [], "continuous-batching": ["--continuous-batching", "--cb-num-blocks", "256",
                                                   "--cb-block-size", "32"]}
STARTUP_TIMEOUT_S = 300
REQUEST_TIMEOUT_S = 600


def save_models(folder: Path, hidden: int, layers: int, model: Path | None = None) -> dict[str, Path]:
    """The residual model (the folder ``model``, loaded in float32; else a random Llama with stories260K's tokenizer)
    and its mHC upcycle, saved under ``folder`` with their tokenizer and no end-of-sequence token; their folders by
    name (``residual``, ``mhc``)."""
    if model is not None:
        tokenizer = AutoTokenizer.from_pretrained(model)
        source = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    else:
        tokenizer = AutoTokenizer.from_pretrained(STORIES260K)
        torch.manual_seed(0)
        heads = max(1, hidden // 64)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                             intermediate_size=(8 * hidden // 3 + 63) // 64 * 64, num_attention_heads=heads,
                             num_key_value_heads=max(1, heads // 4), max_position_embeddings=2048, eos_token_id=None)
        source = LlamaForCausalLM(config).eval()
    models = {"residual": source, "mhc": hf_mhc.upcycle(copy.deepcopy(source), hc_mult=4)}
    folders = {}
    for name, model in models.items():
        model.generation_config.eos_token_id = None
        folders[name] = folder / name
        model.save_pretrained(folders[name])
        tokenizer.save_pretrained(folders[name])
    return folders


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(model: Path, options: list[str], threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    """``hf-mhc serve MODEL`` on 127.0.0.1, polled on ``/health`` (bounded) until it answers."""
    port = free_port()
    command = [str(Path(sys.executable).with_name("hf-mhc")), "serve", str(model), "--host", "127.0.0.1", "--port",
               str(port), "--device", "cpu", *options]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"hf-mhc serve exited with {process.returncode}:\n{log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return process, url
        except OSError:
            time.sleep(0.5)
    stop_server(process)
    raise RuntimeError(f"hf-mhc serve did not answer /health in {STARTUP_TIMEOUT_S} s")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


def burst(url: str, model: str, prompt: str, concurrency: int, requests_per_client: int, new_tokens: int,
          extra_body: dict | None = None) -> tuple[float, int, list[float]]:
    """``concurrency`` clients sending ``requests_per_client`` greedy completions each (with the server's own options
    ``extra_body``): the burst's wall seconds, the tokens generated and each request's latency in seconds."""
    from openai import OpenAI

    def client_run(_: int) -> list[tuple[float, int]]:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
        done = []
        for _ in range(requests_per_client):
            start = time.perf_counter()
            answer = client.completions.create(model=model, prompt=prompt, max_tokens=new_tokens, temperature=0,
                                               extra_body=extra_body)
            done.append((time.perf_counter() - start, answer.usage.completion_tokens))
        return done

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        runs = [item for run in pool.map(client_run, range(concurrency), timeout=REQUEST_TIMEOUT_S) for item in run]
    return time.perf_counter() - start, sum(tokens for _, tokens in runs), [latency for latency, _ in runs]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank) of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def measure(urls: dict[str, str], folders: dict[str, Path], prompt: str, concurrency: int, args, label: str,
            extra_body: dict | None = None) -> dict:
    """One warm-up burst per server, then ``--repeats`` alternating bursts (``burst``); throughputs, ratios and
    latencies."""
    for name, url in urls.items():
        burst(url, str(folders[name]), prompt, concurrency, 1, args.new_tokens, extra_body)
    rates = {name: [] for name in urls}
    latencies = {name: [] for name in urls}
    for repeat in range(args.repeats):
        progress(f"{label}: repeat {repeat + 1}/{args.repeats}")
        for name, url in urls.items():
            seconds, tokens, request_latencies = burst(url, str(folders[name]), prompt, concurrency,
                                                       args.requests_per_client, args.new_tokens, extra_body)
            expected = concurrency * args.requests_per_client * args.new_tokens
            if tokens != expected:
                raise RuntimeError(f"{name}: {tokens} tokens generated, {expected} asked")
            rates[name].append(tokens / seconds)
            latencies[name] += request_latencies
    ratios = [mhc / residual for mhc, residual in zip(rates["mhc"], rates["residual"], strict=True)]
    result = {"concurrency": concurrency, "requests": concurrency * args.requests_per_client * args.repeats}
    for name in urls:
        result |= {f"{name}_tokens_per_s": statistics.median(rates[name]),
                   f"{name}_latency_p50_s": percentile(latencies[name], 50),
                   f"{name}_latency_p99_s": percentile(latencies[name], 99)}
    return result | {"throughput_ratio_median": statistics.median(ratios), "throughput_ratio_min": min(ratios),
                     "throughput_ratio_max": max(ratios)}


def table_row(label: str, run: dict) -> str:
    """The results table's row of one :func:`measure` ``run``, first column ``label``."""
    return (f"| {label} | {run['concurrency']} | {run['residual_tokens_per_s']:.1f} | {run['mhc_tokens_per_s']:.1f} | "
            f"{run['throughput_ratio_median']:.3f} ({run['throughput_ratio_min']:.3f}-"
            f"{run['throughput_ratio_max']:.3f}) | {run['residual_latency_p50_s']:.2f} / "
            f"{run['residual_latency_p99_s']:.2f} | {run['mhc_latency_p50_s']:.2f} / {run['mhc_latency_p99_s']:.2f} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, metavar="FOLDER",
                        help="a residual causal LM folder to serve against its upcycle (e.g. the one make real-model "
                             "builds) instead of a random Llama; --hidden and --layers are then unused")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size C (a multiple of 64)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model: no config.json in {args.model}")
    if args.hidden < 64 or args.hidden % 64:
        parser.error("--hidden must be a positive multiple of 64 (heads of 64)")
    if min(args.concurrency + [args.layers, args.requests_per_client, args.new_tokens, args.prompt, args.repeats,
                               args.threads]) < 1:
        parser.error("--concurrency, --layers, --requests-per-client, --new-tokens, --prompt, --repeats and "
                     "--threads must be positive")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.model is None and not STORIES260K.is_dir():
        raise SystemExit(f"bench_serve.py: error: the servers use stories260K's tokenizer: no folder {STORIES260K}")
    served = (f"{args.model.name}" if args.model is not None
              else f"random Llama C={args.hidden}, {args.layers} layers,")
    results = {"model": None if args.model is None else str(args.model), "hidden": args.hidden, "layers": args.layers,
               "hc_mult": 4, "new_tokens": args.new_tokens,
               "prompt": args.prompt, "requests_per_client": args.requests_per_client, "repeats": args.repeats,
               "server_threads": args.threads, "load_average_before": os.getloadavg()[0], "cases": []}
    lines = [f"hf-mhc serve, {served} against its mHC upcycle (hc_mult 4); "
             f"{args.new_tokens} greedy tokens after {args.prompt} prompt tokens, {args.requests_per_client} requests "
             f"per client, {args.threads} thread(s) per server; tokens/s median of {args.repeats} repeats, latency "
             "p50 / p99 of all requests (s)",
             "| mode | clients | residual tok/s | mHC tok/s | mHC / residual (min-max) | residual p50 / p99 | "
             "mHC p50 / p99 |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    with tempfile.TemporaryDirectory() as scratch:
        progress("saving the models")
        folders = save_models(Path(scratch), args.hidden, args.layers, args.model)
        tokenizer = AutoTokenizer.from_pretrained(folders["residual"])
        words = "Once upon a time there was a little girl who loved to play in the park with her friends".split()
        prompt = " ".join(words * args.prompt)
        prompt = tokenizer.decode(tokenizer(prompt).input_ids[1: args.prompt + 1])
        for mode_index, mode in enumerate(args.modes, 1):
            progress(f"mode {mode_index}/{len(args.modes)}: {mode}: starting the servers")
            servers = {name: start_server(folder, MODES[mode], args.threads, Path(scratch) / f"{name}-{mode}.log")
                       for name, folder in folders.items()}
            try:
                for concurrency in args.concurrency:
                    label = f"mode {mode_index}/{len(args.modes)}: {mode}: concurrency {concurrency}"
                    run = measure({name: url for name, (_, url) in servers.items()}, folders, prompt, concurrency,
                                  args, label)
                    results["cases"].append({"mode": mode} | run)
                    lines.append(table_row(mode, run))
            finally:
                for process, _ in servers.values():
                    stop_server(process)
    lines.append(load_average_line(results))
    report("\n".join(lines), results, args.json)
    return results


if __name__ == "__main__":
    main()
