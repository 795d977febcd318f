"""One mHC site (coefficients, pre collapse, identity sublayer, post + residual merge), forward + backward:
hf_mhc.kernels against transformers' DeepSeek-V4 path (``DeepseekV4HyperConnection`` plus its merge).

    .venv/bin/python benchmarks/bench_kernels.py            # n=4, C=1024, 4096 tokens, fp32, on CPU
    .venv/bin/python benchmarks/bench_kernels.py --json benchmarks/results/kernels_cpu.json
    .venv/bin/python benchmarks/bench_kernels.py --device cuda --hidden 4096 --dtype bfloat16 --peak-gbps copy

Reports the median time of repeats measured side by side in one run (the paths alternate, so machine noise hits all
of them), their ratio, and the bytes each saves for backward per token (``saved_tensors_hooks``, distinct storages,
the parameters excluded). On a CUDA device it also times each Triton kernel and reports its achieved memory
bandwidth, as a fraction of ``--peak-gbps`` (given, or ``copy``: measured as a device-to-device copy's); with
Liger-Kernel installed, its ``liger_mhc_*`` ops run beside ours (as a third path, and per op).

Prints each repeat to stderr as it runs, then the tables; the results are written as JSON only with ``--json PATH``
(otherwise printed after the tables).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from types import SimpleNamespace

import torch
from benchlib import add_json_argument, progress, report
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

from hf_mhc.compat import unweighted_norm_eps
from hf_mhc.kernels import mhc_coeffs, mhc_coeffs_pre, mhc_post_res, mhc_pre
from hf_mhc.profiling import saved_bytes_for_backward

DSV4_PATH, OURS_PATH, LIGER_PATH = "transformers DeepseekV4HyperConnection + merge", "hf_mhc.kernels", "Liger-Kernel"


def deepseek_v4_site(hc: DeepseekV4HyperConnection, streams: torch.Tensor) -> torch.Tensor:
    """transformers' path: HyperConnection forward, identity sublayer, and DeepseekV4DecoderLayer's merge."""
    post, comb, collapsed = hc(streams)
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * collapsed.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


def hf_mhc_site(hc: DeepseekV4HyperConnection, streams: torch.Tensor, backend: str | None) -> torch.Tensor:
    y, post, comb = mhc_coeffs_pre(streams, hc.fn, hc.base, hc.scale, sinkhorn_iters=hc.hc_sinkhorn_iters,
                                   eps=hc.hc_eps, norm_eps=unweighted_norm_eps(hc.input_norm), backend=backend)
    return mhc_post_res(streams, y, post, comb, backend=backend)


class LigerSite:
    """Liger-Kernel's mHC ops (``liger_mhc_coeffs``, ``liger_mhc_pre``, ``liger_mhc_post_res``; CUDA only) on the same
    parameters. Liger takes ``phi = fn.T`` and applies ``h_res`` untransposed: the same traffic and FLOPs."""

    def __init__(self, hc: DeepseekV4HyperConnection):
        from liger_kernel.transformers import functional

        self.ops = functional
        self.hc = hc
        self.phi = hc.fn.detach().T.contiguous().requires_grad_(True)  # stored the way Liger's layout wants it

    def coeffs(self, streams):
        hc = self.hc
        return self.ops.liger_mhc_coeffs(streams, self.phi, hc.base, hc.scale[0], hc.scale[1], hc.scale[2],
                                         allow_fp32=True, tmax=hc.hc_sinkhorn_iters,
                                         rms_eps=unweighted_norm_eps(hc.input_norm), pre_eps=hc.hc_eps,
                                         sinkhorn_eps=hc.hc_eps)

    def __call__(self, streams):
        pre, post, res = self.coeffs(streams)
        return self.ops.liger_mhc_post_res(streams, self.ops.liger_mhc_pre(streams, pre), post, res)


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


def copy_bandwidth(device: torch.device, megabytes: int, repeats: int) -> float:
    """GB/s of a device-to-device copy of ``megabytes`` MB (bytes read plus bytes written), median of ``repeats``."""
    source = torch.empty(megabytes * 10**6, dtype=torch.uint8, device=device).random_(0, 256)
    target = torch.empty_like(source)
    seconds = median_seconds(lambda: target.copy_(source), device, repeats)
    return 2 * source.numel() / seconds / 1e9


def kernel_bandwidth(hc, streams, backend: str, repeats: int, peak_gbps: float | None,
                     liger: LigerSite | None) -> list[dict]:
    """Forward time and achieved memory bandwidth of each op alone (bytes it must read and write, per token), ours and,
    when given, Liger-Kernel's."""
    tokens, n, hidden = streams.shape[1], streams.shape[2], streams.shape[3]
    element = streams.element_size()
    with torch.no_grad():
        pre, post, comb = mhc_coeffs(streams, hc.fn, hc.base, hc.scale, sinkhorn_iters=hc.hc_sinkhorn_iters,
                                     eps=hc.hc_eps, norm_eps=unweighted_norm_eps(hc.input_norm), backend=backend)
        y = mhc_pre(streams, pre, backend=backend)
    ops = {
        "mhc_coeffs": (lambda: mhc_coeffs(streams, hc.fn, hc.base, hc.scale, sinkhorn_iters=hc.hc_sinkhorn_iters,
                                          eps=hc.hc_eps, norm_eps=unweighted_norm_eps(hc.input_norm), backend=backend),
                       n * hidden * element + 4 * ((n + 2) * n + 1 + 2 * n + n * n)),
        "mhc_pre": (lambda: mhc_pre(streams, pre, backend=backend), (n + 1) * hidden * element + 4 * n),
        "mhc_post_res": (lambda: mhc_post_res(streams, y, post, comb, backend=backend),
                         (2 * n + 1) * hidden * element + 4 * (n + n * n)),
    }
    runs = [(name, backend, run, bytes_per_token) for name, (run, bytes_per_token) in ops.items()]
    if liger is not None:
        liger_runs = {
            "mhc_coeffs": lambda: liger.coeffs(streams),
            "mhc_pre": lambda: liger.ops.liger_mhc_pre(streams, pre),
            "mhc_post_res": lambda: liger.ops.liger_mhc_post_res(streams, y, post, comb),
        }
        runs += [(name, "liger", liger_runs[name], ops[name][1]) for name in ops]
    rows = []
    with torch.no_grad():
        for number, (name, op_backend, run, bytes_per_token) in enumerate(runs, start=1):
            progress(f"op {number}/{len(runs)}: {name} ({op_backend}), {repeats} repeats")
            seconds = median_seconds(run, streams.device, repeats)
            gbps = bytes_per_token * tokens / seconds / 1e9
            rows.append({"op": name, "backend": op_backend, "median_ms": 1e3 * seconds,
                         "bytes_per_token": bytes_per_token, "achieved_gbps": gbps,
                         "fraction_of_peak": gbps / peak_gbps if peak_gbps else None})
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--peak-gbps", type=peak_argument, metavar="GBPS|copy",
                        help="the device's peak memory bandwidth, e.g. 4800 for an H200, or `copy`: the measured "
                             "bandwidth of a device-to-device copy")
    parser.add_argument("--copy-mb", type=int, default=1024, help="the size of that copy in MB (default 1024)")
    add_json_argument(parser)
    return parser.parse_args(argv)


