"""Constants shared by the Triton kernels and their launchers (defined once, here)."""
from __future__ import annotations

import triton.language as tl

from ..config import FP8Format

# log2(e): the launchers fold τ·log2(e) into the logits so the kernels use exp2; the stale-delta
# kernels convert the forward's natural-log LSE with it.
LOG2E = 1.4426950408889634
LOG2E_C = tl.constexpr(LOG2E)  # the same, for use inside @triton.jit functions

# Triton's dtype of each FP8 format (the codes the kernels write and the MMAs read).
TL_FP8 = {FP8Format.E4M3: tl.float8e4nv, FP8Format.E5M2: tl.float8e5}


def tl_fp8(fmt: FP8Format):
    """Triton's dtype of ``fmt``."""
    return TL_FP8[fmt]
