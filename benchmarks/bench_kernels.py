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

from hf_mhc.kernels import mhc_coeffs, mhc_post_res, mhc_pre
from hf_mhc.kernels.profiling import saved_bytes_for_backward


def deepseek_v4_site(hc: DeepseekV4HyperConnection, streams: torch.Tensor) -> torch.Tensor:
    """transformers' path: HyperConnection forward, identity sublayer, and DeepseekV4DecoderLayer's merge."""
    post, comb, collapsed = hc(streams)
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * collapsed.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


def hf_mhc_site(hc: DeepseekV4HyperConnection, streams: torch.Tensor, backend: str | None) -> torch.Tensor:
    pre, post, comb = mhc_coeffs(streams, hc.fn, hc.base, hc.scale, sinkhorn_iters=hc.hc_sinkhorn_iters,
                                 eps=hc.hc_eps, norm_eps=hc.input_norm.eps, backend=backend)
    return mhc_post_res(streams, mhc_pre(streams, pre, backend=backend), post, comb, backend=backend)


def forward_backward(site, streams, grad_out):
    streams.grad = None
    site(streams).backward(grad_out)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
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
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
