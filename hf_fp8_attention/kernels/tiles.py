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
