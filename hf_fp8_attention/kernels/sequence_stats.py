"""Per-(sequence, head) statistics of one to three attention operands, for the recipe's
sequence-wide scales and the QKᵀ transforms (docs/design.md, "Recipes").

For ``x (B, H, S, D)`` (varlen: ``B == 1`` and cu_seqlens delimit the sequences) one launch (two
with :data:`FOLD_IN_PARTIALS` off) gives, per (sequence, head), what :class:`StatsNeed` asks for:

- ``col_amax (n_seq, H, DP)``: max over the sequence's tokens of |x| per channel (the channel-wise
  scales of the token contractions, granularity ``channel``; its max over channels for ``head``);
- ``shift (n_seq, H, DP)``: what the row-wise copy subtracts after the optional rotation: the
  rotated channel mean μH (K-smoothing), or zeros;
- ``row_amax (n_seq, H)``: max over tokens and channels of |xH − shift| (the ``head`` granularity
  of the head-dim contractions), exact from the per-channel extremes:
  ``max_c max(max_t (xH)_tc − shift_c, shift_c − min_t (xH)_tc)`` (subtracting one number is
  monotonic in fp32, so this equals the amax of the values the quantization kernel forms).

:func:`_partials_kernel` reduces chunks of ``CHUNK`` tokens to four vectors (max and min of the
rotated rows, amax and sum of the raw rows; with :data:`TRANSPOSED_ROTATION` the sum of the rotated
rows, whose mean is then the shift as it stands); each program then counts its chunk done on an atomic
counter per (sequence, head, operand), and the program that counts last folds all of the sequence's
chunks in order (:func:`_fold_sequence`). With :data:`FOLD_IN_PARTIALS` off a second launch,
:func:`_finish_kernel`, folds instead. Up to three operands share the launches (grid axis 2, as in
the quantization kernel), each with its own head count: the forward's Q beside K and V. Either way
the fold's order is fixed, so the statistics, and so the codes, are the same on every call (the
backward re-quantizes Q and K exactly as the forward did). Statistics nobody asked for are not
computed (their vectors hold the reduction's identity, and the outputs built from them are
meaningless).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .quantize import (
    COMPILE_OPTIONS, abs_max, dot_dtype, interpreting, load_hadamard, max_nan, min_nan,
    padded_head_dim, reduce_max_nan, reduce_min_nan, rotate_rows, rotation_operand, scratch_empty,
)
from .launch import launch as launch_kernel
from .tiles import block_of_sequence, cdiv, has_tma, on_cuda, sequence_block_offsets

# Tokens one partials program reduces, and how many it loads at a time.
CHUNK = 256
SUB_CHUNK = 32
# A launch that rotates rows: tokens per dot with the Hadamard matrix, and warps (32 on 2 warps was
# the fastest of the shapes benchmarks/rotation_bench.py tries, 94 µs for a (2, 16, 8k, 128) tensor).
# ``stages`` software-pipelines the slice loop's loads (tl.range num_stages) and ``maxnreg`` caps the
# registers per thread (ptxas): loads and register allocation only, never a value
# (benchmarks/prep_bench.py --sweep checks bit for bit); None leaves the compiler's choice. One stage
# (no prefetch) takes 174-176 registers instead of 242-252, five programs per SM instead of four: the
# K+V statistics at 2 x 8k tokens 117 -> 86 us on the H200, same bits (benchmarks/NOTES.md).
# ``elementwise`` keeps a rotating launch's extremes element-wise where no operand is smoothed;
# ``elementwise_smoothed`` there too (K's): at 32-token slices it spills (255 registers), at 16 it
# fits (176) but K's statistics ran slower either way on the H200 (73 -> 87 / 78 us).
ROTATED_PARTIALS = {"sub": 32, "num_warps": 2, "elementwise": True, "stages": 1, "maxnreg": None,
                    "elementwise_smoothed": False}
# The rotating launch's form up to head dim 128: the dot as Hᵀxᵀ (channels on its M axis, a wgmma
# from 4 warps on) with its own table, TRANSPOSED_PARTIALS; off: xH on ROTATED_PARTIALS. Transposed,
# the reductions over tokens stay inside a warp and the sum is of the rotated rows, so the shift
# rounds differently (same value to ~1e-7 of its largest entry) and the codes may differ. On the H100
# K's statistics at 2 x 8k tokens took 72.9 us as xH, 46.7 transposed on 2 stages (54.8 on one:
# 2 stages fit 128 registers, 4 programs per SM), the forward's K/V statistics 89.8 -> 70.6 us
# (benchmarks/NOTES.md, "Quantization").
TRANSPOSED_ROTATION = True
# ``tma_stages``: the pipeline's stages where the slices come by TMA (TMA_LOADS), whose slices in
# flight take shared memory but no registers (absent: ``stages``).
TRANSPOSED_PARTIALS = {"sub": 32, "num_warps": 4, "stages": 2, "maxnreg": None, "tma_stages": 3}
PARTIALS_WARPS = 4
FINISH_WARPS = 4
# Head dim 256 (the values above serve padded head dims up to 128): slices of half the tokens (as
# many elements per thread as at 128); the rotating launch on 4 warps (its Hadamard matrix, 128 KB
# in bf16, sits in shared memory: 32-token slices on 2 warps spilled). The finishing launch keeps
# FINISH_WARPS: it forms μH a slice of MEAN_COLS at a time (32 registers at either head dim,
# benchmarks/results/cpu_kernel_resources_fold_stats.txt).
SUB_CHUNK_D256 = 16
ROTATED_PARTIALS_D256 = {"sub": 16, "num_warps": 4, "elementwise": False, "stages": None,
                         "maxnreg": None}  # not measured
# Output channels per step of the rotated mean μH (:func:`_rotated_mean`): a (DP, 16) slice of the
# matrix in registers instead of all of it (the whole fp32 matrix took 256 registers per thread at
# head dim 256 on 4 warps), so the fold fits the partials launch's registers.
MEAN_COLS = 16
# The fold in the partials launch (module docstring); off: the separate finishing launch. Same GPU
# time within ±1%, one Triton launch fewer per pair (benchmarks/NOTES.md, "Host time").
FOLD_IN_PARTIALS = True
# Chunks whose partials a fold loads at a time (issued together, then added in order: the same sums
# and bits as one chunk at a time, where each of a sequence's 32 chunks at 8k tokens waited for its
# loads from L2 before the next was asked for). On the H100 the preparation of one fp8_delta fwd+bwd
# at 2 x 8k tokens 559.4 -> 555.1 us; all 32 at once 570.8 (benchmarks/NOTES.md, "Quantization").
FOLD_LOADS = 8
# The partials launch's slices by TMA (:func:`tma_descriptors`) where the tensors allow it; off: by
# pointer. The same values either way. As compiled at 2 stages the pointer loop holds one slice
# buffer: a program has one 8 KB slice in flight and none while it computes; by TMA its stages cost
# shared memory only (offline, sm_90a: 3 stages at 106 registers and 49 KB, 4 programs per SM).
# Same bits on the H100; the forward's K/V statistics at 2 x 8k tokens 76.1 -> 63.9 us, the
# preparation of one fp8_delta fwd+bwd 555.2 -> 540.4 us (benchmarks/NOTES.md, "Quantization").
TMA_LOADS = True
# The pipeline's stages of a launch that rotates no rows, with TMA loads (by pointer it runs the plain
# loop, one slice at a time: 54 registers and 2 KB; by TMA at 3 stages two 8 KB buffers).
PLAIN_TMA_STAGES = 3


@triton.jit
def _partials_tile(x_base, sxs, sxd, h_ptr, out, start, length, chunk, D,
                   CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_D: tl.constexpr, ROTATE: tl.constexpr,
                   EXT: tl.constexpr, SHIFTED: tl.constexpr, SUM: tl.constexpr, AMAX: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, ELEMENTWISE: tl.constexpr, STAGES: tl.constexpr,
                   TRANSPOSED: tl.constexpr, x_desc=None, row=0, h=0, TMA: tl.constexpr = False,
                   IS_VARLEN: tl.constexpr = False):
    """One chunk of one operand's (sequence, head) into ``out`` (4, BLOCK_D): ``hi``, ``lo``, the
    amax (AMAX) and the sum (SUM) of the raw rows. EXT (the row amax is wanted) of y = xH (ROTATE)
    or x: SHIFTED (a shift will be subtracted), hi / lo = max / min of y; else hi = max |y| and
    lo = −hi, which :func:`_finish_write` turns into the same row amax from one accumulator.

    Without rotation the loop keeps element-wise (SUB, BLOCK_D) accumulators and reduces over
    tokens once at the end: a reduction across warps per 32-token slice made the launch 4x slower
    than the quantization kernel's read of the same tensor (benchmarks/NOTES.md, "Recipe v2").
    With rotation each slice's dot output sits in the MMA layout and is reduced at once.
    TRANSPOSED (with ROTATE): each slice rotated as Hᵀxᵀ, channels along the dot's M axis, so the
    reductions over tokens stay inside a warp; the sum is then of the rotated rows (the fold takes
    its mean as the shift as it is) and the raw amax element-wise, reduced once after the loop.

    TMA: the slices come by the tensor-memory accelerator through ``x_desc`` ((B, H, S, D), blocks
    of (1, 1, SUB, BLOCK_D), zeros past the tensor's ends) at (batch row ``row``, head ``h``) instead
    of by pointer loads: the same values (tokens of the next packed sequence are zeroed here), with
    the pipeline's slices in flight in shared memory instead of registers."""
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    if ROTATE and TRANSPOSED:
        hm = load_hadamard(h_ptr, BLOCK_D, True)
        hi = tl.full([BLOCK_D], float("-inf"), tl.float32)
        lo = tl.full([BLOCK_D], float("inf"), tl.float32)
        amax = tl.zeros([SUB, BLOCK_D], tl.float32)
        total = tl.zeros([BLOCK_D], tl.float32)
    elif ROTATE and not ELEMENTWISE:
        hm = load_hadamard(h_ptr, BLOCK_D)
        hi = tl.full([BLOCK_D], float("-inf"), tl.float32)
        lo = tl.full([BLOCK_D], float("inf"), tl.float32)
        amax = tl.zeros([BLOCK_D], tl.float32)
        total = tl.zeros([BLOCK_D], tl.float32)
    elif ROTATE:  # element-wise extremes, reduced once after the loop; the sum as above (same bits)
        hm = load_hadamard(h_ptr, BLOCK_D)
        hi = tl.full([SUB, BLOCK_D], float("-inf"), tl.float32)
        lo = tl.full([SUB, BLOCK_D], float("inf"), tl.float32)
        amax = tl.zeros([SUB, BLOCK_D], tl.float32)
        total = tl.zeros([BLOCK_D], tl.float32)
    else:
        hi = tl.full([SUB, BLOCK_D], float("-inf"), tl.float32)
        lo = tl.full([SUB, BLOCK_D], float("inf"), tl.float32)
        amax = tl.zeros([SUB, BLOCK_D], tl.float32)
        total = tl.zeros([SUB, BLOCK_D], tl.float32)
    for c in tl.range(0, CHUNK, SUB, num_stages=STAGES):  # None: the plain loop
        offs_s = chunk * CHUNK + c + tl.arange(0, SUB)
        s_ok = offs_s < length
        if TMA:
            x = x_desc.load([row, h, start + chunk * CHUNK + c, 0]).reshape(SUB, BLOCK_D).to(tl.float32)
            if IS_VARLEN:
                x = tl.where(s_ok[:, None], x, 0.0)
        else:
            ptrs = x_base + (start + offs_s)[:, None].to(tl.int64) * sxs + offs_d[None, :] * sxd
            x = tl.load(ptrs, mask=s_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if ROTATE and TRANSPOSED:
            if AMAX:
                amax = max_nan(amax, tl.abs(x))
            yt = rotate_rows(x, hm, DOT_DTYPE, x_base.dtype.element_ty, True)  # (BLOCK_D, SUB)
            if SUM:  # rows past the sequence are zeros
                total += tl.sum(yt, 1)
            if EXT and SHIFTED:
                hi = max_nan(hi, reduce_max_nan(tl.where(s_ok[None, :], yt, float("-inf")), 1))
                lo = min_nan(lo, reduce_min_nan(tl.where(s_ok[None, :], yt, float("inf")), 1))
            elif EXT:
                hi = max_nan(hi, abs_max(yt, 1))
        elif ROTATE and ELEMENTWISE:
            if AMAX:
                amax = max_nan(amax, tl.abs(x))
            if SUM:
                total += tl.sum(x, 0)
            if EXT:
                y = rotate_rows(x, hm, DOT_DTYPE, x_base.dtype.element_ty)
                if SHIFTED:
                    hi = max_nan(hi, tl.where(s_ok[:, None], y, float("-inf")))
                    lo = min_nan(lo, tl.where(s_ok[:, None], y, float("inf")))
                else:
                    hi = max_nan(hi, tl.abs(y))
        elif ROTATE:
            if AMAX:
                amax = max_nan(amax, abs_max(x, 0))
            if SUM:
                total += tl.sum(x, 0)
            if EXT:
                y = rotate_rows(x, hm, DOT_DTYPE, x_base.dtype.element_ty)
                if SHIFTED:
                    hi = max_nan(hi, reduce_max_nan(tl.where(s_ok[:, None], y, float("-inf")), 0))
                    lo = min_nan(lo, reduce_min_nan(tl.where(s_ok[:, None], y, float("inf")), 0))
                else:  # rows past the sequence are zeros: they never raise an amax
                    hi = max_nan(hi, abs_max(y, 0))
        else:
            if AMAX or EXT:
                amax = max_nan(amax, tl.abs(x))
            if SUM:
                total += x
            if EXT and SHIFTED:  # hi and lo of y
                hi = max_nan(hi, tl.where(s_ok[:, None], x, float("-inf")))
                lo = min_nan(lo, tl.where(s_ok[:, None], x, float("inf")))
    if ROTATE and TRANSPOSED:
        amax = reduce_max_nan(amax, 0)
    elif ROTATE and ELEMENTWISE:
        amax = reduce_max_nan(amax, 0)
        hi = reduce_max_nan(hi, 0)
        if EXT and SHIFTED:
            lo = reduce_min_nan(lo, 0)
    if not ROTATE:
        amax = reduce_max_nan(amax, 0)
        total = tl.sum(total, 0)
        if EXT and SHIFTED:
            hi = reduce_max_nan(hi, 0)
            lo = reduce_min_nan(lo, 0)
        else:
            hi = amax
    if not (EXT and SHIFTED):
        lo = -hi
    tl.store(out + offs_d, hi)
    tl.store(out + BLOCK_D + offs_d, lo)
    tl.store(out + 2 * BLOCK_D + offs_d, amax)
    tl.store(out + 3 * BLOCK_D + offs_d, total)


@triton.jit
def _partials_kernel(
    x_ptr, sxb, sxh, sxs, sxd, y_ptr, syb, syh, sys_, syd, z_ptr, szb, szh, szs, szd, h_ptr,
    part_ptr,  # per operand (n_slots, N_BATCH · its heads, 4, BLOCK_D) fp32, back to back
    cu_ptr, chunk_off_ptr, HX, HY, HZ, S, D, N_BATCH, N_SEQ, N_SLOTS,
    count_ptr, x_out_ptr, y_out_ptr, z_out_ptr,  # FOLD: counters, N_SEQ · (HX + HY + HZ) int32 zeros; outputs
    CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_DTYPE: tl.constexpr, ELEMENTWISE: tl.constexpr, STAGES: tl.constexpr, TRANSPOSED: tl.constexpr,
    X_ROTATE: tl.constexpr, X_EXT: tl.constexpr, X_SUM: tl.constexpr, X_AMAX: tl.constexpr,
    Y_ROTATE: tl.constexpr, Y_EXT: tl.constexpr, Y_SUM: tl.constexpr, Y_AMAX: tl.constexpr,
    Z_ROTATE: tl.constexpr, Z_EXT: tl.constexpr, Z_SUM: tl.constexpr, Z_AMAX: tl.constexpr,
    FOLD: tl.constexpr, X_MEAN_ROTATE: tl.constexpr, Y_MEAN_ROTATE: tl.constexpr, Z_MEAN_ROTATE: tl.constexpr,
    MEAN_COLS: tl.constexpr, FOLD_LOADS: tl.constexpr, Z_OP: tl.constexpr,
    x_desc=None, y_desc=None, z_desc=None, TMA: tl.constexpr = False,
):
    """One program per (chunk of CHUNK tokens of one sequence, sequence·head row, operand X, Y or Z):
    see :func:`chunk_partials`."""
    chunk_partials(x_ptr, sxb, sxh, sxs, sxd, y_ptr, syb, syh, sys_, syd, z_ptr, szb, szh, szs, szd, h_ptr, part_ptr,
                   cu_ptr, chunk_off_ptr, tl.program_id(0), tl.program_id(1), tl.program_id(2), HX, HY, HZ, S, D,
                   N_BATCH, N_SEQ, N_SLOTS, count_ptr, x_out_ptr, y_out_ptr, z_out_ptr, CHUNK, SUB, BLOCK_D, IS_VARLEN,
                   DOT_DTYPE, ELEMENTWISE, STAGES, TRANSPOSED, X_ROTATE, X_EXT, X_SUM, X_AMAX, Y_ROTATE, Y_EXT, Y_SUM,
                   Y_AMAX, Z_ROTATE, Z_EXT, Z_SUM, Z_AMAX, FOLD, X_MEAN_ROTATE, Y_MEAN_ROTATE, Z_MEAN_ROTATE,
                   MEAN_COLS, FOLD_LOADS, False, Z_OP, x_desc, y_desc, z_desc, TMA)


@triton.jit
def operand_heads(op, HX, HY, HZ):
    """``(heads, before)`` of operand ``op`` (0, 1, 2: X, Y, Z): its head count, and the head counts
    of the operands before it summed (where its partials, counters and rows start)."""
    heads = tl.where(op == 0, HX, tl.where(op == 1, HY, HZ))
    before = tl.where(op > 0, HX, 0) + tl.where(op > 1, HY, 0)
    return heads, before


@triton.jit
def partials_row(slot, bb, h, heads, before, N_BATCH, N_SLOTS):
    """The row (int64; 4 · BLOCK_D fp32 each) of the partials of (slot ``slot``, batch row ``bb``,
    head ``h`` of ``heads``) of the operand whose rows follow those of the ``before`` heads ahead of
    it: per operand (n_slots, N_BATCH · its heads), back to back."""
    return ((N_SLOTS * N_BATCH * before).to(tl.int64) + slot.to(tl.int64) * (N_BATCH * heads)
            + bb.to(tl.int64) * heads + h)


@triton.jit
def stats_counter(count_ptr, bh, before, N_SEQ):
    """The fold's counter of (sequence·head ``bh``) of the operand after the ``before`` heads ahead of
    it: per operand N_SEQ · its heads, back to back."""
    return count_ptr + N_SEQ * before + bh


@triton.jit
def chunk_partials(
    x_ptr, sxb, sxh, sxs, sxd, y_ptr, syb, syh, sys_, syd, z_ptr, szb, szh, szs, szd, h_ptr, part_ptr, cu_ptr,
    chunk_off_ptr, chunk, bh, op, HX, HY, HZ, S, D, N_BATCH, N_SEQ, N_SLOTS, count_ptr, x_out_ptr, y_out_ptr,
    z_out_ptr,
    CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_DTYPE: tl.constexpr, ELEMENTWISE: tl.constexpr, STAGES: tl.constexpr, TRANSPOSED: tl.constexpr,
    X_ROTATE: tl.constexpr, X_EXT: tl.constexpr, X_SUM: tl.constexpr, X_AMAX: tl.constexpr,
    Y_ROTATE: tl.constexpr, Y_EXT: tl.constexpr, Y_SUM: tl.constexpr, Y_AMAX: tl.constexpr,
    Z_ROTATE: tl.constexpr, Z_EXT: tl.constexpr, Z_SUM: tl.constexpr, Z_AMAX: tl.constexpr,
    FOLD: tl.constexpr, X_MEAN_ROTATE: tl.constexpr, Y_MEAN_ROTATE: tl.constexpr, Z_MEAN_ROTATE: tl.constexpr,
    MEAN_COLS: tl.constexpr, FOLD_LOADS: tl.constexpr, PUBLISH: tl.constexpr, Z_OP: tl.constexpr,
    x_desc=None, y_desc=None, z_desc=None, TMA: tl.constexpr = False,
):
    # (SUM is also "a shift will be subtracted": the shift is the mean, see _finish_write.)
    """The partials of chunk ``chunk`` of (sequence·head ``bh``, operand ``op``: X, Y or, Z_OP, Z).
    Each operand has its own head count (HX, HY, HZ; the grid's rows span the largest, and a program
    past its operand's rows does nothing). FOLD: the program that completes a sequence's chunks also
    folds them (module docstring); the MEAN flags are :func:`_finish_kernel`'s ROTATE and its COLS.
    PUBLISH (with FOLD): after its fold that program counts once more, so the counter reads
    ``cdiv(length, CHUNK) + 1`` once the statistics are written (:func:`wait_for_statistics`); without
    it that program sets the counter back to zero, so that the counters leave a launch as they came
    (:func:`fold_counters`). TMA:
    the slices through ``x_desc`` / ``y_desc`` / ``z_desc`` (:func:`_partials_tile`). Returns the
    sequence's length (0 past the operand's rows)."""
    heads, before = operand_heads(op, HX, HY, HZ)
    active = bh < N_SEQ * heads
    b = tl.minimum(bh // heads, N_SEQ - 1)  # (in range for the loads of a program past the rows)
    h = bh % heads
    start, length, slot, bb = block_of_sequence(b, chunk, cu_ptr, chunk_off_ptr, S, IS_VARLEN)
    length = tl.where(active, length, 0)
    if chunk * CHUNK < length:
        row = bb.to(tl.int64)
        out = part_ptr + partials_row(slot, bb, h, heads, before, N_BATCH, N_SLOTS) * 4 * BLOCK_D
        if op == 0:
            _partials_tile(x_ptr + row * sxb + h * sxh, sxs, sxd, h_ptr, out, start, length, chunk, D, CHUNK, SUB,
                           BLOCK_D, X_ROTATE, X_EXT, X_SUM, X_SUM, X_AMAX, DOT_DTYPE, ELEMENTWISE, STAGES,
                           TRANSPOSED, x_desc, bb, h, TMA, IS_VARLEN)
        elif Z_OP and op == 2:
            _partials_tile(z_ptr + row * szb + h * szh, szs, szd, h_ptr, out, start, length, chunk, D, CHUNK, SUB,
                           BLOCK_D, Z_ROTATE, Z_EXT, Z_SUM, Z_SUM, Z_AMAX, DOT_DTYPE, ELEMENTWISE, STAGES,
                           TRANSPOSED, z_desc, bb, h, TMA, IS_VARLEN)
        else:
            _partials_tile(y_ptr + row * syb + h * syh, sys_, syd, h_ptr, out, start, length, chunk, D, CHUNK, SUB,
                           BLOCK_D, Y_ROTATE, Y_EXT, Y_SUM, Y_SUM, Y_AMAX, DOT_DTYPE, ELEMENTWISE, STAGES,
                           TRANSPOSED, y_desc, bb, h, TMA, IS_VARLEN)
        if FOLD:
            # Every thread's partial stored before one thread counts the chunk done; the counter's
            # acquire-release (GPU scope) makes all of a sequence's partials visible to the program that
            # counts last, which folds them.
            tl.debug_barrier()
            counter = stats_counter(count_ptr, bh, before, N_SEQ)
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == tl.cdiv(length, CHUNK) - 1:
                _fold_sequence(part_ptr, h_ptr, x_out_ptr, y_out_ptr, z_out_ptr, op, b, h, length, slot - chunk, row,
                               heads, before, N_BATCH, N_SEQ, N_SLOTS, CHUNK, BLOCK_D, X_MEAN_ROTATE, X_SUM,
                               Y_MEAN_ROTATE, Y_SUM, Z_MEAN_ROTATE, Z_SUM, MEAN_COLS, FOLD_LOADS, Z_OP)
                if PUBLISH:  # every thread's statistics stored, then released
                    tl.debug_barrier()
                    tl.atomic_add(counter, 1, sem="release", scope="gpu")
                else:  # every chunk counted: back to zero for the next launch (fold_counters' kept buffer)
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    elif FOLD:
        if (chunk == 0) & active:  # an empty sequence: no chunk to wait for, its statistics are zeros
            _fold_sequence(part_ptr, h_ptr, x_out_ptr, y_out_ptr, z_out_ptr, op, b, h, length, slot, bb, heads, before,
                           N_BATCH, N_SEQ, N_SLOTS, CHUNK, BLOCK_D, X_MEAN_ROTATE, X_SUM, Y_MEAN_ROTATE, Y_SUM,
                           Z_MEAN_ROTATE, Z_SUM, MEAN_COLS, FOLD_LOADS, Z_OP)
    return length


@triton.jit
def wait_for_statistics(count_ptr, op, bh, length, HX, HY, HZ, N_SEQ, CHUNK: tl.constexpr):
    """Spin until the fold of (operand ``op`` of head counts HX, HY, HZ, sequence·head ``bh``) has
    published its statistics (:func:`chunk_partials` with PUBLISH). The acquire (GPU scope) orders
    the statistics' loads that follow after the folding program's stores."""
    ready = tl.cdiv(length, CHUNK) + 1
    counter = stats_counter(count_ptr, bh, operand_heads(op, HX, HY, HZ)[1], N_SEQ)
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen < ready:
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")


@triton.jit
def _finish_kernel(
    part_ptr, h_ptr, x_out_ptr, y_out_ptr, z_out_ptr,  # out per operand: shift (its N_SH, BLOCK_D), col_amax, row_amax
    cu_ptr, chunk_off_ptr, HX, HY, HZ, S, N_BATCH, N_SEQ, N_SLOTS,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr,
    X_ROTATE: tl.constexpr, X_SMOOTH: tl.constexpr, Y_ROTATE: tl.constexpr, Y_SMOOTH: tl.constexpr,
    Z_ROTATE: tl.constexpr, Z_SMOOTH: tl.constexpr, MEAN_COLS: tl.constexpr, FOLD_LOADS: tl.constexpr,
    Z_OP: tl.constexpr,
):
    """One program per (sequence, head, operand), the heads spanning the largest operand's: fold the
    sequence's chunks in order and write its statistics (module docstring). An empty sequence gets
    zeros."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    op = tl.program_id(2)
    heads, before = operand_heads(op, HX, HY, HZ)
    if h < heads:
        _, length, slot0, bb = block_of_sequence(seq, 0, cu_ptr, chunk_off_ptr, S, IS_VARLEN)
        _fold_sequence(part_ptr, h_ptr, x_out_ptr, y_out_ptr, z_out_ptr, op, seq, h, length, slot0, bb, heads,
                       before, N_BATCH, N_SEQ, N_SLOTS, CHUNK, BLOCK_D, X_ROTATE, X_SMOOTH, Y_ROTATE, Y_SMOOTH,
                       Z_ROTATE, Z_SMOOTH, MEAN_COLS, FOLD_LOADS, Z_OP)


@triton.jit
def _fold_sequence(part_ptr, h_ptr, x_out_ptr, y_out_ptr, z_out_ptr, op, seq, h, length, slot0, bb, heads, before,
                   N_BATCH, N_SEQ, N_SLOTS, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, X_ROTATE: tl.constexpr,
                   X_SMOOTH: tl.constexpr, Y_ROTATE: tl.constexpr, Y_SMOOTH: tl.constexpr, Z_ROTATE: tl.constexpr,
                   Z_SMOOTH: tl.constexpr, MEAN_COLS: tl.constexpr, FOLD_LOADS: tl.constexpr, Z_OP: tl.constexpr):
    """Fold the partials of (sequence ``seq``, head ``h`` of ``heads``, operand ``op``, whose partials
    start after the ``before`` heads of the operands ahead of it), chunks in order from slot
    ``slot0`` of batch row ``bb``, FOLD_LOADS chunks' loads at a time, and write its statistics.
    Loads bypass L1 (``.cg``): in the partials launch other programs wrote them. A chunk past the
    sequence adds the reductions' identities: the sum is never −0 (it starts at +0), so adding +0
    leaves its bits as they are."""
    offs_d = tl.arange(0, BLOCK_D)
    hi = tl.full([BLOCK_D], float("-inf"), tl.float32)
    lo = tl.full([BLOCK_D], float("inf"), tl.float32)
    amax = tl.zeros([BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_D], tl.float32)
    n_chunks = tl.cdiv(length, CHUNK)
    for c0 in range(0, n_chunks, FOLD_LOADS):
        for i in tl.static_range(FOLD_LOADS):  # chunks past the sequence load the reductions' identities
            c = c0 + i
            ok = c * BLOCK_D + offs_d < n_chunks * BLOCK_D  # c < n_chunks as a vector (as the interpreter needs)
            base = part_ptr + partials_row(slot0 + c, bb, h, heads, before, N_BATCH, N_SLOTS) * 4 * BLOCK_D + offs_d
            hi = max_nan(hi, tl.load(base, mask=ok, other=float("-inf"), cache_modifier=".cg"))
            lo = min_nan(lo, tl.load(base + BLOCK_D, mask=ok, other=float("inf"), cache_modifier=".cg"))
            amax = max_nan(amax, tl.load(base + 2 * BLOCK_D, mask=ok, other=0.0, cache_modifier=".cg"))
            total += tl.load(base + 3 * BLOCK_D, mask=ok, other=0.0, cache_modifier=".cg")
    sh = (seq * heads + h).to(tl.int64)
    n_sh = N_SEQ * heads
    if op == 0:
        _finish_write(hi, lo, amax, total, length, h_ptr, x_out_ptr, sh, n_sh, BLOCK_D, X_ROTATE, X_SMOOTH, MEAN_COLS)
    elif Z_OP and op == 2:
        _finish_write(hi, lo, amax, total, length, h_ptr, z_out_ptr, sh, n_sh, BLOCK_D, Z_ROTATE, Z_SMOOTH, MEAN_COLS)
    else:
        _finish_write(hi, lo, amax, total, length, h_ptr, y_out_ptr, sh, n_sh, BLOCK_D, Y_ROTATE, Y_SMOOTH, MEAN_COLS)


@triton.jit
def _rotated_mean(mean, h_ptr, out, BLOCK_D: tl.constexpr, COLS: tl.constexpr):
    """μH ``(BLOCK_D,)`` fp32 of ``mean (BLOCK_D,)``, as broadcast sums over COLS output channels at a
    time (a (BLOCK_D, COLS) slice of the matrix in registers), each slice stored to ``out`` and the
    whole vector read back (after a barrier: other threads wrote parts of it)."""
    offs_d = tl.arange(0, BLOCK_D)
    for c in tl.static_range(0, BLOCK_D, COLS):
        cols = c + tl.arange(0, COLS)
        hm = tl.load(h_ptr + offs_d[:, None] * BLOCK_D + cols[None, :]).to(tl.float32)
        tl.store(out + cols, tl.sum(mean[:, None] * hm, 0))
    tl.debug_barrier()
    return tl.load(out + offs_d)


@triton.jit
def _finish_write(hi, lo, amax, total, length, h_ptr, out, sh, N_SH, BLOCK_D: tl.constexpr, ROTATE: tl.constexpr,
                  SMOOTH: tl.constexpr, MEAN_COLS: tl.constexpr):
    """One operand's shift, col_amax and row_amax of (sequence, head) ``sh`` from its folded vectors."""
    offs_d = tl.arange(0, BLOCK_D)
    shift = tl.zeros([BLOCK_D], tl.float32)
    if SMOOTH:
        mean = total / tl.maximum(length, 1).to(tl.float32)
        if ROTATE:
            shift = _rotated_mean(mean, h_ptr, out + sh * BLOCK_D, BLOCK_D, MEAN_COLS)
        else:
            shift = mean
    ext = max_nan(hi - shift, shift - lo)
    row_amax = tl.where(length > 0, reduce_max_nan(ext, 0), 0.0)
    tl.store(out + sh * BLOCK_D + offs_d, shift)
    tl.store(out + (N_SH + sh) * BLOCK_D + offs_d, amax)
    tl.store(out + 2 * N_SH * BLOCK_D + sh, row_amax)


class StatsNeed(NamedTuple):
    """Which statistics of one operand a recipe needs: ``rotate`` / ``smooth``, the row-wise copy's
    transforms; ``row_amax`` (per-(sequence, head) row scale) and ``col_amax`` (sequence-wide
    channel scales)."""

    rotate: bool = False
    smooth: bool = False
    row_amax: bool = False
    col_amax: bool = False


class SequenceStats(NamedTuple):
    """Statistics of one operand, per (sequence, head): see the module docstring."""

    shift: torch.Tensor  # (n_seq, H, DP) fp32
    row_amax: torch.Tensor  # (n_seq, H) fp32
    col_amax: torch.Tensor  # (n_seq, H, DP) fp32


class StatsLaunch(NamedTuple):
    """A partials launch over one to three operands, as :func:`stats_launch` sets it up: ``args``,
    the partials kernel's arguments before its counters, ``outs`` those after them (one output
    buffer per operand X, Y, Z); ``meta`` its constexprs (FOLD aside) and launch options;
    ``results`` the views its fold writes; ``grid`` (chunks per sequence·head row, rows of the
    operand with the most heads, operands); ``counters``, how many counters the fold needs (one per
    operand, sequence and head); ``finish_args``, :func:`_finish_kernel`'s arguments before its
    constexprs; ``tma_stages``, the pipeline's stages with TMA loads."""

    args: tuple
    outs: tuple
    meta: dict
    results: tuple[SequenceStats, ...]
    grid: tuple[int, int, int]
    counters: int
    max_len: int
    finish_args: tuple
    tma_stages: int | None = None


def check_stats_operands(xs: tuple[torch.Tensor, ...], needs: tuple) -> None:
    """One statistics launch takes one to three tensors ``(B, H, S, D)`` that share B, S, D and dtype
    (their head counts may differ: Q beside K and V), one :class:`StatsNeed` each; raise a
    ValueError naming what differs otherwise."""
    if not 1 <= len(xs) <= 3 or len(needs) != len(xs):
        raise ValueError(f"sequence_stats: one to three tensors, one StatsNeed each; got {len(xs)} and {len(needs)}")
    b, _, s, d = xs[0].shape
    for x in xs[1:]:
        if (x.shape[0], x.shape[2], x.shape[3]) != (b, s, d) or x.dtype != xs[0].dtype:
            raise ValueError(f"sequence_stats: tensors of one launch must share batch, length, head dim and dtype, got "
                             f"{tuple(xs[0].shape)} {xs[0].dtype} and {tuple(x.shape)} {x.dtype}")


def _stats_views(out: torch.Tensor, n_seq: int, heads: int, dp: int) -> SequenceStats:
    """The :class:`SequenceStats` views of one operand's output buffer (1-D, contiguous), which holds
    shift, col_amax and row_amax back to back. (``as_strided`` of the buffer: one operator a view
    instead of a split and three views, 7 against 14 µs an operand on a 2-core CPU.)"""
    n_sh = n_seq * heads
    vec = ((n_seq, heads, dp), (heads * dp, dp, 1))
    return SequenceStats(out.as_strided(*vec, 0), out.as_strided((n_seq, heads), (heads, 1), 2 * n_sh * dp),
                         out.as_strided(*vec, n_sh * dp))


def _three(items, filler) -> tuple:
    """``items`` (one per operand: X, then Y, then Z) filled up to three with ``filler``, for the
    kernels' fixed X / Y / Z parameters; a filler operand is never read."""
    return (*items, *(filler,) * (3 - len(items)))


def stats_launch(
    xs: tuple[torch.Tensor, ...],
    needs: tuple[StatsNeed, ...],
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> StatsLaunch:
    """The partials launch of :func:`sequence_stats` for ``xs`` and ``needs`` (see there), its
    buffers allocated (one partials buffer; per operand one output buffer, its three statistics
    back to back)."""
    check_stats_operands(xs, needs)
    x = xs[0]
    bsz, _, seq, d = x.shape
    heads = [t.shape[1] for t in xs]
    dp = padded_head_dim(d)
    varlen = cu_seqlens is not None
    dev = x.device
    if varlen:
        n_seq = cu_seqlens.numel() - 1
        chunk_off = sequence_block_offsets(cu_seqlens, CHUNK)
        n_slots = seq // CHUNK + n_seq
        if max_seqlen is not None:
            max_len = int(max_seqlen)
        else:  # a device sync
            max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if n_seq else 0
    else:
        n_seq, chunk_off, n_slots, max_len = bsz, x, cdiv(max(seq, 1), CHUNK), seq
    n_slots = max(n_slots, 1)
    rotated_rows = any(n.rotate and n.row_amax for n in needs)  # the first launch rotates rows
    h = rotation_operand(x) if any(n.rotate for n in needs) else x
    part = torch.empty(n_slots * bsz * sum(heads) * 4 * dp, dtype=torch.float32, device=dev)
    # One buffer per operand: shift, col_amax, row_amax back to back (contiguous views).
    alloc = scratch_empty()
    outs = [alloc((n_seq * hx * (2 * dp + 1),), dtype=torch.float32, device=dev) for hx in heads]
    results = tuple(_stats_views(o, n_seq, hx, dp) for o, hx in zip(outs, heads))
    cu = cu_seqlens if varlen else x
    padded, padded_needs, padded_heads = _three(xs, x), _three(needs, StatsNeed()), _three(heads, heads[0])
    flags = {}
    for prefix, n in zip(("X", "Y", "Z"), padded_needs):
        ext = n.row_amax
        flags.update({f"{prefix}_ROTATE": n.rotate and ext, f"{prefix}_EXT": ext, f"{prefix}_SUM": n.smooth,
                      f"{prefix}_AMAX": n.col_amax})
    wide = dp > 128
    transposed = rotated_rows and TRANSPOSED_ROTATION and not wide
    rotated_launch = TRANSPOSED_PARTIALS if transposed else ROTATED_PARTIALS_D256 if wide else ROTATED_PARTIALS
    # Element-wise extremes in a rotating launch (one reduction per chunk instead of one per slice)
    # where no operand is smoothed: a shifted operand's three (SUB, DP) accumulators spill on 2 warps
    # at 32-token slices (the table's ``elementwise_smoothed`` takes them anyway).
    elementwise = rotated_rows and rotated_launch.get("elementwise", False) and (
        rotated_launch.get("elementwise_smoothed", False) or not any(n.smooth for n in needs))
    # Rotated partials as Hᵀxᵀ sum the rotated rows: the fold then takes their mean as the shift as it is.
    mean_rotate = {f"{p}_MEAN_ROTATE": n.rotate and not (transposed and flags[f"{p}_ROTATE"])
                   for p, n in zip(("X", "Y", "Z"), padded_needs)}
    if rotated_rows:
        sub, warps = rotated_launch["sub"], rotated_launch["num_warps"]
        stages, maxnreg = rotated_launch.get("stages"), rotated_launch.get("maxnreg")
        tma_stages = rotated_launch.get("tma_stages", stages)
    else:
        sub, warps = (SUB_CHUNK_D256 if wide else SUB_CHUNK), PARTIALS_WARPS
        stages = maxnreg = None
        tma_stages = PLAIN_TMA_STAGES
    meta = dict(CHUNK=CHUNK, SUB=sub, BLOCK_D=dp, IS_VARLEN=varlen, DOT_DTYPE=dot_dtype(x), ELEMENTWISE=elementwise,
                STAGES=stages, TRANSPOSED=transposed, **flags, **mean_rotate, MEAN_COLS=MEAN_COLS,
                FOLD_LOADS=FOLD_LOADS, Z_OP=len(xs) == 3, num_warps=warps, maxnreg=maxnreg, **COMPILE_OPTIONS)
    strided = tuple(a for t in padded for a in (t, *t.stride()))
    sizes = (*padded_heads, seq, d, bsz, n_seq, n_slots)
    args = (*strided, h, part, cu, chunk_off, *sizes)
    padded_outs = _three(outs, outs[0])
    # Folding, every sequence needs its chunk 0 program (an empty one writes its zeros there).
    grid = (max(cdiv(max_len, CHUNK), 1), n_seq * max(heads), len(xs))
    finish_args = (part, h, *padded_outs, cu, chunk_off, *padded_heads, seq, bsz, n_seq, n_slots)
    return StatsLaunch(args, padded_outs, meta, results, grid, n_seq * sum(heads), max_len, finish_args,
                       tma_stages)


def tma_descriptors(xs: tuple[torch.Tensor, ...], sub: int, dp: int) -> tuple | None:
    """Per tensor of ``xs`` (``(B, H, S, D)``) a TMA descriptor of (1, 1, ``sub``, ``dp``) blocks for
    the partials launch, or None where :data:`TMA_LOADS` is off or a tensor does not allow one (not
    on a CUDA GPU of compute capability 9 or later, no tokens, or strides or address not 16-byte
    aligned); the launch then loads by pointer, the same values."""
    if not TMA_LOADS or interpreting() or dp > 256:
        return None
    for x in xs:
        if not on_cuda(x.device) or x.numel() == 0 or x.stride(-1) != 1 or x.data_ptr() % 16:
            return None
        if any(st * x.element_size() % 16 for st in x.stride()[:-1]) or not has_tma(x.device.index):
            return None
    return tuple(TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, sub, dp]) for x in xs)


# The fold's counters kept between launches (fold_counters): no zeroing launch per statistics launch
# (torch.zeros: 49-61 µs of host time under torch.profiler on the H100's host; benchmarks/NOTES.md,
# "Host time"). Off: fresh zeros for each launch.
KEEP_FOLD_COUNTERS = True
# fold_counters' buffers, by (device, stream): int32 zeros between the launches on that stream.
_FOLD_COUNTERS: dict[tuple, torch.Tensor] = {}
try:  # the current stream's handle in one call, as Triton's launches read it
    from torch._C import _cuda_getCurrentRawStream as _current_raw_stream
except ImportError:  # a torch built without CUDA
    _current_raw_stream = None


def fold_counters(n: int, device: torch.device) -> tuple[torch.Tensor, tuple | None]:
    """``(counters, key)``: ``n`` int32 zeros for the fold's counters of one partials launch, and the
    key under which they are kept (None: fresh zeros, kept nowhere; always so with
    :data:`KEEP_FOLD_COUNTERS` off).

    Each folding program sets its counter back to zero (:func:`chunk_partials`), so a launch leaves
    its counters as it found them: one buffer per (device, stream) serves launch after launch
    without a zeroing launch of its own (launches on one stream run in order; two streams never
    share one). Fresh zeros while the current stream is captured into a CUDA graph (a buffer from
    the graph's pool must not outlive it in the eager calls). A launch that raises drops the kept
    buffer (:func:`drop_fold_counters`): it may have left counters counted."""
    cuda = device.type == "cuda"
    if not KEEP_FOLD_COUNTERS or (cuda and torch.cuda.is_current_stream_capturing()):
        return torch.zeros(n, dtype=torch.int32, device=device), None
    if cuda:
        stream = (_current_raw_stream(device.index) if _current_raw_stream is not None
                  else torch.cuda.current_stream(device).cuda_stream)
        key = (device.index, stream)
    else:
        key = (device.type, device.index)
    kept = _FOLD_COUNTERS.get(key)
    if kept is None or kept.numel() < n:
        kept = _FOLD_COUNTERS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return kept[:n], key


def drop_fold_counters(key: tuple | None) -> None:
    """Forget the kept counters of ``key`` (a launch on them raised; the next one starts from zeros)."""
    if key is not None:
        _FOLD_COUNTERS.pop(key, None)


def sequence_stats(
    xs: tuple[torch.Tensor, ...],
    needs: tuple[StatsNeed, ...],
    *,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> tuple[SequenceStats, ...]:
    """:class:`SequenceStats` of one to three tensors ``(B, H, S, D)`` that share B, S, D and dtype
    (any strides, any head counts; varlen: ``B == 1`` and int32 ``cu_seqlens (n_seq + 1,)`` with
    ``max_seqlen`` its longest sequence), one :class:`StatsNeed` each, in one launch for all (two
    with :data:`FOLD_IN_PARTIALS` off). Fields not asked for hold meaningless values."""
    st = stats_launch(xs, needs, cu_seqlens, max_seqlen)
    if st.counters == 0:
        return st.results
    fold = FOLD_IN_PARTIALS
    x = xs[0]
    if fold or st.max_len > 0:
        counts, kept = fold_counters(st.counters, x.device) if fold else (x, None)
        descs = tma_descriptors(xs, st.meta["SUB"], st.meta["BLOCK_D"])
        meta = st.meta if descs is None else {**st.meta, "STAGES": st.tma_stages}
        descs = _three(descs, descs[0]) if descs else (None, None, None)
        try:
            launch_kernel(_partials_kernel, st.grid, *st.args, counts, *st.outs, FOLD=fold, x_desc=descs[0],
                          y_desc=descs[1], z_desc=descs[2], TMA=descs[0] is not None, **meta)
        except BaseException:
            drop_fold_counters(kept)
            raise
    if not fold:
        m, heads = st.meta, max(t.shape[1] for t in xs)
        launch_kernel(
            _finish_kernel, (st.grid[1] // heads, heads, len(xs)), *st.finish_args,
            CHUNK=CHUNK, BLOCK_D=m["BLOCK_D"], IS_VARLEN=m["IS_VARLEN"],
            X_ROTATE=m["X_MEAN_ROTATE"], X_SMOOTH=m["X_SUM"], Y_ROTATE=m["Y_MEAN_ROTATE"], Y_SMOOTH=m["Y_SUM"],
            Z_ROTATE=m["Z_MEAN_ROTATE"], Z_SMOOTH=m["Z_SUM"], MEAN_COLS=MEAN_COLS, FOLD_LOADS=FOLD_LOADS,
            Z_OP=m["Z_OP"], num_warps=FINISH_WARPS, **COMPILE_OPTIONS,
        )
    return st.results
