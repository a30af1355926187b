"""Tile ranges shared by the attention kernels: which tiles to visit, and which need no mask."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_tiles(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Tiles of BLOCK positions (tile t = [t·BLOCK, (t+1)·BLOCK)) covering the positions [lo, hi),
    split around those lying wholly inside [full_lo, full_hi): returns t_lo <= f_lo <= f_hi <= t_hi;
    [f_lo, f_hi) are the interior tiles, [t_lo, f_lo) and [f_hi, t_hi) the boundary tiles. Integer
    scalars; any bound may be negative and either range empty."""
    t_lo = tl.maximum(lo, 0) // BLOCK
    t_hi = tl.maximum(tl.cdiv(tl.maximum(hi, 0), BLOCK), t_lo)
    f_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(full_lo, 0), BLOCK), t_lo), t_hi)
    f_hi = tl.minimum(tl.maximum(tl.maximum(full_hi, 0) // BLOCK, f_lo), t_hi)
    return t_lo, f_lo, f_hi, t_hi


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host-side grids (plain Python: ``triton.cdiv`` costs a microsecond a call in
    newer Triton, and a launch computes several)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), in plain Python like :func:`cdiv`."""
    return 1 << max(n - 1, 0).bit_length()


# The recipe's blocks are contraction lengths of FP8 MMAs (keys in F2 and B4, queries in B3 and B5),
# and Triton's FP8 tl.dot needs K >= 32 (Hopper's FP8 wgmma contracts 32 elements per instruction).
MIN_COMPILED_BLOCK = 32


def check_compiled_blocks(block_q: int, block_k: int, who: str, interpreting: bool) -> None:
    """Raise a ValueError naming the fix when a recipe block is below :data:`MIN_COMPILED_BLOCK` and
    the kernels are about to be compiled for a GPU (the CPU interpreter runs any block)."""
    if interpreting:
        return
    small = {name: b for name, b in (("block_q", block_q), ("block_k", block_k)) if b < MIN_COMPILED_BLOCK}
    if small:
        got = ", ".join(f"{name}={b}" for name, b in small.items())
        raise ValueError(
            f"{who}: FP8AttentionConfig {got} is too small for the GPU kernels: FP8 tensor-core matmuls "
            f"contract over at least {MIN_COMPILED_BLOCK} tokens. Use blocks of {MIN_COMPILED_BLOCK}-256 "
            "tokens, or FP8AttentionConfig(backend=\"emulation\") to run this recipe in PyTorch"
        )
