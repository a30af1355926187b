"""Per-(sequence, head) statistics of one or two attention operands, for the recipe's
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
:func:`_finish_kernel`, folds instead. Two operands of one shape share the launches (grid axis 2),
as in the quantization kernel. Either way the fold's order is fixed, so the statistics,
and so the codes, are the same on every call (the backward re-quantizes Q and K exactly as the
forward did). Statistics nobody asked for are not computed (their vectors hold the reduction's
identity, and the outputs built from them are meaningless).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .quantize import (
    COMPILE_OPTIONS, abs_max, check_operand_pair, dot_dtype, interpreting, load_hadamard, max_nan, min_nan,
    padded_head_dim, reduce_max_nan, reduce_min_nan, rotate_rows, rotation_operand, scratch_empty,
)
from .launch import launch as launch_kernel
from .tiles import block_of_sequence, cdiv, has_tma, sequence_block_offsets

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
    x_ptr, sxb, sxh, sxs, sxd, y_ptr, syb, syh, sys_, syd, h_ptr,
    part_ptr,  # (2, n_slots, B·H, 4, BLOCK_D) fp32
    cu_ptr, chunk_off_ptr, H, S, D, N_BH, N_SLOTS,
    count_ptr, x_out_ptr, y_out_ptr, N_SH,  # FOLD: counters (2, N_SH) int32 zeros; outputs as in _finish_kernel
    CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_DTYPE: tl.constexpr, ELEMENTWISE: tl.constexpr, STAGES: tl.constexpr, TRANSPOSED: tl.constexpr,
    X_ROTATE: tl.constexpr, X_EXT: tl.constexpr, X_SUM: tl.constexpr, X_AMAX: tl.constexpr,
    Y_ROTATE: tl.constexpr, Y_EXT: tl.constexpr, Y_SUM: tl.constexpr, Y_AMAX: tl.constexpr,
    FOLD: tl.constexpr, X_MEAN_ROTATE: tl.constexpr, Y_MEAN_ROTATE: tl.constexpr, MEAN_COLS: tl.constexpr,
    FOLD_LOADS: tl.constexpr, x_desc=None, y_desc=None, TMA: tl.constexpr = False,
):
    """One program per (chunk of CHUNK tokens of one sequence, batch·head, operand X or Y): see
    :func:`chunk_partials`."""
    chunk_partials(x_ptr, sxb, sxh, sxs, sxd, y_ptr, syb, syh, sys_, syd, h_ptr, part_ptr, cu_ptr, chunk_off_ptr,
                   tl.program_id(0), tl.program_id(1), tl.program_id(2), H, S, D, N_BH, N_SLOTS,
                   count_ptr, x_out_ptr, y_out_ptr, N_SH, CHUNK, SUB, BLOCK_D, IS_VARLEN, DOT_DTYPE, ELEMENTWISE,
                   STAGES, TRANSPOSED, X_ROTATE, X_EXT, X_SUM, X_AMAX, Y_ROTATE, Y_EXT, Y_SUM, Y_AMAX, FOLD,
                   X_MEAN_ROTATE, Y_MEAN_ROTATE, MEAN_COLS, FOLD_LOADS, False, x_desc, y_desc, TMA)


@triton.jit
def chunk_partials(
    x_ptr, sxb, sxh, sxs, sxd, y_ptr, syb, syh, sys_, syd, h_ptr, part_ptr, cu_ptr, chunk_off_ptr,
    chunk, bh, op, H, S, D, N_BH, N_SLOTS, count_ptr, x_out_ptr, y_out_ptr, N_SH,
    CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_DTYPE: tl.constexpr, ELEMENTWISE: tl.constexpr, STAGES: tl.constexpr, TRANSPOSED: tl.constexpr,
    X_ROTATE: tl.constexpr, X_EXT: tl.constexpr, X_SUM: tl.constexpr, X_AMAX: tl.constexpr,
    Y_ROTATE: tl.constexpr, Y_EXT: tl.constexpr, Y_SUM: tl.constexpr, Y_AMAX: tl.constexpr,
    FOLD: tl.constexpr, X_MEAN_ROTATE: tl.constexpr, Y_MEAN_ROTATE: tl.constexpr, MEAN_COLS: tl.constexpr,
    FOLD_LOADS: tl.constexpr, PUBLISH: tl.constexpr, x_desc=None, y_desc=None, TMA: tl.constexpr = False,
):
    # (SUM is also "a shift will be subtracted": the shift is the mean, see _finish_write.)
    """The partials of chunk ``chunk`` of (sequence·head ``bh``, operand ``op``: X or Y). FOLD: the
    program that completes a sequence's chunks also folds them (module docstring); the MEAN flags
    are :func:`_finish_kernel`'s ROTATE and its COLS. PUBLISH (with FOLD): after its fold that
    program counts once more, so the counter reads ``cdiv(length, CHUNK) + 1`` once the
    statistics are written (:func:`wait_for_statistics`). TMA: the slices through ``x_desc`` /
    ``y_desc`` (:func:`_partials_tile`). Returns the sequence's length."""
    b = bh // H
    h = bh % H
    start, length, slot, bb = block_of_sequence(b, chunk, cu_ptr, chunk_off_ptr, S, IS_VARLEN)
    if chunk * CHUNK < length:
        row = bb.to(tl.int64)
        out = part_ptr + ((op * N_SLOTS + slot).to(tl.int64) * N_BH + row * H + h) * 4 * BLOCK_D
        if op == 0:
            _partials_tile(x_ptr + row * sxb + h * sxh, sxs, sxd, h_ptr, out, start, length, chunk, D, CHUNK, SUB,
                           BLOCK_D, X_ROTATE, X_EXT, X_SUM, X_SUM, X_AMAX, DOT_DTYPE, ELEMENTWISE, STAGES,
                           TRANSPOSED, x_desc, bb, h, TMA, IS_VARLEN)
        else:
            _partials_tile(y_ptr + row * syb + h * syh, sys_, syd, h_ptr, out, start, length, chunk, D, CHUNK, SUB,
                           BLOCK_D, Y_ROTATE, Y_EXT, Y_SUM, Y_SUM, Y_AMAX, DOT_DTYPE, ELEMENTWISE, STAGES,
                           TRANSPOSED, y_desc, bb, h, TMA, IS_VARLEN)
        if FOLD:
            # Every thread's partial stored before one thread counts the chunk done; the counter's
            # acquire-release (GPU scope) makes all of a sequence's partials visible to the program that
            # counts last, which folds them.
            tl.debug_barrier()
            done = tl.atomic_add(count_ptr + op * N_SH + bh, 1, sem="acq_rel", scope="gpu")
            if done == tl.cdiv(length, CHUNK) - 1:
                _fold_sequence(part_ptr, h_ptr, x_out_ptr, y_out_ptr, op, b, h, length, slot - chunk, row, H, N_BH,
                               N_SLOTS, N_SH, CHUNK, BLOCK_D, X_MEAN_ROTATE, X_SUM, Y_MEAN_ROTATE, Y_SUM, MEAN_COLS,
                               FOLD_LOADS)
                if PUBLISH:  # every thread's statistics stored, then released
                    tl.debug_barrier()
                    tl.atomic_add(count_ptr + op * N_SH + bh, 1, sem="release", scope="gpu")
    elif FOLD:
        if chunk == 0:  # an empty sequence: no chunk to wait for, its statistics are zeros
            _fold_sequence(part_ptr, h_ptr, x_out_ptr, y_out_ptr, op, b, h, length, slot, bb, H, N_BH, N_SLOTS,
                           N_SH, CHUNK, BLOCK_D, X_MEAN_ROTATE, X_SUM, Y_MEAN_ROTATE, Y_SUM, MEAN_COLS, FOLD_LOADS)
    return length


