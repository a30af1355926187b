"""Triton block-scaled FP8 quantization of attention operands (docs/design.md §2).

For a tensor ``x (B, H, S, D)`` (bf16/fp16/fp32, any strides) one launch can emit both copies the
FP8 matmuls need (and one launch serves two tensors of one shape, e.g. K and V):

- the **row-wise** copy (one scale per token, amax over the head dim), laid out ``(B, H, S, DP)``
  with ``DP = next_pow2(D)`` (zero codes in the padded channels): the K-major operand of every
  matmul that contracts over the head dim (QKᵀ, dO Vᵀ);
- the **channel-wise** copy (one scale per channel within each tile of ``block`` tokens, tiles
  starting at every sequence start), emitted *transposed* as ``(B, H, DP, S_pad)`` so that the
  matmuls contracting over tokens (P V, Pᵀ dO, ...) read a K-major operand, as Hopper's FP8 MMA
  requires.

Reference maths (same as :func:`hf_fp8_attention.quant.quantize`)::

    scale = max(amax(|block|) / FMT_MAX, 2^-126)   (rounded up to a power of two with pow2; 1 if amax == 0)
    code  = fp8_rne(clamp(x / scale, -FMT_MAX, FMT_MAX))

The division gives IEEE round-to-nearest quotients, as PyTorch's (``div_rn``; for row scales
:func:`divide_by_scale`, which forms them with FMAs), so on a GPU with a saturating
round-to-nearest-even FP8 conversion the codes and scales equal the emulation's bit for bit.
NaN/Inf in a block give a non-finite scale, so the block dequantizes to NaN/Inf, never to garbage.
"""
from __future__ import annotations

import concurrent.futures
import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..config import FP8Format
from ..transforms import hadamard_matrix
from .constants import TL_FP8
from .launch import launch as launch_kernel
from .tiles import block_of_sequence, cdiv, next_pow2, on_cuda, sequence_block_offsets, sm_count

# Compile options of every attention kernel launch. FP contraction (FMA) stays on: the GPU tests'
# bounds and the bit-identity checks were measured with it, Triton's default up to 3.9 (3.10 turns
# the default off).
COMPILE_OPTIONS = {"enable_fp_fusion": True}

# Launch of the quantization kernel: the slices each program reads at a time (tokens for the
# row-wise copy, channels for the channel-wise one: see quantize_kernel) and its warps.
# A module-level table so that benchmarks can try others (benchmarks/quantize_bench.py --sweep).
QUANT_LAUNCH = {"row_chunk": 32, "col_group": 16, "num_warps": 2, "tiles": None, "col_prefetch": None}
# A launch with a rotated copy: each row chunk is one (chunk, DP) x (DP, DP) tensor-core dot with the
# Hadamard matrix, loaded once per program. 64-token chunks on 8 warps ran within 4-13% of the plain
# copy on the H200, and the channel-wise copy beside it (V in the forward) wants 64-channel groups
# on those 8 warps (benchmarks/rotation_bench.py, benchmarks/NOTES.md "Recipe v2"). Two options
# change register allocation and loads only, never a code (benchmarks/prep_bench.py --sweep checks
# bit for bit): ``maxnreg`` caps the registers per thread (ptxas) and ``row_stages`` software-
# pipelines the row-wise loop's loads (tl.range num_stages); None leaves the compiler's choice.
# Left to itself ptxas gave the backward's K+V launch 162-196 registers, one program per SM;
# capped at 128 with 3 stages every launch fits two, unspilled, and a recipe's four launches ran
# 672.8 -> 618.2 us at 2 x 8k tokens (benchmarks/results/cpu_quantize_registers.txt,
# h200_v37_prep_sweep_*.log). The cap alone spilled in the packed fast launches. ``tiles``: BLOCK_S-token
# tiles per program (None: 1), each program's row-wise loop running over all of its tiles, so that
# its slices pipeline across tiles and a rotated copy loads its Hadamard matrix once per program
# instead of once per tile; the same codes and scales, at most 128 registers and no spills at 2-8
# tiles (offline, sm_90a). Two tiles took fp8_delta's four preparation steps at 2 x 8k tokens from
# 573.7 to 552.6 us on the H100, the same bits (4 and 8 slowed the backward's Q/dO step: fewer
# programs than SMs with work); a launch takes them only where every SM still gets
# TILES_MIN_PROGRAMS_PER_SM programs (small calls keep one tile a program: all SMs busy).
# ``col_prefetch``: the channel-wise copy loads each (tile, channel group) slice before the previous
# one is cast and stored (one slice in flight while it computes; the plain loop has none); the same
# codes and scales. On H100 it took fp8_delta's preparation of one fwd+bwd at 2 x 8k tokens from
# 541.0 to 530.4 us, each K/V or Q/dO step 3.5-3.8 us faster (benchmarks/NOTES.md, "Quantization").
# Dense batches only: in packed ones it spills under the 128-register cap (956-2128 B, offline).
ROTATED_LAUNCH = {"row_chunk": 64, "col_group": 64, "num_warps": 8, "maxnreg": 128, "row_stages": 3, "tiles": 2,
                  "col_prefetch": True}
TILES_MIN_PROGRAMS_PER_SM = 8
# Head dim 256 (the tables above serve padded head dims up to 128). The plain launch reads half the
# tokens per row chunk, so that each slice holds as many elements per thread as at 128 (32 tokens
# took 255 registers on 2 warps). The rotated launch keeps its Hadamard matrix in shared memory,
# 128 KB at 256 in bf16: 64-token chunks needed 240 KB (over the 227 KB of a block), 32-token chunks
# on 8 warps 168 KB without spills (offline compile for sm_90a,
# benchmarks/results/cpu_kernel_resources.txt).
QUANT_LAUNCH_D256 = {"row_chunk": 16, "col_group": 16, "num_warps": 2}
ROTATED_LAUNCH_D256 = {"row_chunk": 32, "col_group": 64, "num_warps": 8}
# The channel-wise copies with sequence-wide scales (per channel of the sequence, or per head) divide
# by FMAs (divide_by_scale: the same quotients) instead of div.rn, whose slow-path check and branch
# take ~180 of the 726 instructions of that loop per 32 elements (offline, sm_90a). Same codes, and
# on the H200 the preparation of one fp8_delta fwd+bwd at 2 x 8k tokens 585 -> 576 us; with per-tile
# scales the FMA form was slower, every thread recomputing its columns' reciprocals
# (benchmarks/NOTES.md, "Quantization"). Dense batches only: in packed ones the FMA form spills
# under the launch's 128-register cap (280-792 B, offline), div.rn does not. Read at every launch
# (benchmarks flip it).
COL_FMA_DIVISION = True


def quant_launch(rotated: bool, dp: int) -> dict:
    """The launch table of :func:`quantize_operands` for padded head dim ``dp``, with or without a
    rotated copy (read at every call, so that benchmarks can change the tables)."""
    if dp > 128:
        return ROTATED_LAUNCH_D256 if rotated else QUANT_LAUNCH_D256
    return ROTATED_LAUNCH if rotated else QUANT_LAUNCH


# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when the kernel modules are imported:
# read once, as it does, not at each of the ~30 checks of a fwd+bwd (~1 µs of host time each).
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreting() -> bool:
    """Whether Triton runs the package's kernels in its interpreter (``TRITON_INTERPRET`` as it was
    when they were decorated, at import)."""
    return _INTERPRETING


def scratch_empty():
    """``torch.empty`` for buffers the kernels write before anything reads them; under the
    interpreter (the CPU tests) ``torch.full`` with NaN instead, so that a value read before it is
    written, or never written, shows."""
    return functools.partial(torch.full, fill_value=float("nan")) if interpreting() else torch.empty


