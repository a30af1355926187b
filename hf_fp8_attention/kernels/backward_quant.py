"""In-register block-scaled quantization helpers for the Triton backward kernels.

They reproduce :func:`hf_fp8_attention.quant.quantize` on one tile held in registers:

    amax  = max |x| over the block (NaN propagates: a block holding NaN gets a NaN scale, one
            holding ±Inf an Inf scale, so every element dequantizes to NaN/Inf, never to garbage)
    scale = max(amax / FMT_MAX, 2^-126)   (IEEE division, as torch; tiny floor as quant.py)
            optionally rounded up to a power of two (exact: a bit trick, no log2 approximation)
            1 where amax == 0
    code  = fp8(clamp(x / scale, ±FMT_MAX))   (the clamp is the cast's own saturation on GPU:
            :func:`cast_saturating`)

(amax and scale: :func:`.quantize.abs_max` and :func:`.quantize.scale_from_amax`, shared with the
quantization kernel of the forward.)

A "block" here is one axis of a 2-D tile: ``AXIS=1`` gives one scale per row (reduction over the
columns), ``AXIS=0`` one scale per column. Tiles are zero-padded beyond the sequence end and the
head dim, exactly as ``quant._blocked_view`` pads the tail block, so padding never changes an amax.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .quantize import abs_max, scale_from_amax


@triton.jit
def _round_to_fp8_grid(x, FMT_MAX: tl.constexpr):
    """Round fp32 x (|x| <= FMT_MAX) to the nearest FP8 value, ties to even, staying in fp32.

    Only for the Triton CPU interpreter, whose fp32->fp8 cast drops the carry when rounding up
    across a binade (124.9 -> 64 instead of 128); on GPU the hardware cast (cvt.rn.satfinite) runs.
    """
    if FMT_MAX == 448.0:  # E4M3: 3 mantissa bits, smallest normal exponent -6
        MBITS = 3
        EMIN = -6
    else:  # E5M2: 2 mantissa bits, smallest normal exponent -14
        MBITS = 2
        EMIN = -14
    bits = x.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, EMIN)
    ulp = ((e - MBITS + 127) << 23).to(tl.float32, bitcast=True)
    y = x / ulp  # exact: ulp is a power of two; |y| < 2^(MBITS+1)
    y = (y + 12582912.0) - 12582912.0  # 1.5 * 2^23: round to nearest even integer
    return y * ulp


@triton.jit
def cast_saturating(xs, FMT_MAX: tl.constexpr, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``xs`` = x · (1/scale) or x / scale of a block with scale = amax / FMT_MAX -> fp8 codes,
    as ``fp8(clamp(xs, ±FMT_MAX))`` with NaN kept NaN.

    GPU: Triton lowers the RNE cast to ``cvt.rn.satfinite``, which saturates by itself; an explicit
    clamp would cost two min/max per element (11% of the dQ loop's instructions on sm_90, see
    benchmarks/NOTES.md). It is a no-op there anyway: |xs| exceeds FMT_MAX by at most an ulp or two,
    which rounds to FMT_MAX in either format. Interpreter: its cast neither saturates nor rounds
    once, so clamp, then round onto the grid in fp32.
    """
    if INTERPRET:
        xs = _round_to_fp8_grid(tl.minimum(tl.maximum(xs, -FMT_MAX), FMT_MAX), FMT_MAX)
    return xs.to(DTYPE, fp_downcast_rounding="rtne")


@triton.jit
def quant_rows(x, FMT_MAX: tl.constexpr, POW2: tl.constexpr, DTYPE: tl.constexpr, INTERPRET: tl.constexpr = False):
    """x (R, C) fp32 -> (codes (R, C) DTYPE, scales (R,) fp32): one scale per row."""
    scale = scale_from_amax(abs_max(x, 1), FMT_MAX, POW2)
    return cast_saturating(tl.math.div_rn(x, scale[:, None]), FMT_MAX, DTYPE, INTERPRET), scale


@triton.jit
def quant_cols(x, FMT_MAX: tl.constexpr, POW2: tl.constexpr, DTYPE: tl.constexpr, INTERPRET: tl.constexpr = False):
    """x (R, C) fp32 -> (codes (R, C) DTYPE, scales (C,) fp32): one scale per column."""
    scale = scale_from_amax(abs_max(x, 0), FMT_MAX, POW2)
    return cast_saturating(tl.math.div_rn(x, scale[None, :]), FMT_MAX, DTYPE, INTERPRET), scale