@triton.jit
def wait_for_statistics(count_ptr, op, bh, length, N_SH, CHUNK: tl.constexpr):
    """Spin until the fold of (operand ``op``, sequence·head ``bh``) has published its statistics
    (:func:`chunk_partials` with PUBLISH). The acquire (GPU scope) orders the statistics' loads that
    follow after the folding program's stores."""
    ready = tl.cdiv(length, CHUNK) + 1
    seen = tl.atomic_add(count_ptr + op * N_SH + bh, 0, sem="acquire", scope="gpu")
    while seen < ready:
        seen = tl.atomic_add(count_ptr + op * N_SH + bh, 0, sem="acquire", scope="gpu")


@triton.jit
def _finish_kernel(
    part_ptr, h_ptr, x_out_ptr, y_out_ptr,  # out: shift (N_SH, BLOCK_D), col_amax (N_SH, BLOCK_D), row_amax (N_SH,)
    cu_ptr, chunk_off_ptr, H, S, N_BH, N_SLOTS, N_SH,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr,
    X_ROTATE: tl.constexpr, X_SMOOTH: tl.constexpr, Y_ROTATE: tl.constexpr, Y_SMOOTH: tl.constexpr,
    MEAN_COLS: tl.constexpr, FOLD_LOADS: tl.constexpr,
):
    """One program per (sequence, head, operand): fold the sequence's chunks in order and write its
    statistics (module docstring). An empty sequence gets zeros."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    op = tl.program_id(2)
    _, length, slot0, bb = block_of_sequence(seq, 0, cu_ptr, chunk_off_ptr, S, IS_VARLEN)
    _fold_sequence(part_ptr, h_ptr, x_out_ptr, y_out_ptr, op, seq, h, length, slot0, bb, H, N_BH, N_SLOTS, N_SH,
                   CHUNK, BLOCK_D, X_ROTATE, X_SMOOTH, Y_ROTATE, Y_SMOOTH, MEAN_COLS, FOLD_LOADS)


@triton.jit
def _fold_sequence(part_ptr, h_ptr, x_out_ptr, y_out_ptr, op, seq, h, length, slot0, bb, H, N_BH, N_SLOTS, N_SH,
                   CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, X_ROTATE: tl.constexpr, X_SMOOTH: tl.constexpr,
                   Y_ROTATE: tl.constexpr, Y_SMOOTH: tl.constexpr, MEAN_COLS: tl.constexpr,
                   FOLD_LOADS: tl.constexpr):
    """Fold the partials of (sequence ``seq``, head ``h``, operand ``op``), chunks in order from
    slot ``slot0`` of batch row ``bb``, FOLD_LOADS chunks' loads at a time, and write its
    statistics. Loads bypass L1 (``.cg``): in the partials launch other programs wrote them. A
    chunk past the sequence adds the reductions' identities: the sum is never −0 (it starts at +0),
    so adding +0 leaves its bits as they are."""
    bh = bb * H + h
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
            base = part_ptr + (((op * N_SLOTS + slot0 + c).to(tl.int64)) * N_BH + bh) * 4 * BLOCK_D + offs_d
            hi = max_nan(hi, tl.load(base, mask=ok, other=float("-inf"), cache_modifier=".cg"))
            lo = min_nan(lo, tl.load(base + BLOCK_D, mask=ok, other=float("inf"), cache_modifier=".cg"))
            amax = max_nan(amax, tl.load(base + 2 * BLOCK_D, mask=ok, other=0.0, cache_modifier=".cg"))
            total += tl.load(base + 3 * BLOCK_D, mask=ok, other=0.0, cache_modifier=".cg")
    sh = (seq * H + h).to(tl.int64)
    if op == 0:
        _finish_write(hi, lo, amax, total, length, h_ptr, x_out_ptr, sh, N_SH, BLOCK_D, X_ROTATE, X_SMOOTH, MEAN_COLS)
    else:
        _finish_write(hi, lo, amax, total, length, h_ptr, y_out_ptr, sh, N_SH, BLOCK_D, Y_ROTATE, Y_SMOOTH, MEAN_COLS)


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
    """A partials launch over one or two operands, as :func:`stats_launch` sets it up: ``args``, the
    partials kernel's arguments before its counters, ``outs`` those after them; ``meta`` its
    constexprs (FOLD aside) and launch options; ``results`` the views its fold writes; ``grid``
    (chunks per sequence·head row, rows, operands); ``finish_args``, :func:`_finish_kernel`'s
    arguments before its constexprs; ``tma_stages``, the pipeline's stages with TMA loads."""

    args: tuple
    outs: tuple
    meta: dict
    results: tuple[SequenceStats, ...]
    grid: tuple[int, int, int]
    n_sh: int
    max_len: int
    finish_args: tuple
    tma_stages: int | None = None


