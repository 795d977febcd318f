"""Every Triton kernel compiles for a real GPU, not only for the interpreter that runs them in the other tests.

The interpreter accepts programs that Triton's compiler rejects (a name bound to two shapes in the two branches of a
runtime ``if``, for one). ``workers/compile_for_cuda.py`` runs the real launchers with GPU block sizes and
compiles each launch down to an sm_90 (H100 / H200) or sm_80 (A100) cubin, with the LLVM and ptxas that ship in the
triton wheel: no GPU needed. It also reads each cubin's resource usage: no kernel may spill registers to local memory
or ask for more shared memory per block than the smallest limit among recent GPUs (99 KB on sm_86 / sm_89; sm_80 has
163 KB, sm_90 227 KB).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_mhc.kernels import coeffs_triton, post_res_triton, pre_triton, sinkhorn_triton

WORKER = Path(__file__).parent / "workers" / "compile_for_cuda.py"
# Per compute capability, the n:dtype cases to compile; each case compiles every kernel. sm_90 (H100 / H200): n = 3
# (padded to 4), n = 8 (the widest tiles) and both 16-bit stream dtypes. sm_80 (A100), without Hopper's instructions:
# the widest case.
ARCH_CASES = {90: ["3:float32", "8:bfloat16", "4:float16"], 80: ["8:bfloat16"]}
SMALLEST_MAX_SHARED_BYTES = 99 * 1024  # per block on sm_86 / sm_89 (RTX 30xx / 40xx, L4, A10)


def kernel_names() -> set[str]:
    return {name for module in (coeffs_triton, post_res_triton, pre_triton, sinkhorn_triton)
            for name in vars(module)
            if name.startswith("_") and name.endswith("_kernel")}


@pytest.mark.parametrize("arch", list(ARCH_CASES), ids=lambda arch: f"sm_{arch}")
def test_every_kernel_compiles_without_spills(arch):
    cases = ARCH_CASES[arch]
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(WORKER), "--arch", str(arch), "--cases", *cases],
                            capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    launches = [json.loads(line) for line in result.stdout.splitlines()]
    assert {launch["kernel"] for launch in launches} == kernel_names()
    assert {(launch["n"], launch["dtype"]) for launch in launches} == {
        (int(n), dtype) for n, dtype in (case.split(":") for case in cases)
    }
    for launch in launches:
        assert launch["local_bytes"] == 0, f"register spills: {launch}"
        assert launch["dynamic_shared_bytes"] + launch["shared_bytes"] <= SMALLEST_MAX_SHARED_BYTES, launch
