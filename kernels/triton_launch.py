"""Launch helpers of the Triton kernels: token blocks, launch grids, the padding of n."""

from __future__ import annotations

import triton

from .common import interpreting


def token_block(gpu_block: int) -> int:
    """Tokens per program: ``gpu_block`` on a GPU, 64 in the interpreter (whose cost is per operation)."""
    return 64 if interpreting() else gpu_block


def launch_grid(tokens: int, gpu_block: int) -> tuple[tuple[int], int]:
    """``(grid, tokens per program)`` for a kernel with one program per block of tokens."""
    block = token_block(gpu_block)
    return (triton.cdiv(tokens, block),), block


def padded_streams(n: int) -> int:
    """Register width for n streams: a power of two, at least 4 so that an n x n tile has >= 16 entries."""
    return max(4, triton.next_power_of_2(n))
