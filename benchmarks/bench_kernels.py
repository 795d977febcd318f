"""One mHC site (coefficients, pre collapse, identity sublayer, post + residual merge), forward + backward:
hf_mhc.kernels against transformers' DeepSeek-V4 path (``DeepseekV4HyperConnection`` plus its merge).

    .venv/bin/python benchmarks/bench_kernels.py            # n=4, C=1024, 4096 tokens, fp32, on CPU
    .venv/bin/python benchmarks/bench_kernels.py --json benchmarks/results/kernels_cpu.json

Reports the median time of repeats measured side by side in one run (the two paths alternate, so machine noise hits
both), their ratio, and the bytes each saves for backward per token (``saved_tensors_hooks``, distinct storages, the
parameters excluded). On a CUDA device it also times each Triton kernel and reports its achieved memory bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

from hf_mhc.kernels import mhc_coeffs, mhc_coeffs_pre, mhc_post_res, mhc_pre
from hf_mhc.kernels.profiling import saved_bytes_for_backward


def deepseek_v4_site(hc: DeepseekV4HyperConnection, streams: torch.Tensor) -> torch.Tensor:
    """transformers' path: HyperConnection forward, identity sublayer, and DeepseekV4DecoderLayer's merge."""
    post, comb, collapsed = hc(streams)
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * collapsed.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


def hf_mhc_site(hc: DeepseekV4HyperConnection, streams: torch.Tensor, backend: str | None) -> torch.Tensor:
    y, post, comb = mhc_coeffs_pre(streams, hc.fn, hc.base, hc.scale, sinkhorn_iters=hc.hc_sinkhorn_iters,
                                   eps=hc.hc_eps, norm_eps=hc.input_norm.eps, backend=backend)
    return mhc_post_res(streams, y, post, comb, backend=backend)


def forward_backward(site, streams, grad_out):
    streams.grad = None
    site(streams).backward(grad_out)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def median_seconds(run, device, repeats: int) -> float:
    run()
    samples = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def kernel_bandwidth(hc, streams, backend: str, repeats: int, peak_gbps: float | None) -> list[dict]:
    """Forward time and achieved memory bandwidth of each op alone (bytes it must read and write, per token)."""
    tokens, n, hidden = streams.shape[1], streams.shape[2], streams.shape[3]
    element = streams.element_size()
    with torch.no_grad():
        pre, post, comb = mhc_coeffs(streams, hc.fn, hc.base, hc.scale, sinkhorn_iters=hc.hc_sinkhorn_iters,
                                     eps=hc.hc_eps, norm_eps=hc.input_norm.eps, backend=backend)
        y = mhc_pre(streams, pre, backend=backend)
    ops = {
        "mhc_coeffs": (lambda: mhc_coeffs(streams, hc.fn, hc.base, hc.scale, sinkhorn_iters=hc.hc_sinkhorn_iters,
                                          eps=hc.hc_eps, norm_eps=hc.input_norm.eps, backend=backend),
                       n * hidden * element + 4 * ((n + 2) * n + 1 + 2 * n + n * n)),
        "mhc_pre": (lambda: mhc_pre(streams, pre, backend=backend), (n + 1) * hidden * element + 4 * n),
        "mhc_post_res": (lambda: mhc_post_res(streams, y, post, comb, backend=backend),
                         (2 * n + 1) * hidden * element + 4 * (n + n * n)),
    }
    rows = []
    with torch.no_grad():
        for name, (run, bytes_per_token) in ops.items():
            seconds = median_seconds(run, streams.device, repeats)
            gbps = bytes_per_token * tokens / seconds / 1e9
            rows.append({"op": name, "backend": backend, "median_ms": 1e3 * seconds, "bytes_per_token": bytes_per_token,
                         "achieved_gbps": gbps, "fraction_of_peak": gbps / peak_gbps if peak_gbps else None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--peak-gbps", type=float, help="the device's peak memory bandwidth, e.g. 4800 for an H200")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = SimpleNamespace(hc_mult=args.n, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6,
                             hidden_size=args.hidden)
    hc = DeepseekV4HyperConnection(config).to(device)
    with torch.no_grad():
        hc.fn.normal_(0, 0.02)
        hc.base.normal_(0, 1)
        hc.scale.fill_(1.0)
    streams = torch.randn(1, args.tokens, args.n, args.hidden, device=device, dtype=dtype, requires_grad=True)
    grad_out = torch.randn_like(streams)
    paths = {
        "transformers DeepseekV4HyperConnection + merge": lambda x: deepseek_v4_site(hc, x),
        "hf_mhc.kernels": lambda x: hf_mhc_site(hc, x, None),
    }
    for site in paths.values():  # warm-up (and Triton compilation)
        forward_backward(site, streams, grad_out)
    times = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, site in paths.items():
            synchronize(device)
            start = time.perf_counter()
            forward_backward(site, streams, grad_out)
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    params = tuple(hc.parameters())
    results = {
        "config": {"n": args.n, "hidden": args.hidden, "tokens": args.tokens, "dtype": args.dtype,
                   "device": str(device), "repeats": args.repeats, "threads": torch.get_num_threads()},
        "paths": {},
    }
    for name, site in paths.items():
        saved = saved_bytes_for_backward(lambda site=site: site(streams), exclude=params)
        results["paths"][name] = {"median_ms": 1e3 * statistics.median(times[name]),
                                  "saved_bytes_per_token": saved / args.tokens}
    baseline, ours = (results["paths"][name] for name in paths)
    results["speedup"] = baseline["median_ms"] / ours["median_ms"]
    results["saved_bytes_budget_per_token"] = (args.n + 1) * args.hidden * streams.element_size() + 512

    print(f"one mHC site, forward + backward: n={args.n}, C={args.hidden}, {args.tokens} tokens, {args.dtype}, "
          f"{device}, median of {args.repeats}")
    print("| path | median ms | saved for backward, bytes/token |")
    print("| --- | ---: | ---: |")
    for name, row in results["paths"].items():
        print(f"| {name} | {row['median_ms']:.1f} | {row['saved_bytes_per_token']:,.0f} |")
    print(f"speed-up: {results['speedup']:.2f}x; budget (n+1)*C*bytes + 512 = "
          f"{results['saved_bytes_budget_per_token']:,} bytes/token")
    backend = "triton" if device.type == "cuda" else "torch"
    results["kernels"] = kernel_bandwidth(hc, streams.detach(), backend, args.repeats, args.peak_gbps)
    print(f"forward of each op alone ({backend} backend): bytes it must move per token, achieved bandwidth")
    print("| op | median ms | bytes/token | GB/s | of peak |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for row in results["kernels"]:
        peak = f"{100 * row['fraction_of_peak']:.0f} %" if row["fraction_of_peak"] else "n/a"
        print(f"| {row['op']} | {row['median_ms']:.2f} | {row['bytes_per_token']:,} | {row['achieved_gbps']:.1f} | "
              f"{peak} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