# The Triton interpreter runs a ``tl.reduce`` with a combine function element by element in Python
# (hundreds of thousands of calls in one small quantization launch: most of the CPU test suite's
# interpreter time). Under the interpreter the NaN-keeping reductions below use ``tl.max`` /
# ``tl.min`` with the NaN test spelled out: the same values at NumPy speed. A constexpr global, so
# compiled kernels keep only the ``tl.reduce`` branch (the same SASS: benchmarks/NOTES.md, "The CPU
# test suite").
INTERPRETED = tl.constexpr(interpreting())


@triton.jit
def max_nan(a, b):
    """Combine for ``tl.reduce``: maximum that keeps NaN (``tl.max`` drops it on GPU: maxnum)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def min_nan(a, b):
    """Combine for ``tl.reduce``: minimum that keeps NaN (the twin of :func:`max_nan`)."""
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _any_nan(x, axis: tl.constexpr):
    """Whether each slice of ``x`` along ``axis`` holds a NaN (the interpreter's form below)."""
    return tl.sum((x != x).to(tl.int32), axis) > 0


@triton.jit
def reduce_max_nan(x, axis: tl.constexpr):
    """max of ``x`` along ``axis``, NaN if the reduced slice holds one."""
    if INTERPRETED:
        out = tl.where(_any_nan(x, axis), float("nan"), tl.max(x, axis))
    else:
        out = tl.reduce(x, axis, max_nan)
    return out


@triton.jit
def reduce_min_nan(x, axis: tl.constexpr):
    """min of ``x`` along ``axis``, NaN if the reduced slice holds one."""
    if INTERPRETED:
        out = tl.where(_any_nan(x, axis), float("nan"), tl.min(x, axis))
    else:
        out = tl.reduce(x, axis, min_nan)
    return out


@triton.jit
def abs_max(x, axis: tl.constexpr):
    """max |x| along ``axis``, NaN if the reduced slice holds one (as ``torch.amax``)."""
    return reduce_max_nan(tl.abs(x), axis)


@triton.jit
def scale_from_amax(amax, FMAX: tl.constexpr, POW2: tl.constexpr):
    """fp32 block scale from its fp32 amax: amax / FMAX floored at 2^-126 (pow2: rounded up),
    1 where amax == 0 (the floor keeps tiny blocks from a zero scale, as quant.compute_scales)."""
    scale = tl.maximum(tl.math.div_rn(amax, FMAX), 1.1754943508222875e-38, propagate_nan=tl.PropagateNan.ALL)
    if POW2:
        # Round up to a power of two through the bits: exact, unlike exp2(ceil(log2(s))) with
        # approximate log2. Non-finite scales (NaN/Inf) are kept as they are.
        bits = scale.to(tl.int32, bitcast=True)
        expo = bits & 0x7F800000
        up = tl.where((bits & 0x007FFFFF) != 0, expo + 0x00800000, expo)
        scale = tl.where(scale < float("inf"), up.to(tl.float32, bitcast=True), scale)
    return tl.where(amax == 0.0, 1.0, scale)


# fp32 -> fp8 with one rounding to nearest even, 4 elements per instance (two packed conversions).
# PTX: `cvt.rn.satfinite.e4m3x2.f32 d, a, b` puts a in the high byte of d and b in the low byte.
_CVT_ASM = """{
  .reg .b16 lo, hi;
  cvt.rn.satfinite.%s lo, $2, $1;
  cvt.rn.satfinite.%s hi, $4, $3;
  mov.b32 $0, {lo, hi};
}"""
E4M3_CVT_ASM = _CVT_ASM % ("e4m3x2.f32", "e4m3x2.f32")
_CVT_E4M3 = tl.constexpr(E4M3_CVT_ASM)  # constexpr: readable from @jit code
_CVT_E5M2 = tl.constexpr(_CVT_ASM % ("e5m2x2.f32", "e5m2x2.f32"))


@triton.jit
def fp8_cast(y, DTYPE: tl.constexpr, MANT: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MIN: tl.constexpr,
             CVT: tl.constexpr):
    """fp32 ``y`` (already within ±FMAX, or NaN) -> fp8, one rounding to nearest even (CVT: see cvt_mode).

    GPU: the sm_89+ instruction ``cvt.rn.satfinite.{e4m3,e5m2}x2.f32`` (a single RNE rounding, as
    PyTorch's cast; Triton's own ``.to(fp8)`` is not guaranteed to round once). Interpreter: its
    conversion is not RNE either (ties and mantissa carries), so ``y`` is first rounded onto the fp8
    grid in fp32 — normal range by the integer-add trick on the bits, subnormal range
    (|y| < SUB_MIN) by adding and removing SUB_MAGIC — after which the conversion is exact.
    """
    if CVT == 1:
        drop: tl.constexpr = 23 - MANT
        bits = y.to(tl.int32, bitcast=True)
        lsb = (bits >> drop) & 1
        rounded = ((bits + ((1 << (drop - 1)) - 1) + lsb) & ~((1 << drop) - 1)).to(tl.float32, bitcast=True)
        a = tl.abs(y)
        sub = (a + SUB_MAGIC) - SUB_MAGIC
        sub = tl.where(bits < 0, -sub, sub)  # sign bit: keeps -0.0
        y = tl.where(a < SUB_MIN, sub, rounded)
        return y.to(DTYPE, fp_downcast_rounding="rtne")
    elif CVT == 2:
        return y.to(DTYPE, fp_downcast_rounding="rtne")
    elif MANT == 3:
        return tl.inline_asm_elementwise(_CVT_E4M3, "=r,r,r,r,r", [y], dtype=tl.uint8, is_pure=True,
                                         pack=4).to(DTYPE, bitcast=True)
    else:
        return tl.inline_asm_elementwise(_CVT_E5M2, "=r,r,r,r,r", [y], dtype=tl.uint8, is_pure=True,
                                         pack=4).to(DTYPE, bitcast=True)


@triton.jit
def mul_rounded(a, b, INTERPRET: tl.constexpr):
    """``a · b`` rounded to fp32 by itself (PTX ``mul.rn``, which is never contracted into an FMA).

    Where a product is compared with, or subtracted from, a value computed from its own rounded
    result (a row max, a delta), an FMA of the unrounded product leaves the rounding residual
    instead of zero. The interpreter multiplies in NumPy, never fused."""
    if INTERPRET:
        return a * b
    else:
        a, b = tl.broadcast(a, b)
        return libdevice.mul_rn(a, b)


# |x / scale| below this comes out of divide_by_scale as a zero of its sign, which every fp8 format
# casts it to anyway (E5M2's smallest code is 2^-16); above it the FMA remainders stay normal.
_DIV_TINY = tl.constexpr(5.421010862427522e-20)  # 2^-64


@triton.jit
def divide_by_scale(x, scale, INTERPRET: tl.constexpr):
    """``x / scale`` as the fp8 cast sees IEEE division: ``x`` fp32 (R, C), ``scale`` its block
    scales (R, 1) or (1, C), each a normal number below 2^127 (:func:`scale_from_amax` makes them so),
    +inf or NaN, and |x / scale| <= 2^100 (x within its block gives at most FMAX). Equal to
    ``div_rn`` bit for bit where |x / scale| >= 2^-64; smaller quotients come out as a zero of the
    same sign (the same fp8 code).

    ``div.rn.f32`` costs a dozen instructions per element with a branch to a slow path, and ptxas
    does not interleave the branchy divisions: in the forward's Q quantization they took 28% of a
    short launch's stall samples (benchmarks/NOTES.md). Here, per block: scale = m·2^k with m in
    [1, 2) and y = RN(1/m). Per element: xs = x·2^-k (exact, or below 2^-64), q = RN(xs·y), then two
    steps q += r·y with the exact FMA remainder r = xs − m·q; the first makes q faithful, the second
    correctly rounded (Markstein's theorem, which holds as xs, r and y stay normal). Scaling by 2^-k
    first keeps them normal for every block scale, so no branch is needed. Non-finite scales take
    x·(1/scale), which is IEEE x/scale there (±0 or NaN). The interpreter does not fuse FMAs: there
    ``div_rn``.
    """
    if INTERPRET:
        return tl.math.div_rn(x, scale)
    bits = scale.to(tl.int32, bitcast=True)
    expo = (bits >> 23) & 0xFF
    finite = expo < 255
    m = ((bits & 0x007FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)  # scale's mantissa, [1, 2)
    # 2^(127 - expo), NaN for non-finite scales so that they leave the FMA path below.
    pre = tl.where(finite, ((254 - expo) << 23).to(tl.float32, bitcast=True), float("nan"))
    y = tl.math.div_rn(tl.full(m.shape, 1.0, tl.float32), m)
    neg_m = -m
    other = tl.where(scale != scale, float("nan"), 0.0)  # 1/scale where it is not finite (+inf or NaN)
    xs = x * pre
    q = xs * y
    q = tl.fma(tl.fma(q, neg_m, xs), y, q)
    q = tl.fma(tl.fma(q, neg_m, xs), y, q)
    # Tiny quotients: x·0 is a zero of x's sign; non-finite scales: x·(1/scale).
    return tl.where(tl.abs(xs) >= _DIV_TINY, q, x * other)


@triton.jit
def to_fp8(x, scale, FMAX: tl.constexpr, DTYPE: tl.constexpr, MANT: tl.constexpr, SUB_MAGIC: tl.constexpr,
           SUB_MIN: tl.constexpr, CVT: tl.constexpr, FMA_DIVISION: tl.constexpr = False):
    """fp8 codes of fp32 ``x / scale`` (IEEE division), clamped to ±FMAX with NaN kept.

    FMA_DIVISION: the division by :func:`divide_by_scale` (``scale`` (R, 1) row scales, or (1, C)
    sequence-wide channel scales). Its per-scale work is repeated by every thread holding a piece of
    the block, which costs little for those but made the channel-wise copy with per-tile scales
    slower than ``div_rn`` (benchmarks/NOTES.md)."""
    if FMA_DIVISION:
        y = divide_by_scale(x, scale, CVT == 1)
    else:
        y = tl.math.div_rn(x, scale)
    y = tl.clamp(y, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
    return fp8_cast(y, DTYPE, MANT, SUB_MAGIC, SUB_MIN, CVT)


CVT_ENV = "HF_FP8_ATTENTION_CVT"


def cvt_mode() -> int:
    """How :func:`fp8_cast` converts: 0 the PTX instruction (GPU default), 1 explicit rounding
    (always under the interpreter), 2 Triton's own ``.to`` (``HF_FP8_ATTENTION_CVT=triton``, for
    comparisons only: not guaranteed to round once)."""
    if interpreting():
        return 1
    return 2 if os.environ.get(CVT_ENV, "") == "triton" else 0


def cast_meta(fmt: FP8Format, prefix: str) -> dict:
    """Constexprs of :func:`fp8_cast` for ``fmt`` (plus CVT = cvt_mode(), passed once per kernel)."""
    mant, emin = (3, -6) if fmt is FP8Format.E4M3 else (2, -14)
    return {
        f"{prefix}_MANT": mant,
        f"{prefix}_SUB_MAGIC": 2.0 ** (23 + emin - mant),  # adding it leaves a multiple of the subnormal step
        f"{prefix}_SUB_MIN": 2.0 ** emin,
    }


@triton.jit
def load_hadamard(h_ptr, BLOCK_D: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """The ±1 Hadamard matrix ``(BLOCK_D, BLOCK_D)`` at ``h_ptr`` (TRANSPOSED: its transpose), in the
    dtype it is stored in (that of the rotation's dot, :func:`dot_dtype`). Load it once per program,
    outside any loop: reloaded per 32-row chunk as fp32 (64 KB each time) it made the rotated
    quantization 5.7x slower than the plain one (benchmarks/NOTES.md, "Recipe v2")."""
    offs = tl.arange(0, BLOCK_D)
    if TRANSPOSED:
        ptrs = h_ptr + offs[None, :] * BLOCK_D + offs[:, None]
    else:
        ptrs = h_ptr + offs[:, None] * BLOCK_D + offs[None, :]
    return tl.load(ptrs)


@triton.jit
def rotate_rows(x, h, DOT_DTYPE: tl.constexpr, SRC_DTYPE: tl.constexpr, TRANSPOSED: tl.constexpr = False):
    """``x (R, BLOCK_D)`` fp32 times the ±1 Hadamard matrix ``h`` (from :func:`load_hadamard`), in fp32.
    TRANSPOSED (``h`` loaded transposed): the transpose of that product, ``(BLOCK_D, R)``, as Hᵀxᵀ,
    which puts the channels on the dot's M axis (the statistics reduce over tokens, its N axis).

    The products are exact. DOT_DTYPE (:func:`dot_dtype`) is the inputs' own 16-bit type, which
    holds them exactly, or fp32 (a full-precision dot: fp32 inputs up to head dim 128, and the
    interpreter). fp32 inputs (SRC_DTYPE) at head dim 256, whose fp32 matrix alone (256 KB) exceeds
    a block's shared memory, are split into three 16-bit parts, x = x₁ + x₂ + x₃ exactly (8
    significand bits each), and rotated by three 16-bit dots."""
    if DOT_DTYPE == tl.float32:
        y = _hadamard_dot(x, h, None, TRANSPOSED, "ieee")
    elif SRC_DTYPE == tl.float32:
        x1 = x.to(DOT_DTYPE)
        r = x - x1.to(tl.float32)
        x2 = r.to(DOT_DTYPE)
        x3 = (r - x2.to(tl.float32)).to(DOT_DTYPE)
        y = _hadamard_dot(x1, h, None, TRANSPOSED, "tf32")
        y = _hadamard_dot(x2, h, y, TRANSPOSED, "tf32")
        y = _hadamard_dot(x3, h, y, TRANSPOSED, "tf32")
    else:
        y = _hadamard_dot(x.to(DOT_DTYPE), h, None, TRANSPOSED, "tf32")
    return y


@triton.jit
def _hadamard_dot(x, h, acc, TRANSPOSED: tl.constexpr, PRECISION: tl.constexpr):
    """``x @ h`` (TRANSPOSED: ``h @ xᵀ``) in fp32, plus ``acc`` (None: nothing). PRECISION is the
    dot's input precision ("ieee" for fp32 inputs; 16-bit inputs are exact either way)."""
    if TRANSPOSED:
        y = tl.dot(h, tl.trans(x), acc, input_precision=PRECISION, out_dtype=tl.float32)
    else:
        y = tl.dot(x, h, acc, input_precision=PRECISION, out_dtype=tl.float32)
    return y


@triton.jit
def _quantize_tile(
    x_base, sxs, sxd, row_codes_ptr, row_scales_ptr, col_codes_ptr, col_scales_ptr,
    h_ptr, shift_ptr, row_amax_ptr, col_amax_ptr,
    bhi, sh, tile, start, length, slot, S, D, S_PAD, NT,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ROW_CHUNK: tl.constexpr, COL_GROUP: tl.constexpr,
    ROW: tl.constexpr, COL: tl.constexpr, POW2: tl.constexpr, FMAX: tl.constexpr, DTYPE: tl.constexpr,
    MANT: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MIN: tl.constexpr, CVT: tl.constexpr,
    ROTATE: tl.constexpr, SHIFT: tl.constexpr, ROW_HEAD: tl.constexpr, COL_MODE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, ROW_STAGES: tl.constexpr, TILES: tl.constexpr, COL_FMA: tl.constexpr = False,
    COL_PREFETCH: tl.constexpr = False, COL_PV: tl.constexpr = False,
):
    """The copies of TILES consecutive (BLOCK_S tokens, head) tiles of one operand (``x_base``: its
    (batch, head)), from tile ``tile`` (slot ``slot``) on; tiles past the sequence's end are skipped.
    The row-wise copy runs over all of them in one loop of ROW_CHUNK-token slices (its scales are
    per token or per head, never per tile), so its loads pipeline across tile boundaries and the
    Hadamard matrix is loaded once; the channel-wise copy takes them one tile at a time.

    Recipe options (the sequence statistics at index ``sh`` = sequence·H + head, see
    :mod:`.sequence_stats`): the row-wise copy quantizes ``xH − shift`` (ROTATE, SHIFT), with one
    scale per token or, ROW_HEAD, the (sequence, head) scale from ``row_amax`` (stored per token all
    the same, so the attention kernels read either alike); the channel-wise copy takes per-tile
    channel scales (COL_MODE 0), the sequence's channel scales from ``col_amax`` (1) or one scale
    for the (sequence, head) (2), stored in every tile slot of the sequence; COL_PV: its tokens in
    the order of :func:`pv_token_order` (the Gluon kernels' A operands in place).

    A whole (BLOCK_S, BLOCK_D) fp32 tile in registers leaves room for one or two programs per SM
    (255 registers and spills at 128 x 128): too few loads in flight for HBM bandwidth. So each copy
    reads the tile in the slices its scales allow: the row-wise copy ROW_CHUNK tokens at a time
    (a token's scale needs all its channels), the channel-wise copy COL_GROUP channels at a time
    (a channel's scale needs all the tile's tokens; each channel's codes are then a contiguous run
    of BLOCK_S bytes in the transposed layout). With both copies the tile is read twice, the second
    time mostly from L2 (reading it once, whole, with 4-16 warps was slower: benchmarks/NOTES.md).
    """
    if ROW:
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        if ROTATE:
            hm = load_hadamard(h_ptr, BLOCK_D)
        for c in tl.range(0, TILES * BLOCK_S, ROW_CHUNK, num_stages=ROW_STAGES):  # None: the plain loop
            offs_s = tile * BLOCK_S + c + tl.arange(0, ROW_CHUNK)  # position within the sequence
            tok = start + offs_s  # position on the (packed) token axis
            s_ok = offs_s < length
            x_ptrs = x_base + tok[:, None].to(tl.int64) * sxs + offs_d[None, :] * sxd
            x = tl.load(x_ptrs, mask=s_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            if ROTATE:
                x = rotate_rows(x, hm, DOT_DTYPE, x_base.dtype.element_ty)
            if SHIFT:
                x = x - tl.load(shift_ptr + sh * BLOCK_D + offs_d)[None, :]
            if ROW_HEAD:
                head_scale = scale_from_amax(tl.load(row_amax_ptr + sh), FMAX, POW2)
                r_scale = tl.full([ROW_CHUNK], 1.0, tl.float32) * head_scale
            else:
                r_scale = scale_from_amax(abs_max(x, 1), FMAX, POW2)
            r_codes = to_fp8(x, r_scale[:, None], FMAX, DTYPE, MANT, SUB_MAGIC, SUB_MIN, CVT, True)
            tl.store(row_scales_ptr + bhi * S + tok, r_scale, mask=s_ok)
            r_ptrs = row_codes_ptr + (bhi * S + tok[:, None]) * BLOCK_D + offs_d[None, :]
            tl.store(r_ptrs, r_codes, mask=s_ok[:, None])
    if COL:
        head_amax = 0.0  # COL_MODE 2: the (sequence, head)'s amax over its channels
        if COL_MODE == 2:
            head_amax = reduce_max_nan(tl.load(col_amax_ptr + sh * BLOCK_D + tl.arange(0, BLOCK_D)), 0)
        if COL_PREFETCH:
            _col_copy_prefetched(x_base, sxs, sxd, col_codes_ptr, col_scales_ptr, col_amax_ptr, head_amax, bhi, sh,
                                 tile, start, length, slot, D, S_PAD, NT, BLOCK_S, BLOCK_D, COL_GROUP, POW2, FMAX,
                                 DTYPE, MANT, SUB_MAGIC, SUB_MIN, CVT, COL_MODE, COL_FMA, TILES, COL_PV)
        elif TILES == 1:  # the caller checked that the tile holds tokens
            _col_copy(x_base, sxs, sxd, col_codes_ptr, col_scales_ptr, col_amax_ptr, head_amax, bhi, sh, tile,
                      start, length, slot, D, S_PAD, NT, BLOCK_S, BLOCK_D, COL_GROUP, POW2, FMAX, DTYPE, MANT,
                      SUB_MAGIC, SUB_MIN, CVT, COL_MODE, COL_FMA, COL_PV)
        else:
            for i in tl.static_range(TILES):
                if (tile + i) * BLOCK_S < length:
                    _col_copy(x_base, sxs, sxd, col_codes_ptr, col_scales_ptr, col_amax_ptr, head_amax, bhi, sh,
                              tile + i, start, length, slot + i, D, S_PAD, NT, BLOCK_S, BLOCK_D, COL_GROUP, POW2,
                              FMAX, DTYPE, MANT, SUB_MAGIC, SUB_MIN, CVT, COL_MODE, COL_FMA, COL_PV)


@triton.jit
def _col_copy(
    x_base, sxs, sxd, col_codes_ptr, col_scales_ptr, col_amax_ptr, head_amax, bhi, sh, tile, start, length, slot,
    D, S_PAD, NT, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, COL_GROUP: tl.constexpr, POW2: tl.constexpr,
    FMAX: tl.constexpr, DTYPE: tl.constexpr, MANT: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MIN: tl.constexpr,
    CVT: tl.constexpr, COL_MODE: tl.constexpr, COL_FMA: tl.constexpr, COL_PV: tl.constexpr = False,
):
    """The transposed channel-wise copy of one tile (slot ``slot``) of :func:`_quantize_tile`,
    COL_GROUP channels at a time, one slice loaded after the previous one is stored."""
    for g in range(0, BLOCK_D, COL_GROUP):
        x = _col_load(x_base, sxs, sxd, tile, g, start, length, D, BLOCK_S, COL_GROUP)
        _col_cast_store(x, col_codes_ptr, col_scales_ptr, col_amax_ptr, head_amax, bhi, sh, tile, g, start, length,
                        slot, D, S_PAD, NT, BLOCK_S, BLOCK_D, COL_GROUP, POW2, FMAX, DTYPE, MANT, SUB_MAGIC, SUB_MIN,
                        CVT, COL_MODE, COL_FMA, COL_PV)


@triton.jit
def _col_copy_prefetched(
    x_base, sxs, sxd, col_codes_ptr, col_scales_ptr, col_amax_ptr, head_amax, bhi, sh, tile, start, length, slot,
    D, S_PAD, NT, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, COL_GROUP: tl.constexpr, POW2: tl.constexpr,
    FMAX: tl.constexpr, DTYPE: tl.constexpr, MANT: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MIN: tl.constexpr,
    CVT: tl.constexpr, COL_MODE: tl.constexpr, COL_FMA: tl.constexpr, TILES: tl.constexpr,
    COL_PV: tl.constexpr = False,
):
    """:func:`_col_copy` of TILES consecutive tiles from ``tile`` (slot ``slot``) as one unrolled
    sequence of (tile, channel group) slices, each slice's load issued before the previous slice is
    cast and stored: one 16-bit slice in flight while the program computes (the plain loop has none).
    Tiles past the sequence's end load nothing and store nothing; the same codes and scales."""
    GROUPS: tl.constexpr = BLOCK_D // COL_GROUP
    x = _col_load(x_base, sxs, sxd, tile, 0, start, length, D, BLOCK_S, COL_GROUP)
    for i in tl.static_range(TILES * GROUPS):
        if i + 1 < TILES * GROUPS:
            x_next = _col_load(x_base, sxs, sxd, tile + (i + 1) // GROUPS, ((i + 1) % GROUPS) * COL_GROUP, start,
                               length, D, BLOCK_S, COL_GROUP)
        _col_cast_store(x, col_codes_ptr, col_scales_ptr, col_amax_ptr, head_amax, bhi, sh, tile + i // GROUPS,
                        (i % GROUPS) * COL_GROUP, start, length, slot + i // GROUPS, D, S_PAD, NT, BLOCK_S, BLOCK_D,
                        COL_GROUP, POW2, FMAX, DTYPE, MANT, SUB_MAGIC, SUB_MIN, CVT, COL_MODE, COL_FMA, COL_PV)
        if i + 1 < TILES * GROUPS:
            x = x_next


@triton.jit
def _col_load(x_base, sxs, sxd, tile, g, start, length, D, BLOCK_S: tl.constexpr, COL_GROUP: tl.constexpr):
    """The (BLOCK_S tokens, COL_GROUP channels from ``g``) slice of tile ``tile``, in the input's dtype:
    zeros past the sequence's end and the head dim."""
    tile_s = tile * BLOCK_S + tl.arange(0, BLOCK_S)
    chan = g + tl.arange(0, COL_GROUP)
    x_ptrs = x_base + (start + tile_s)[:, None].to(tl.int64) * sxs + chan[None, :] * sxd
    return tl.load(x_ptrs, mask=(tile_s < length)[:, None] & (chan < D)[None, :], other=0.0)


@triton.jit
def _col_cast_store(
    x, col_codes_ptr, col_scales_ptr, col_amax_ptr, head_amax, bhi, sh, tile, g, start, length, slot, D, S_PAD, NT,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, COL_GROUP: tl.constexpr, POW2: tl.constexpr, FMAX: tl.constexpr,
    DTYPE: tl.constexpr, MANT: tl.constexpr, SUB_MAGIC: tl.constexpr, SUB_MIN: tl.constexpr, CVT: tl.constexpr,
    COL_MODE: tl.constexpr, COL_FMA: tl.constexpr, COL_PV: tl.constexpr = False,
):
    """Scales, codes and transposed store of one slice :func:`_col_load` gave (nothing stored where
    the tile starts past the sequence's end). COL_FMA (sequence-wide scales, COL_MODE 1 or 2): the
    division by FMAs of :func:`divide_by_scale` instead of ``div_rn``, the same quotients (see there).
    COL_PV: the tokens in :func:`pv_token_order`."""
    x = x.to(tl.float32)
    tile_s = tile * BLOCK_S + tl.arange(0, BLOCK_S)
    tile_tok = start + tile_s
    tile_ok = tile_s < length
    chan = g + tl.arange(0, COL_GROUP)
    if COL_MODE == 0:
        c_scale = scale_from_amax(abs_max(x, 0), FMAX, POW2)
    elif COL_MODE == 1:
        c_scale = scale_from_amax(tl.load(col_amax_ptr + sh * BLOCK_D + chan), FMAX, POW2)
    else:
        c_scale = tl.full([COL_GROUP], 1.0, tl.float32) * scale_from_amax(head_amax, FMAX, POW2)
    c_codes = to_fp8(x, c_scale[None, :], FMAX, DTYPE, MANT, SUB_MAGIC, SUB_MIN, CVT, COL_FMA and COL_MODE != 0)
    tl.store(col_scales_ptr + (bhi * NT + slot) * BLOCK_D + chan, c_scale, mask=tile * BLOCK_S + 0 * chan < length)
    if COL_PV:  # (tiles start at multiples of 16; the caller checked the length)
        c_codes = pv_token_order(c_codes)
    c_ptrs = col_codes_ptr + (bhi * BLOCK_D + chan[None, :]) * S_PAD + tile_tok[:, None]
    tl.store(c_ptrs, c_codes, mask=tile_ok[:, None])


def pv_order_fits(length: int, varlen: bool) -> bool:
    """Whether a channel-wise copy of ``length`` tokens can hold them in :func:`pv_token_order`
    (``Copies.col_pv``): a dense batch whose length is a multiple of 16, so that every aligned group
    of 16 the order permutes lies inside the sequence (a packed sequence starts anywhere)."""
    return not varlen and length % 16 == 0


@triton.jit
def pv_token_order(x, AXIS: tl.constexpr = 0):
    """``x`` (2-D) with its tokens along ``AXIS`` in the order of the Gluon kernels' A operands taken
    in place (``Copies.col_pv``): in each aligned group of 16, position 4q + 2i + b holds token
    8i + 2q + b. A wgmma's accumulator gives thread q of a quad the columns 8i + 2q + b of each 16,
    an FP8 A operand takes 4q + 2i + b: with the other operand's tokens in this order, P's (dS's)
    codes feed the product from the registers they were computed in
    (``gluon_hopper.a_operand_in_place``). The channel-wise copies permute their (tokens, channels)
    slices (AXIS 0) in registers, so that the store stays contiguous; the Triton forward permutes
    P's key columns (AXIS 1)."""
    ROWS: tl.constexpr = x.shape[0]
    COLS: tl.constexpr = x.shape[1]
    if AXIS == 0:
        x = tl.reshape(x, (ROWS // 16, 2, 4, 2, COLS))  # token 16·g + 8i + 2q + b
        return tl.reshape(tl.permute(x, (0, 2, 1, 3, 4)), (ROWS, COLS))
    else:
        x = tl.reshape(x, (ROWS, COLS // 16, 2, 4, 2))
        return tl.reshape(tl.permute(x, (0, 1, 3, 2, 4)), (ROWS, COLS))


@triton.jit
def quantize_kernel(
    x_ptr, sxb, sxh, sxs, sxd,  # operand X: (B, H, S, D)
    x_row_codes_ptr, x_row_scales_ptr,  # (B, H, S, DP), (B, H, S)
    x_col_codes_ptr, x_col_scales_ptr,  # (B, H, DP, S_PAD), (B, H, NT, DP)
    y_ptr, syb, syh, sys_, syd,  # operand Y (same shape; grid axis 2 == 2 only): same layouts
    y_row_codes_ptr, y_row_scales_ptr, y_col_codes_ptr, y_col_scales_ptr,
    x_shift_ptr, x_row_amax_ptr, x_col_amax_ptr,  # X's sequence statistics (read only if asked)
    y_shift_ptr, y_row_amax_ptr, y_col_amax_ptr,
    h_ptr,  # (DP, DP) ±1 Hadamard matrix (read only if a copy is rotated)
    cu_ptr, tile_off_ptr,  # varlen: (n_seq + 1,) token offsets, (n_seq,) first tile slot of each sequence
    H, S, D, S_PAD, NT,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ROW_CHUNK: tl.constexpr, COL_GROUP: tl.constexpr,
    POW2: tl.constexpr, IS_VARLEN: tl.constexpr, CVT: tl.constexpr,
    X_ROW: tl.constexpr, X_COL: tl.constexpr, X_FMAX: tl.constexpr, X_DTYPE: tl.constexpr,
    X_MANT: tl.constexpr, X_SUB_MAGIC: tl.constexpr, X_SUB_MIN: tl.constexpr,
    X_ROTATE: tl.constexpr, X_SHIFT: tl.constexpr, X_ROW_HEAD: tl.constexpr, X_COL_MODE: tl.constexpr,
    Y_ROW: tl.constexpr, Y_COL: tl.constexpr, Y_FMAX: tl.constexpr, Y_DTYPE: tl.constexpr,
    Y_MANT: tl.constexpr, Y_SUB_MAGIC: tl.constexpr, Y_SUB_MIN: tl.constexpr,
    Y_ROTATE: tl.constexpr, Y_SHIFT: tl.constexpr, Y_ROW_HEAD: tl.constexpr, Y_COL_MODE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, ROW_STAGES: tl.constexpr = None, TILES: tl.constexpr = 1, COL_FMA: tl.constexpr = False,
    COL_PREFETCH: tl.constexpr = False, X_COL_PV: tl.constexpr = False, Y_COL_PV: tl.constexpr = False,
):
    """One program per (TILES consecutive tiles of BLOCK_S tokens of one sequence, batch·head, operand).

    Two operands of one shape share a launch (grid axis 2 picks X or Y), each with its own copies
    and format: a launch costs tens of microseconds of host time, more than quantizing a short
    sequence takes on the GPU.
    """
    quantize_block(
        tl.program_id(0) * TILES, tl.program_id(1), tl.program_id(2),
        x_ptr, sxb, sxh, sxs, sxd, x_row_codes_ptr, x_row_scales_ptr, x_col_codes_ptr, x_col_scales_ptr,
        y_ptr, syb, syh, sys_, syd, y_row_codes_ptr, y_row_scales_ptr, y_col_codes_ptr, y_col_scales_ptr,
        x_shift_ptr, x_row_amax_ptr, x_col_amax_ptr, y_shift_ptr, y_row_amax_ptr, y_col_amax_ptr,
        h_ptr, cu_ptr, tile_off_ptr, H, S, D, S_PAD, NT,
        BLOCK_S, BLOCK_D, ROW_CHUNK, COL_GROUP, POW2, IS_VARLEN, CVT,
        X_ROW, X_COL, X_FMAX, X_DTYPE, X_MANT, X_SUB_MAGIC, X_SUB_MIN, X_ROTATE, X_SHIFT, X_ROW_HEAD, X_COL_MODE,
        Y_ROW, Y_COL, Y_FMAX, Y_DTYPE, Y_MANT, Y_SUB_MAGIC, Y_SUB_MIN, Y_ROTATE, Y_SHIFT, Y_ROW_HEAD, Y_COL_MODE,
        DOT_DTYPE, ROW_STAGES, TILES, COL_FMA, COL_PREFETCH, X_COL_PV, Y_COL_PV,
    )


@triton.jit
def quantize_block(
    tile, bh, op,
    x_ptr, sxb, sxh, sxs, sxd, x_row_codes_ptr, x_row_scales_ptr, x_col_codes_ptr, x_col_scales_ptr,
    y_ptr, syb, syh, sys_, syd, y_row_codes_ptr, y_row_scales_ptr, y_col_codes_ptr, y_col_scales_ptr,
    x_shift_ptr, x_row_amax_ptr, x_col_amax_ptr, y_shift_ptr, y_row_amax_ptr, y_col_amax_ptr,
    h_ptr, cu_ptr, tile_off_ptr, H, S, D, S_PAD, NT,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ROW_CHUNK: tl.constexpr, COL_GROUP: tl.constexpr,
    POW2: tl.constexpr, IS_VARLEN: tl.constexpr, CVT: tl.constexpr,
    X_ROW: tl.constexpr, X_COL: tl.constexpr, X_FMAX: tl.constexpr, X_DTYPE: tl.constexpr,
    X_MANT: tl.constexpr, X_SUB_MAGIC: tl.constexpr, X_SUB_MIN: tl.constexpr,
    X_ROTATE: tl.constexpr, X_SHIFT: tl.constexpr, X_ROW_HEAD: tl.constexpr, X_COL_MODE: tl.constexpr,
    Y_ROW: tl.constexpr, Y_COL: tl.constexpr, Y_FMAX: tl.constexpr, Y_DTYPE: tl.constexpr,
    Y_MANT: tl.constexpr, Y_SUB_MAGIC: tl.constexpr, Y_SUB_MIN: tl.constexpr,
    Y_ROTATE: tl.constexpr, Y_SHIFT: tl.constexpr, Y_ROW_HEAD: tl.constexpr, Y_COL_MODE: tl.constexpr,
    DOT_DTYPE: tl.constexpr, ROW_STAGES: tl.constexpr, TILES: tl.constexpr, COL_FMA: tl.constexpr,
    COL_PREFETCH: tl.constexpr = False, X_COL_PV: tl.constexpr = False, Y_COL_PV: tl.constexpr = False,
):
    """The copies of TILES tiles from tile ``tile`` of (sequence·head ``bh``, operand ``op``: X or
    Y), :func:`quantize_kernel`'s arguments; nothing where the tile starts past the sequence."""
    b = bh // H
    h = bh % H
    start, length, slot, bb = block_of_sequence(b, tile, cu_ptr, tile_off_ptr, S, IS_VARLEN)
    if tile * BLOCK_S < length:
        row = bb.to(tl.int64)
        bhi = row * H + h
        sh = b.to(tl.int64) * H + h  # (sequence, head) of the statistics
        if op == 0:
            _quantize_tile(x_ptr + row * sxb + h * sxh, sxs, sxd, x_row_codes_ptr, x_row_scales_ptr, x_col_codes_ptr,
                           x_col_scales_ptr, h_ptr, x_shift_ptr, x_row_amax_ptr, x_col_amax_ptr,
                           bhi, sh, tile, start, length, slot, S, D, S_PAD, NT,
                           BLOCK_S, BLOCK_D, ROW_CHUNK, COL_GROUP, X_ROW, X_COL, POW2, X_FMAX, X_DTYPE, X_MANT,
                           X_SUB_MAGIC, X_SUB_MIN, CVT, X_ROTATE, X_SHIFT, X_ROW_HEAD, X_COL_MODE, DOT_DTYPE,
                           ROW_STAGES, TILES, COL_FMA, COL_PREFETCH, X_COL_PV)
        else:
            _quantize_tile(y_ptr + row * syb + h * syh, sys_, syd, y_row_codes_ptr, y_row_scales_ptr, y_col_codes_ptr,
                           y_col_scales_ptr, h_ptr, y_shift_ptr, y_row_amax_ptr, y_col_amax_ptr,
                           bhi, sh, tile, start, length, slot, S, D, S_PAD, NT,
                           BLOCK_S, BLOCK_D, ROW_CHUNK, COL_GROUP, Y_ROW, Y_COL, POW2, Y_FMAX, Y_DTYPE, Y_MANT,
                           Y_SUB_MAGIC, Y_SUB_MIN, CVT, Y_ROTATE, Y_SHIFT, Y_ROW_HEAD, Y_COL_MODE, DOT_DTYPE,
                           ROW_STAGES, TILES, COL_FMA, COL_PREFETCH, Y_COL_PV)


@functools.lru_cache(maxsize=None)  # a few entries (head dims x dtypes x devices), never evicted while in use
def hadamard_operand(head_dim: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ±1 Hadamard matrix of ``head_dim`` (:mod:`hf_fp8_attention.transforms`) zero-padded to
    ``(DP, DP)``, contiguous, in ``dtype`` (exact in any float type): the B operand of
    :func:`rotate_rows`, stored in the dtype of its dot (:func:`torch_dot_dtype`).

    Made once per key on a helper thread: a first call inside ``torch.compile(mode="reduce-overhead")``
    runs in the CUDA graph's memory pool, which takes the allocations of the calling thread only;
    a cached tensor made there would live in the pool untracked, and Inductor refuses to record the
    graph."""
    def build() -> torch.Tensor:
        dp = padded_head_dim(head_dim)
        h = torch.zeros(dp, dp, dtype=torch.float32, device=device)
        h[:head_dim, :head_dim] = hadamard_matrix(head_dim, device=device)
        h = h.to(dtype)
        if h.is_cuda:
            torch.cuda.synchronize(h.device)  # ready for any stream of the caller
        return h

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(build).result()


def rotation_operand(x: torch.Tensor) -> torch.Tensor:
    """The Hadamard matrix for rotating rows of ``x (..., D)``: in the dtype of the rotation's dot."""
    return hadamard_operand(x.shape[-1], x.device, torch_dot_dtype(x))


def torch_dot_dtype(x: torch.Tensor) -> torch.dtype:
    """:func:`dot_dtype` as a torch dtype."""
    return {tl.float32: torch.float32, tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}[dot_dtype(x)]


def dot_dtype(x: torch.Tensor):
    """The dtype :func:`rotate_rows`' dot runs in for inputs like ``x (..., D)``: fp32 under the
    interpreter and for fp32 inputs up to head dim 128 (bf16 beyond: three split dots), else the
    inputs' own 16-bit type."""
    if interpreting() or (x.dtype == torch.float32 and padded_head_dim(x.shape[-1]) <= 128):
        return tl.float32
    return tl.float16 if x.dtype == torch.float16 else tl.bfloat16


def padded_head_dim(d: int) -> int:
    """The head dim the kernels compute with (a power of two: 64 -> 64, 80 and 96 -> 128, 128 -> 128,
    256 -> 256)."""
    return next_pow2(d)


def tile_slots(cu_seqlens: torch.Tensor | None, seq_len: int, block: int) -> tuple[torch.Tensor | None, int]:
    """Where each sequence's tiles start in the tile-scale arrays, and how many slots to allocate.

    Dense: tile ``t`` is slot ``t`` (``ceil(S / block)`` slots). Varlen: sequence ``i``'s tiles are
    slots ``tile_off[i] + t`` (exclusive cumsum of ``ceil(len_i / block)``, computed on the device
    without a sync); ``S // block + n_seq`` slots always suffice (each
    sequence adds at most one partial tile).
    """
    if cu_seqlens is None:
        return None, cdiv(max(seq_len, 1), block)
    return sequence_block_offsets(cu_seqlens, block), seq_len // block + cu_seqlens.numel() - 1


class Copies(NamedTuple):
    """Which FP8 copies of one operand to emit, their format, and the recipe's options for them.

    ``rotate`` / ``shift``: the row-wise copy quantizes ``xH − shift`` (Hadamard rotation; the
    subtracted vector of the statistics, e.g. the rotated key mean). ``row_head``: one row-wise
    scale per (sequence, head). ``col_mode``: channel-wise scales per tile (0), per channel of the
    sequence (1), or one per (sequence, head) (2). Every option but the defaults and ``col_pv`` needs
    the operand's :class:`.sequence_stats.SequenceStats`. ``col_pv``: the channel-wise copy's tokens
    in the order the Gluon kernels take their A operands in place (:func:`pv_token_order`; dense
    batches, lengths a multiple of 16), the same codes and scales.
    """

    row: bool
    col: bool
    fmt: FP8Format = FP8Format.E4M3
    rotate: bool = False
    shift: bool = False
    row_head: bool = False
    col_mode: int = 0
    col_pv: bool = False

    @property
    def needs_stats(self) -> bool:
        return (self.row and (self.shift or self.row_head)) or (self.col and self.col_mode != 0)


_NO_COPIES = Copies(False, False)


@functools.lru_cache(maxsize=None)
def _copies_meta(copies: Copies, prefix: str) -> dict:
    """The kernel's constexprs for one operand (``prefix`` "X" or "Y"); cached: built once per kind."""
    return {f"{prefix}_ROW": copies.row, f"{prefix}_COL": copies.col, f"{prefix}_FMAX": copies.fmt.max,
            f"{prefix}_DTYPE": TL_FP8[copies.fmt], **cast_meta(copies.fmt, prefix),
            f"{prefix}_ROTATE": copies.row and copies.rotate, f"{prefix}_SHIFT": copies.row and copies.shift,
            f"{prefix}_ROW_HEAD": copies.row and copies.row_head,
            f"{prefix}_COL_MODE": copies.col_mode if copies.col else 0,
            f"{prefix}_COL_PV": copies.col and copies.col_pv}


def _alloc_copies(x: torch.Tensor, copies: Copies, dp: int, s_pad: int, n_slots: int, varlen: bool):
    """Output buffers of :func:`quantize_operands` for one operand (None where no copy is asked)."""
    bsz, heads, seq, _ = x.shape
    dev, dtype = x.device, copies.fmt.dtype
    row_codes = row_scales = col_codes = col_scales = None
    if copies.row:
        row_codes = torch.empty(bsz, heads, seq, dp, dtype=dtype, device=dev)
        row_scales = torch.empty(bsz, heads, seq, dtype=torch.float32, device=dev)
    if copies.col:
        col_codes = torch.empty(bsz, heads, dp, s_pad, dtype=dtype, device=dev)
        if s_pad > seq:
            col_codes[..., seq:].zero_()
        # Dense: every slot is written by its tile, padded channels included (scale 1). Packed
        # sequences leave slack slots no tile writes; they must still hold a finite scale.
        alloc = torch.ones if varlen or seq == 0 else torch.empty
        col_scales = alloc(bsz, heads, n_slots, dp, dtype=torch.float32, device=dev)
    return row_codes, row_scales, col_codes, col_scales


def check_operand_pair(fn: str, xs: tuple, options: tuple, option_name: str) -> None:
    """The launches that take two operands (grid axis 2) take one or two tensors of one shape, with
    one ``option_name`` each; raise a ValueError naming ``fn`` otherwise."""
    if len(xs) not in (1, 2) or len(options) != len(xs):
        raise ValueError(f"{fn}: one or two tensors, one {option_name} each; got {len(xs)} and {len(options)}")
    if len(xs) == 2 and xs[0].shape != xs[1].shape:
        raise ValueError(f"{fn}: tensors of one launch must share a shape, got "
                         f"{tuple(xs[0].shape)} and {tuple(xs[1].shape)}")


def quantize_operands(
    xs: tuple[torch.Tensor, ...],
    copies: tuple[Copies, ...],
    *,
    block: int,
    pow2: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    row_chunk: int | None = None,
    col_group: int | None = None,
    stats: tuple | None = None,
) -> list[tuple]:
    """Row-wise and/or transposed channel-wise FP8 copies of one or two tensors of one shape, in one
    launch (each tensor is read from memory once; with both copies each tile is read a second time,
    mostly from L2).

    Args:
        xs: one or two tensors ``(B, H, S, D)`` of the same shape, bf16/fp16/fp32, any strides.
            Varlen: ``B == 1``, packed token axis.
        copies: per tensor, which copies to emit and their FP8 format (:class:`Copies`).
        block: tokens per channel-wise tile (tiles start at every sequence start).
        cu_seqlens: int32 ``(n_seq + 1,)`` for packed batches, with ``max_seqlen`` its longest length.
        row_chunk / col_group: tokens / channels a program reads at a time for the row-wise /
            channel-wise copy (powers of two; defaults in :func:`quant_launch`, capped at ``block`` /
            the padded head dim). They change the speed only, never a code or a scale.
        stats: per tensor its :class:`.sequence_stats.SequenceStats` (or None), needed by the
            options of :class:`Copies` beyond the defaults.
    Returns:
        Per tensor ``(row_codes (B, H, S, DP) | None, row_scales (B, H, S) fp32 | None,
        col_codes_t (B, H, DP, S_pad) | None, col_scales (B, H, NT, DP) fp32 | None, tile_off | None)``
        with ``DP = padded_head_dim(D)``, ``S_pad`` = S rounded up to 16 (pad columns are zero),
        ``NT`` tile slots (see :func:`tile_slots`); padded channels hold zero codes and scale 1.
    """
    plan = plan_quantize(xs, copies, block=block, pow2=pow2, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                         row_chunk=row_chunk, col_group=col_group, stats=stats)
    launch_kernel(quantize_kernel, plan.grid, *plan.args, **plan.meta)
    return plan.outs


class QuantizeLaunch(NamedTuple):
    """A launch of :func:`quantize_kernel` as :func:`plan_quantize` sets it up: per operand X and Y
    its input, strides and copies' buffers (``operands``) and its statistics (``stats``); the
    Hadamard matrix ``h``; the packed batch's ``cu_seqlens`` and tile offsets (``packing``); the
    sizes (H, S, D, S_PAD, NT); its constexprs and options (``meta``); ``grid``; and the outputs
    per operand as :func:`quantize_operands` returns them (allocated, not yet written)."""

    operands: tuple[tuple, tuple]
    stats: tuple[tuple, tuple]
    h: torch.Tensor
    packing: tuple
    sizes: tuple
    meta: dict
    grid: tuple[int, int, int]
    outs: list

    @property
    def args(self) -> tuple:
        """:func:`quantize_kernel`'s positional arguments."""
        return (*self.operands[0], *self.operands[1], *self.stats[0], *self.stats[1], self.h, *self.packing,
                *self.sizes)


def plan_quantize(
    xs: tuple[torch.Tensor, ...],
    copies: tuple[Copies, ...],
    *,
    block: int,
    pow2: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    row_chunk: int | None = None,
    col_group: int | None = None,
    stats: tuple | None = None,
    launch: dict | None = None,
    fn: str = "quantize_operands",
) -> QuantizeLaunch:
    """:func:`quantize_operands`'s launch (see there for the arguments), its outputs allocated.
    ``launch``: a launch table instead of :func:`quant_launch`'s; ``fn``: the name errors give."""
    check_operand_pair(fn, xs, copies, "Copies")
    x = xs[0]
    bsz, heads, seq, d = x.shape
    dp = padded_head_dim(d)
    varlen = cu_seqlens is not None
    tile_off, n_slots = tile_slots(cu_seqlens, seq, block)
    s_pad = cdiv(max(seq, 1), 16) * 16  # 16-byte aligned rows of the transposed copy
    outs = [_alloc_copies(t, c, dp, s_pad, n_slots, varlen) for t, c in zip(xs, copies)]
    rotated = any(c.row and c.rotate for c in copies)
    launch = launch or quant_launch(rotated, dp)
    if varlen:
        n_seq = cu_seqlens.numel() - 1
        max_len = int(max_seqlen) if max_seqlen is not None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        n_tiles, rows = cdiv(max(max_len, 1), block), n_seq * heads
        cu = cu_seqlens.to(torch.int32)
    else:
        n_tiles, rows = cdiv(max(seq, 1), block), bsz * heads
        cu = None
    tiles = tiles_per_program(launch.get("tiles") or 1, n_tiles, rows * len(xs), x.device)
    grid = (cdiv(n_tiles, tiles), rows, len(xs))
    row_chunk = min(row_chunk or launch["row_chunk"], block)
    col_group = min(col_group or launch["col_group"], dp)
    for name, value in (("row_chunk", row_chunk), ("col_group", col_group)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{fn}: {name} must be a power of two, got {value}")
    dummy = x  # never read when the matching constexpr is off
    operand_args = [(t, *t.stride(), *(dummy if o is None else o for o in out)) for t, out in zip(xs, outs)]
    if len(xs) == 1:
        operand_args.append(operand_args[0])  # operand Y: no copies, never read
    stats = tuple(stats) if stats is not None else (None,) * len(xs)
    stat_args = []
    for c, st in zip(copies, stats):
        if c.col and c.col_pv and not pv_order_fits(seq, varlen):
            raise ValueError(f"{fn}: the P·V token order (Copies.col_pv) needs a dense batch whose length is a "
                             f"multiple of 16, got {'a packed batch' if varlen else f'{seq} tokens'}")
        if c.needs_stats and st is None:
            raise ValueError(f"{fn}: {c} needs the operand's sequence statistics")
        stat_args.append((dummy, dummy, dummy) if st is None else tuple(st))
    if len(xs) == 1:
        stat_args.append(stat_args[0])
    h = rotation_operand(x) if rotated else dummy
    meta = dict(BLOCK_S=block, BLOCK_D=dp, ROW_CHUNK=row_chunk, COL_GROUP=col_group, POW2=pow2, IS_VARLEN=varlen,
                CVT=cvt_mode(), **_copies_meta(copies[0], "X"),
                **_copies_meta(copies[1] if len(xs) == 2 else _NO_COPIES, "Y"), DOT_DTYPE=dot_dtype(x),
                ROW_STAGES=launch.get("row_stages"), TILES=tiles, COL_FMA=COL_FMA_DIVISION and not varlen,
                COL_PREFETCH=bool(launch.get("col_prefetch")) and not varlen,
                num_warps=launch["num_warps"], maxnreg=launch.get("maxnreg"), **COMPILE_OPTIONS)
    packing = (cu, tile_off) if varlen else (dummy, dummy)
    return QuantizeLaunch(tuple(operand_args), tuple(stat_args), h, packing, (heads, seq, d, s_pad, n_slots), meta,
                          grid, [(*out, tile_off) for out in outs])


def tiles_per_program(tiles: int, n_tiles: int, rows: int, device: torch.device) -> int:
    """The launch table's ``tiles`` where a grid of ``rows`` x ``n_tiles`` tiles still gives every
    multiprocessor of ``device`` :data:`TILES_MIN_PROGRAMS_PER_SM` programs with them, else 1
    (the same codes either way; off CUDA, the table's value)."""
    if tiles > 1 and on_cuda(device):
        if cdiv(n_tiles, tiles) * rows < TILES_MIN_PROGRAMS_PER_SM * sm_count(device.index):
            return 1
    return tiles


def quantize_operand(
    x: torch.Tensor,
    *,
    row: bool,
    col: bool,
    block: int,
    fmt: FP8Format = FP8Format.E4M3,
    pow2: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    row_chunk: int | None = None,
    col_group: int | None = None,
):
    """:func:`quantize_operands` for one tensor: ``(row_codes, row_scales, col_codes_t, col_scales,
    tile_off)`` of ``x (B, H, S, D)`` (see there)."""
    return quantize_operands((x,), (Copies(row, col, fmt),), block=block, pow2=pow2, cu_seqlens=cu_seqlens,
                             max_seqlen=max_seqlen, row_chunk=row_chunk, col_group=col_group)[0]