def stats_launch(
    xs: tuple[torch.Tensor, ...],
    needs: tuple[StatsNeed, ...],
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> StatsLaunch:
    """The partials launch of :func:`sequence_stats` for ``xs`` and ``needs`` (see there), its
    buffers allocated (one partials buffer; per operand one output buffer, its three statistics
    back to back)."""
    check_operand_pair("sequence_stats", xs, needs, "StatsNeed")
    x = xs[0]
    bsz, heads, seq, d = x.shape
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
    part = torch.empty(len(xs), n_slots, bsz * heads, 4, dp, dtype=torch.float32, device=dev)
    n_sh = n_seq * heads
    # One buffer per operand: shift, col_amax, row_amax back to back (contiguous views).
    alloc = scratch_empty()
    outs = [alloc((n_sh * (2 * dp + 1),), dtype=torch.float32, device=dev) for _ in xs]
    results = tuple(SequenceStats(o[:n_sh * dp].view(n_seq, heads, dp), o[2 * n_sh * dp:].view(n_seq, heads),
                                  o[n_sh * dp:2 * n_sh * dp].view(n_seq, heads, dp)) for o in outs)
    cu = cu_seqlens if varlen else x
    y = xs[-1]
    ny = needs[-1] if len(xs) == 2 else StatsNeed()
    flags = {}
    for prefix, n in (("X", needs[0]), ("Y", ny)):
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
    mean_rotate = [n.rotate and not (transposed and flags[f"{p}_ROTATE"]) for p, n in (("X", needs[0]), ("Y", ny))]
    if rotated_rows:
        sub, warps = rotated_launch["sub"], rotated_launch["num_warps"]
        stages, maxnreg = rotated_launch.get("stages"), rotated_launch.get("maxnreg")
        tma_stages = rotated_launch.get("tma_stages", stages)
    else:
        sub, warps = (SUB_CHUNK_D256 if wide else SUB_CHUNK), PARTIALS_WARPS
        stages = maxnreg = None
        tma_stages = PLAIN_TMA_STAGES
    meta = dict(CHUNK=CHUNK, SUB=sub, BLOCK_D=dp, IS_VARLEN=varlen, DOT_DTYPE=dot_dtype(x), ELEMENTWISE=elementwise,
                STAGES=stages, TRANSPOSED=transposed, **flags, X_MEAN_ROTATE=mean_rotate[0],
                Y_MEAN_ROTATE=mean_rotate[1], MEAN_COLS=MEAN_COLS, FOLD_LOADS=FOLD_LOADS,
                num_warps=warps, maxnreg=maxnreg, **COMPILE_OPTIONS)
    args = (x, *x.stride(), y, *y.stride(), h, part, cu, chunk_off, heads, seq, d, bsz * heads, n_slots)
    # Folding, every sequence needs its chunk 0 program (an empty one writes its zeros there).
    grid = (max(cdiv(max_len, CHUNK), 1), n_seq * heads, len(xs))
    finish_args = (part, h, outs[0], outs[-1], cu, chunk_off, heads, seq, bsz * heads, n_slots, n_sh)
    return StatsLaunch(args, (outs[0], outs[-1], n_sh), meta, results, grid, n_sh, max_len, finish_args,
                       tma_stages)


def tma_descriptors(xs: tuple[torch.Tensor, ...], sub: int, dp: int) -> tuple | None:
    """Per tensor of ``xs`` (``(B, H, S, D)``) a TMA descriptor of (1, 1, ``sub``, ``dp``) blocks for
    the partials launch, or None where :data:`TMA_LOADS` is off or a tensor does not allow one (not
    on a CUDA GPU of compute capability 9 or later, no tokens, or strides or address not 16-byte
    aligned); the launch then loads by pointer, the same values."""
    if not TMA_LOADS or interpreting() or dp > 256:
        return None
    for x in xs:
        if not x.is_cuda or x.numel() == 0 or x.stride(-1) != 1 or x.data_ptr() % 16:
            return None
        if any(st * x.element_size() % 16 for st in x.stride()[:-1]) or not has_tma(x.device.index):
            return None
    return tuple(TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, sub, dp]) for x in xs)


