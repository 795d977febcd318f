"""Compile every Triton kernel of hf_mhc.kernels for a CUDA target, on a machine without a GPU.

    python tests/workers/compile_for_cuda.py --arch 90 --cases 4:float32 8:bfloat16

Runs each op's real launchers (GPU block sizes, since the interpreter is off) with ``JITFunction.run`` replaced by a
recorder, then compiles every recorded launch with Triton's own compiler down to a cubin (LLVM and ptxas come with
the triton wheel). Prints one JSON object per distinct launch: the kernel, its constexprs, and the resources ptxas
reports (registers, shared memory, local memory, i.e. spills). The interpreter accepts programs the compiler
rejects, so this is the check that the kernels build for a real GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: kernels must be JITFunctions, not interpreted

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}


def record_launches(n: int, dtype: torch.dtype) -> list[tuple[JITFunction, tuple, dict]]:
    """Every kernel launch of every op's forward and backward at ``n`` streams and stream dtype ``dtype``."""
    import hf_mhc.kernels.triton_backend  # noqa: F401  (registers the hf_mhc::*_triton custom ops)
    from hf_mhc.mhc_reference import MAX_PERMUTATION_STREAMS, map_sizes, scale_size

    launches = []
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))
    tokens, hidden, iters, eps = 40, 96, 20, 1e-6
    f32 = torch.float32
    streams, y = torch.zeros(1, tokens, n, hidden, dtype=dtype), torch.zeros(1, tokens, hidden, dtype=dtype)
    weights, comb = torch.zeros(1, tokens, n), torch.zeros(1, tokens, n, n)
    fn, base, scale = torch.zeros((n + 2) * n, n * hidden), torch.zeros((n + 2) * n), torch.ones(3)
    mix, rstd = torch.zeros(1, tokens, (n + 2) * n), torch.ones(1, tokens)
    head = torch.zeros(n, n * hidden), torch.zeros(n), torch.ones(1)
    head_mix = torch.zeros(1, tokens, n, dtype=f32)
    ops = torch.ops.hf_mhc
    ops.sinkhorn_fwd_triton(comb, iters, eps)
    ops.sinkhorn_bwd_triton(comb, comb, iters, eps)
    ops.mhc_coeffs_fwd_triton(streams, fn, base, scale, iters, eps, eps, "sinkhorn", 2.0)
    ops.mhc_coeffs_bwd_triton(streams, fn, base, scale, mix, rstd, weights, weights, comb, iters, eps, "sinkhorn", 2.0)
    ops.mhc_coeffs_pre_fwd_triton(streams, fn, base, scale, iters, eps, eps, "sinkhorn", 2.0)
    ops.mhc_coeffs_pre_bwd_triton(streams, fn, base, scale, weights, mix, rstd, y, weights, comb, iters, eps,
                                  "sinkhorn", 2.0)
    ops.mhc_head_fwd_triton(streams, *head, eps, eps)
    ops.mhc_head_bwd_triton(streams, *head, weights, head_mix, rstd, y, eps)
    ops.mhc_pre_fwd_triton(streams, weights)
    ops.mhc_pre_bwd_triton(streams, weights, y)
    ops.mhc_post_res_fwd_triton(streams, y, weights, comb, False)
    ops.mhc_post_res_bwd_triton(streams, y, weights, comb, streams, False)
    for residual_map in ("unconstrained", "identity", "permutations"):  # the other residual maps' launches
        if residual_map == "permutations" and n > MAX_PERMUTATION_STREAMS:
            continue
        rows = sum(map_sizes(n, residual_map))
        params = torch.zeros(rows, n * hidden), torch.zeros(rows), torch.ones(scale_size(residual_map))
        map_comb = torch.zeros(0) if residual_map == "identity" else comb
        ops.mhc_coeffs_fwd_triton(streams, *params, iters, eps, eps, residual_map, 2.0)
        ops.mhc_coeffs_bwd_triton(streams, *params, torch.zeros(1, tokens, rows), rstd, weights, weights, map_comb,
                                  iters, eps, residual_map, 2.0)
    ops.mhc_post_res_fwd_triton(streams, y, weights, torch.zeros(0), True)
    ops.mhc_post_res_bwd_triton(streams, y, weights, torch.zeros(0), streams, True)
    return launches


def signature_of(kernel: JITFunction, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    signature, constexprs = {}, {}
    positional = iter(args)
    for param in kernel.params:
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", kwargs[param.name]
            continue
        value = next(positional)
        if isinstance(value, torch.Tensor):
            signature[param.name] = POINTER_TYPES[value.dtype]
        elif isinstance(value, int):
            signature[param.name] = "i32" if abs(value) < 2**31 else "i64"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: unexpected argument {param.name}={value!r}")
    return signature, constexprs


def resource_usage(cubin: bytes, kernel_name: str) -> dict[str, int]:
    """Registers, shared and local memory of a cubin, as ``cuobjdump -res-usage`` reports them."""
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run([str(cuobjdump), "-res-usage", file.name], capture_output=True, text=True,
                                check=True).stdout
    line = report.split(f"Function {kernel_name}:", 1)[1].splitlines()[1]
    usage = dict(re.findall(r"(\w+):(\d+)", line))
    return {"registers": int(usage["REG"]), "shared_bytes": int(usage["SHARED"]), "local_bytes": int(usage["LOCAL"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for H100 / H200")
    parser.add_argument("--cases", nargs="+", default=["4:float32"], help="n:dtype pairs")
    args = parser.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    seen = set()
    for case in args.cases:
        n, dtype_name = case.split(":")
        for kernel, launch_args, kwargs in record_launches(int(n), getattr(torch, dtype_name)):
            signature, constexprs = signature_of(kernel, launch_args, kwargs)
            key = (kernel.__name__, json.dumps(signature, sort_keys=True), json.dumps(constexprs, sort_keys=True))
            if key in seen:
                continue
            seen.add(key)
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=target)
            print(json.dumps({"kernel": kernel.__name__, "n": int(n), "dtype": dtype_name, "constexprs": constexprs,
                              "dynamic_shared_bytes": compiled.metadata.shared,
                              **resource_usage(compiled.asm["cubin"], kernel.__name__)}), flush=True)


if __name__ == "__main__":
    main()