def peak_argument(text: str) -> float | str:
    if text == "copy":
        return text
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a positive bandwidth in GB/s nor `copy`")
    return value


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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
        DSV4_PATH: lambda x: deepseek_v4_site(hc, x),
        OURS_PATH: lambda x: hf_mhc_site(hc, x, None),
    }
    liger = None
    if device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None:
        liger = LigerSite(hc)
        paths[LIGER_PATH] = liger
    for name, site in paths.items():  # warm-up (and Triton compilation)
        progress(f"warm-up: {name}")
        forward_backward(site, streams, grad_out)
    times = {name: [] for name in paths}
    for repeat in range(args.repeats):
        for name, site in paths.items():
            synchronize(device)
            start = time.perf_counter()
            forward_backward(site, streams, grad_out)
            synchronize(device)
            times[name].append(time.perf_counter() - start)
        progress(f"repeat {repeat + 1}/{args.repeats}: " + "; ".join(
            f"{name}: {1e3 * samples[-1]:.1f} ms" for name, samples in times.items()))
    params = tuple(hc.parameters()) + ((liger.phi,) if liger else ())
    results = {
        "config": {"n": args.n, "hidden": args.hidden, "tokens": args.tokens, "dtype": args.dtype,
                   "device": str(device), "repeats": args.repeats, "threads": torch.get_num_threads()},
        "paths": {},
    }
    for name, site in paths.items():
        progress(f"bytes saved for backward: {name}")
        saved = saved_bytes_for_backward(lambda site=site: site(streams), exclude=params)
        results["paths"][name] = {"median_ms": 1e3 * statistics.median(times[name]),
                                  "saved_bytes_per_token": saved / args.tokens}
    baseline, ours = results["paths"][DSV4_PATH], results["paths"][OURS_PATH]
    results["speedup"] = baseline["median_ms"] / ours["median_ms"]
    if liger:
        results["speedup_vs_liger"] = results["paths"][LIGER_PATH]["median_ms"] / ours["median_ms"]
    results["saved_bytes_budget_per_token"] = (args.n + 1) * args.hidden * streams.element_size() + 512

    peak_gbps = args.peak_gbps
    if peak_gbps == "copy":
        progress(f"device-to-device copy of {args.copy_mb} MB, {args.repeats} repeats")
        peak_gbps = copy_bandwidth(device, args.copy_mb, args.repeats)
    results["peak_gbps"], results["peak_source"] = peak_gbps, "measured copy" if args.peak_gbps == "copy" else "given"
    backend = "triton" if device.type == "cuda" else "torch"
    results["kernels"] = kernel_bandwidth(hc, streams.detach(), backend, args.repeats, peak_gbps, liger)

    lines = [f"one mHC site, forward + backward: n={args.n}, C={args.hidden}, {args.tokens} tokens, {args.dtype}, "
             f"{device}, median of {args.repeats}",
             "| path | median ms | saved for backward, bytes/token |",
             "| --- | ---: | ---: |"]
    lines += [f"| {name} | {row['median_ms']:.1f} | {row['saved_bytes_per_token']:,.0f} |"
              for name, row in results["paths"].items()]
    lines.append(f"speed-up: {results['speedup']:.2f}x; budget (n+1)*C*bytes + 512 = "
                 f"{results['saved_bytes_budget_per_token']:,} bytes/token")
    if liger:
        lines.append(f"against Liger-Kernel: {results['speedup_vs_liger']:.2f}x")
    if peak_gbps:
        lines.append(f"peak bandwidth: {peak_gbps:.0f} GB/s ({results['peak_source']})")
    lines += ["forward of each op alone: bytes it must move per token, achieved bandwidth",
              "| op | backend | median ms | bytes/token | GB/s | of peak |",
              "| --- | --- | ---: | ---: | ---: | ---: |"]
    for row in results["kernels"]:
        peak = f"{100 * row['fraction_of_peak']:.0f} %" if row["fraction_of_peak"] else "n/a"
        lines.append(f"| {row['op']} | {row['backend']} | {row['median_ms']:.2f} | {row['bytes_per_token']:,} | "
                     f"{row['achieved_gbps']:.1f} | {peak} |")
    report("\n".join(lines), results, args.json)


if __name__ == "__main__":
    main()