def sequence_stats(
    xs: tuple[torch.Tensor, ...],
    needs: tuple[StatsNeed, ...],
    *,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> tuple[SequenceStats, ...]:
    """:class:`SequenceStats` of one or two tensors ``(B, H, S, D)`` of one shape (any strides;
    varlen: ``B == 1`` and int32 ``cu_seqlens (n_seq + 1,)`` with ``max_seqlen`` its longest
    sequence), one :class:`StatsNeed` each, in one launch for both (two with
    :data:`FOLD_IN_PARTIALS` off). Fields not asked for hold meaningless values."""
    st = stats_launch(xs, needs, cu_seqlens, max_seqlen)
    if st.n_sh == 0:
        return st.results
    fold = FOLD_IN_PARTIALS
    x = xs[0]
    if fold or st.max_len > 0:
        counts = torch.zeros(len(xs), st.n_sh, dtype=torch.int32, device=x.device) if fold else x
        descs = tma_descriptors(xs, st.meta["SUB"], st.meta["BLOCK_D"])
        meta = st.meta if descs is None else {**st.meta, "STAGES": st.tma_stages}
        launch_kernel(_partials_kernel, st.grid, *st.args, counts, *st.outs, FOLD=fold,
                      x_desc=descs[0] if descs else None, y_desc=descs[-1] if descs else None, TMA=descs is not None,
                      **meta)
    if not fold:
        ny = needs[-1] if len(xs) == 2 else StatsNeed()
        heads = x.shape[1]
        launch_kernel(
            _finish_kernel, (st.grid[1] // heads, heads, len(xs)), *st.finish_args,
            CHUNK=CHUNK, BLOCK_D=st.meta["BLOCK_D"], IS_VARLEN=st.meta["IS_VARLEN"], X_ROTATE=st.meta["X_MEAN_ROTATE"],
            X_SMOOTH=needs[0].smooth, Y_ROTATE=st.meta["Y_MEAN_ROTATE"], Y_SMOOTH=ny.smooth, MEAN_COLS=MEAN_COLS,
            FOLD_LOADS=FOLD_LOADS, num_warps=FINISH_WARPS, **COMPILE_OPTIONS,
        )
    return st.results
