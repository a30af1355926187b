"""Triton FP8 attention backward with Delta-Matching (DESIGN.md §1-§2).

Two kernels, no atomics (deterministic by construction):

1. ``_bwd_dq_kernel`` — one program per (query tile of ``block_q`` rows, batch·query head).
   Matched delta: a first loop over the visible key tiles forms S and dP (B1, B2) and the
   backward's own online normaliser

       m = max_j S_ij,  l = Σ_j exp(S_ij − m),  u = Σ_j exp(S_ij − m) · dP_ij
       LSE'_i = m + log l,   D_i = u / l   (= Σ_j P_ij dP_ij with P = exp(S − LSE'))

   Stale delta: LSE' = the forward's LSE and D_i = Σ_d dO_id O_id (fp32, unquantized inputs).
   A second loop recomputes S and dP bit-identically, forms P = exp(S − LSE') and
   dS = P ∘ (dP − D) in fp32, and accumulates dQ = τ dS K (B4: dS quantized per row within each
   key tile, K per channel within each key tile). It writes LSE' and D for kernel 2.
2. ``_bwd_dkdv_kernel`` — one program per (key tile of ``block_k`` keys, batch·kv head); it loops
   over the G query heads of its kv head (GQA without repeating k/v) and their visible query tiles,
   recomputes S, dP, P, dS exactly as kernel 1 (same LSE', same D) and accumulates
   dV = Pᵀ dO (B3: P per column and dO per channel within each query tile) and
   dK = τ dSᵀ Q (B5: dS per column and Q per channel within each query tile).

Quantization (FP8 mode) happens in registers on tiles loaded from the bf16/fp16/fp32 inputs:
Q, K, V, dO per token for B1/B2 (identical to the forward's F1, so the logits are the forward's);
the channel-wise copies per tile as listed above. Scales are folded into the fp32 accumulators
after each FP8 ``tl.dot`` (a scale is constant along each matmul's contraction), and τ·log2(e)
into the logits so the kernels use ``exp2``. Hybrid mode (``config.backward == "bf16"``) runs the
same schedule with bf16 operands.

Tile sizes are the quantization blocks (``config.block_q`` / ``config.block_k``) and tiles start at
each sequence's start, as in :mod:`hf_fp8_attention.reference`, which defines the numerics.

The default FP8 path (:mod:`.backward_prequant`) runs this schedule on operands quantized once up
front, and by default gives each kernel's two jobs a launch of their own (LSE'/D, then dQ; dK, then
dV: see ``LAUNCH``). It forms the same dS with one operation per element fewer: dO's row scale is
folded into LSE' and D there (see that module's docstring).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..config import BackwardPrecision, DeltaMode, FP8AttentionConfig, FP8Format
from ..masking import MaskSpec, varlen_max_lengths
from .backward_prequant import _bwd_dkdv_prequant_kernel, _bwd_dq_prequant_kernel, _fold_matched_stats, _seq
from .backward_quant import quant_cols, quant_rows
from .quantize import COMPILE_OPTIONS, Copies, interpreting, padded_head_dim, quantize_operands
from .tiles import cdiv, check_compiled_blocks

LOG2E = 1.4426950408889634

SUPPORTED_HEAD_DIMS = (64, 96, 128)

# Launch parameters per kernel; a module-level table so benchmarks can try others.
# ``prequant``: FP8 mode quantizes Q, K, V, dO once before the attention kernels
# (backward_prequant.py) instead of re-quantizing them in registers inside every program's loop.
# The pre-quantized path runs as four launches by default:
#   ``dq_stats`` (matched delta only: LSE' and D), ``dq``, ``dk``, ``dv``.
# ``split_dq_stats`` False folds LSE'/D into the dQ launch (its first loop); ``split_dkdv`` False
# forms dK and dV in one launch (``dkdv``). Split, Sᵀ is computed once more, but each program holds
# one fp32 accumulator and fewer shared-memory buffers: on an H200 (backward_bench --schedules,
# S=8192, causal, d=128) the matched backward takes 3.56 ms split vs 4.88 ms fused, with
# bit-identical gradients (benchmarks/results/h200_v8_backward_bench.log, benchmarks/NOTES.md).
# ``free_tile``: per launch, the tile side that is not a quantization block (the dQ kernel's query
# rows, the dK/dV kernel's key rows; every scale there is per token or per block of the other
# side), so it can be smaller than the recipe's blocks to save registers. None: the block.
# ``inreg``: the in-register kernels (hybrid bf16 backward, or FP8 with prequant off); their bf16
# tiles leave no shared memory for multi-stage pipelining.
LAUNCH = {
    "prequant": True,
    "split_dq_stats": True,
    "split_dkdv": True,
    "dq_stats": {"num_warps": 4, "num_stages": 3},
    "dq": {"num_warps": 4, "num_stages": 3},
    "dk": {"num_warps": 4, "num_stages": 3},
    "dv": {"num_warps": 4, "num_stages": 3},
    "dkdv": {"num_warps": 4, "num_stages": 3},
    "free_tile": {"dq": 64, "dq_stats": 64, "dkdv": 64, "dk": 64, "dv": 64},
    "inreg": {"dq": {"num_warps": 4, "num_stages": 1}, "dkdv": {"num_warps": 8, "num_stages": 1}},
}
# Pipelined stages of the pre-quantized kernels hold four FP8 operand tiles of block x 128 bytes
# each: 64 KB per stage at 128-token blocks, so 256-token blocks (128 KB) get a single stage.
_MAX_PIPELINED_BLOCK = 128


def _prequant_launch(kernel: str, block_q: int, block_k: int) -> dict:
    """``LAUNCH[kernel]`` with ``num_stages`` cut to 1 when the recipe's blocks exceed 128 tokens."""
    launch = dict(LAUNCH[kernel])
    if max(block_q, block_k) > _MAX_PIPELINED_BLOCK:
        launch["num_stages"] = 1
    return launch


def _tl_fp8(fmt: FP8Format):
    return tl.float8e4nv if fmt is FP8Format.E4M3 else tl.float8e5


# --------------------------------------------------------------------------------------------
# shared device helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _load_tile(base, rows, row_ok, offs_d, d_ok, stride_s, stride_d):
    """(R, BLOCK_D) fp32 tile of rows ``rows`` (zero outside the sequence and head dim)."""
    ptrs = base + rows[:, None].to(tl.int64) * stride_s + offs_d[None, :] * stride_d
    return tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)


@triton.jit
def _visible(pos_q, row_ok, offs_k, k_len, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """(BQ, BK) bool: query at position pos_q may see key offs_k (masking.py's rules)."""
    vis = row_ok[:, None] & (offs_k < k_len)[None, :]
    if CAUSAL:
        vis = vis & (offs_k[None, :] <= pos_q[:, None])
    if HAS_WINDOW:
        vis = vis & ((pos_q[:, None] - offs_k[None, :]) < window)
        if not CAUSAL:
            vis = vis & ((offs_k[None, :] - pos_q[:, None]) < window)
    return vis


@triton.jit
def _bf16_operand(x, INTERPRET: tl.constexpr):
    """x rounded to bf16 (ties to even). The CPU interpreter's bf16 arithmetic is unreliable, so
    there the rounded value stays in fp32 (an fp32 dot of bf16-valued operands is the same product)."""
    if INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
        op = bits.to(tl.float32, bitcast=True)
    else:
        op = x.to(tl.bfloat16)
    return op


@triton.jit
def _row_operands(x, FP8: tl.constexpr, FMT_MAX: tl.constexpr, POW2: tl.constexpr, DTYPE: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Per-token operand of B1/B2: (codes, per-row scales) in FP8, (bf16 values, ones) in hybrid."""
    if FP8:
        op, scale = quant_rows(x, FMT_MAX, POW2, DTYPE, INTERPRET)
    else:
        op = _bf16_operand(x, INTERPRET)
        scale = tl.full([x.shape[0]], 1.0, tl.float32)
    return op, scale


@triton.jit
def _col_operands(x, FP8: tl.constexpr, FMT_MAX: tl.constexpr, POW2: tl.constexpr, DTYPE: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Per-column operand (B3-B5): (codes, per-column scales) in FP8, (bf16 values, ones) in hybrid."""
    if FP8:
        op, scale = quant_cols(x, FMT_MAX, POW2, DTYPE, INTERPRET)
    else:
        op = _bf16_operand(x, INTERPRET)
        scale = tl.full([x.shape[1]], 1.0, tl.float32)
    return op, scale


@triton.jit
def _scores(q_op, sq_row, k_op, sk_row, vo_op, sdo_row, v_op, sv_row):
    """S (log2 units, scale folded into sq_row) and dP, both (BQ, BK) fp32."""
    s = tl.dot(q_op, tl.trans(k_op), out_dtype=tl.float32) * sq_row[:, None] * sk_row[None, :]
    dp = tl.dot(vo_op, tl.trans(v_op), out_dtype=tl.float32) * sdo_row[:, None] * sv_row[None, :]
    return s, dp


# --------------------------------------------------------------------------------------------
# kernel 1: delta (matched pre-pass or stale rowsum) + dQ
# --------------------------------------------------------------------------------------------


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, O, LSE, DQ, LSE2, DELTA, DBG_DSSUM, DBG_PABS,
    CU_Q, CU_K,
    sqb, sqh, sqs, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    sdob, sdoh, sdos, sdod,
    sob, soh, sos, sod,
    sdqb, sdqh, sdqs, sdqd,
    slb, slh, sls,
    H, G, SQ_TOTAL, SQ, SK, window, qk_scale, tau,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, MATCHED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    VARLEN: tl.constexpr, DEBUG: tl.constexpr, POW2: tl.constexpr,
    QKV_DTYPE: tl.constexpr, DO_DTYPE: tl.constexpr, DS_DTYPE: tl.constexpr,
    DO_MAX: tl.constexpr, DS_MAX: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dQ (B, Hq, Sq, D) plus LSE' (log2 units) and D (B·Hq, Sq) fp32 for the dK/dV kernel.

    In exact terms: D_i = Σ_j P_ij dP_ij (matched) or Σ_d dO_id O_id (stale);
    dQ_i = τ Σ_j P_ij (dP_ij − D_i) K_j. Debug: also Σ_j dS_ij and Σ_j P_ij |dP_ij| per row.
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    seq = pid_bh // H
    h = pid_bh % H
    hk = h // G
    batch, q_start, q_len, k_start, k_len = _seq(seq, CU_Q, CU_K, SQ, SK, VARLEN)
    m0 = pid_m * BLOCK_Q
    if m0 >= q_len:
        return
    offs_m = m0 + tl.arange(0, BLOCK_Q)
    row_ok = offs_m < q_len
    pos_q = offs_m + (k_len - q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    offs_n0 = tl.arange(0, BLOCK_K)

    q_base = Q + batch.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    do_base = DO + batch.to(tl.int64) * sdob + h.to(tl.int64) * sdoh
    k_base = K + batch.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = V + batch.to(tl.int64) * svb + hk.to(tl.int64) * svh
    rows = q_start + offs_m
    q = _load_tile(q_base, rows, row_ok, offs_d, d_ok, sqs, sqd)
    do = _load_tile(do_base, rows, row_ok, offs_d, d_ok, sdos, sdod)
    q_op, sq = _row_operands(q, FP8, 448.0, POW2, QKV_DTYPE, INTERPRET)
    do_op, sdo = _row_operands(do, FP8, DO_MAX, POW2, DO_DTYPE, INTERPRET)
    sq = sq * qk_scale

    # visible key range of this query tile
    lo = 0
    hi = k_len
    if CAUSAL:
        hi = tl.minimum(hi, m0 + BLOCK_Q + (k_len - q_len))
    if HAS_WINDOW:
        lo = tl.maximum(lo, m0 + (k_len - q_len) - window + 1)
        if not CAUSAL:
            hi = tl.minimum(hi, m0 + BLOCK_Q - 1 + (k_len - q_len) + window)
    lo = (lo // BLOCK_K) * BLOCK_K

    stat_off = (batch * H + h).to(tl.int64) * SQ_TOTAL + rows
    if MATCHED:
        m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        u_i = tl.zeros([BLOCK_Q], tl.float32)
        for n0 in range(lo, hi, BLOCK_K):
            offs_n = n0 + offs_n0
            col_ok = offs_n < k_len
            k = _load_tile(k_base, k_start + offs_n, col_ok, offs_d, d_ok, sks, skd)
            v = _load_tile(v_base, k_start + offs_n, col_ok, offs_d, d_ok, svs, svd)
            k_op, sk = _row_operands(k, FP8, 448.0, POW2, QKV_DTYPE, INTERPRET)
            v_op, sv = _row_operands(v, FP8, 448.0, POW2, QKV_DTYPE, INTERPRET)
            s, dp = _scores(q_op, sq, k_op, sk, do_op, sdo, v_op, sv)
            vis = _visible(pos_q, row_ok, offs_n, k_len, window, CAUSAL, HAS_WINDOW)
            s = tl.where(vis, s, float("-inf"))
            m_i, l_i, u_i = _fold_matched_stats(m_i, l_i, u_i, s, dp, vis, True)
        empty = l_i == 0.0
        lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
        delta = tl.where(empty, 0.0, u_i / tl.where(empty, 1.0, l_i))
        tl.store(LSE2 + stat_off, lse2, mask=row_ok)
    else:
        lse_nat = tl.load(LSE + batch.to(tl.int64) * slb + h.to(tl.int64) * slh + rows * sls,
                          mask=row_ok, other=float("-inf"))
        lse2 = lse_nat * 1.4426950408889634
        o = _load_tile(O + batch.to(tl.int64) * sob + h.to(tl.int64) * soh, rows, row_ok, offs_d, d_ok, sos, sod)
        delta = tl.sum(do * o, 1)
        tl.store(LSE2 + stat_off, lse2, mask=row_ok)
    tl.store(DELTA + stat_off, delta, mask=row_ok)

    dq = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    if DEBUG:
        ds_sum = tl.zeros([BLOCK_Q], tl.float32)
        pabs_sum = tl.zeros([BLOCK_Q], tl.float32)
    for n0 in range(lo, hi, BLOCK_K):
        offs_n = n0 + offs_n0
        col_ok = offs_n < k_len
        k = _load_tile(k_base, k_start + offs_n, col_ok, offs_d, d_ok, sks, skd)
        v = _load_tile(v_base, k_start + offs_n, col_ok, offs_d, d_ok, svs, svd)
        k_op, sk = _row_operands(k, FP8, 448.0, POW2, QKV_DTYPE, INTERPRET)
        v_op, sv = _row_operands(v, FP8, 448.0, POW2, QKV_DTYPE, INTERPRET)
        s, dp = _scores(q_op, sq, k_op, sk, do_op, sdo, v_op, sv)
        vis = _visible(pos_q, row_ok, offs_n, k_len, window, CAUSAL, HAS_WINDOW)
        p = tl.where(vis, tl.math.exp2(s - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        if DEBUG:
            ds_sum += tl.sum(ds, 1)
            pabs_sum += tl.sum(p * tl.abs(tl.where(vis, dp, 0.0)), 1)
        # B4: dS per row within this key tile, K per channel within this key tile.
        ds_op, sds = _row_operands(ds, FP8, DS_MAX, POW2, DS_DTYPE, INTERPRET)
        kc_op, skc = _col_operands(k, FP8, 448.0, POW2, QKV_DTYPE, INTERPRET)
        dq += tl.dot(ds_op, kc_op, out_dtype=tl.float32) * sds[:, None] * skc[None, :]
    dq = dq * tau
    dq_ptrs = (DQ + batch.to(tl.int64) * sdqb + h.to(tl.int64) * sdqh
               + rows[:, None].to(tl.int64) * sdqs + offs_d[None, :] * sdqd)
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if DEBUG:
        tl.store(DBG_DSSUM + stat_off, ds_sum, mask=row_ok)
        tl.store(DBG_PABS + stat_off, pabs_sum, mask=row_ok)


# --------------------------------------------------------------------------------------------
# kernel 2: dK, dV
# --------------------------------------------------------------------------------------------


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE2, DELTA, DK, DV,
    CU_Q, CU_K,
    sqb, sqh, sqs, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    sdob, sdoh, sdos, sdod,
    sdkb, sdkh, sdks, sdkd,
    sdvb, sdvh, sdvs, sdvd,
    H, G, SQ_TOTAL, SQ, SK, window, qk_scale, tau,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, VARLEN: tl.constexpr,
    POW2: tl.constexpr, QKV_DTYPE: tl.constexpr, DO_DTYPE: tl.constexpr, DS_DTYPE: tl.constexpr,
    DO_MAX: tl.constexpr, DS_MAX: tl.constexpr, INTERPRET: tl.constexpr,
):
    """dK = τ Σ_g Σ_i dS_ij Q_i and dV = Σ_g Σ_i P_ij dO_i for one key tile of one kv head.

    Reads LSE' (log2 units) and D written by ``_bwd_dq_kernel``, so P and dS are those of kernel 1.
    """
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    HKV = H // G
    seq = pid_bh // HKV
    hk = pid_bh % HKV
    batch, q_start, q_len, k_start, k_len = _seq(seq, CU_Q, CU_K, SQ, SK, VARLEN)
    n0 = pid_n * BLOCK_K
    if n0 >= k_len:
        return
    offs_n = n0 + tl.arange(0, BLOCK_K)
    col_ok = offs_n < k_len
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    offs_m0 = tl.arange(0, BLOCK_Q)
    shift = k_len - q_len  # query i sits at position i + shift

    k_base = K + batch.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = V + batch.to(tl.int64) * svb + hk.to(tl.int64) * svh
    k = _load_tile(k_base, k_start + offs_n, col_ok, offs_d, d_ok, sks, skd)
    v = _load_tile(v_base, k_start + offs_n, col_ok, offs_d, d_ok, svs, svd)
    k_op, sk = _row_operands(k, FP8, 448.0, POW2, QKV_DTYPE, INTERPRET)
    v_op, sv = _row_operands(v, FP8, 448.0, POW2, QKV_DTYPE, INTERPRET)

    # visible query range of this key tile
    lo = 0
    hi = q_len
    if CAUSAL:
        lo = tl.maximum(lo, n0 - shift)
    if HAS_WINDOW:
        hi = tl.minimum(hi, n0 + BLOCK_K - 1 + window - shift)
        if not CAUSAL:
            lo = tl.maximum(lo, n0 - window + 1 - shift)
    lo = (lo // BLOCK_Q) * BLOCK_Q

    dk = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_K, BLOCK_D], tl.float32)
    for g in range(0, G):
        h = hk * G + g
        q_base = Q + batch.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        do_base = DO + batch.to(tl.int64) * sdob + h.to(tl.int64) * sdoh
        stat_base = (batch * H + h).to(tl.int64) * SQ_TOTAL
        for m0 in range(lo, hi, BLOCK_Q):
            offs_m = m0 + offs_m0
            row_ok = offs_m < q_len
            rows = q_start + offs_m
            q = _load_tile(q_base, rows, row_ok, offs_d, d_ok, sqs, sqd)
            do = _load_tile(do_base, rows, row_ok, offs_d, d_ok, sdos, sdod)
            lse2 = tl.load(LSE2 + stat_base + rows, mask=row_ok, other=float("-inf"))
            delta = tl.load(DELTA + stat_base + rows, mask=row_ok, other=0.0)
            q_op, sq = _row_operands(q, FP8, 448.0, POW2, QKV_DTYPE, INTERPRET)
            do_op, sdo = _row_operands(do, FP8, DO_MAX, POW2, DO_DTYPE, INTERPRET)
            s, dp = _scores(q_op, sq * qk_scale, k_op, sk, do_op, sdo, v_op, sv)
            vis = _visible(offs_m + shift, row_ok, offs_n, k_len, window, CAUSAL, HAS_WINDOW)
            p = tl.where(vis, tl.math.exp2(s - lse2[:, None]), 0.0)
            ds = p * (dp - delta[:, None])
            # B3: P per column, dO per channel, both within this query tile.
            p_op, sp = _col_operands(p, FP8, 448.0, POW2, QKV_DTYPE, INTERPRET)
            doc_op, sdoc = _col_operands(do, FP8, DO_MAX, POW2, DO_DTYPE, INTERPRET)
            dv += tl.dot(tl.trans(p_op), doc_op, out_dtype=tl.float32) * sp[:, None] * sdoc[None, :]
            # B5: dS per column, Q per channel, both within this query tile.
            ds_op, sds = _col_operands(ds, FP8, DS_MAX, POW2, DS_DTYPE, INTERPRET)
            qc_op, sqc = _col_operands(q, FP8, 448.0, POW2, QKV_DTYPE, INTERPRET)
            dk += tl.dot(tl.trans(ds_op), qc_op, out_dtype=tl.float32) * sds[:, None] * sqc[None, :]
    dk = dk * tau
    keys = (k_start + offs_n)[:, None].to(tl.int64)
    st_mask = col_ok[:, None] & d_ok[None, :]
    tl.store(DK + batch.to(tl.int64) * sdkb + hk.to(tl.int64) * sdkh + keys * sdks + offs_d[None, :] * sdkd,
             dk.to(DK.dtype.element_ty), mask=st_mask)
    tl.store(DV + batch.to(tl.int64) * sdvb + hk.to(tl.int64) * sdvh + keys * sdvs + offs_d[None, :] * sdvd,
             dv.to(DV.dtype.element_ty), mask=st_mask)


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------


def _check(q, k, v, out, lse, dout, mask: MaskSpec, config: FP8AttentionConfig) -> None:
    if not isinstance(config, FP8AttentionConfig):
        raise TypeError(f"triton_backward: config must be an FP8AttentionConfig, got {type(config).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"triton_backward: {name} must be a 4-D tensor (B, H, S, D)")
    if dout.shape != q.shape:
        raise ValueError(f"triton_backward: dout shape {tuple(dout.shape)} != q shape {tuple(q.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"triton_backward: incompatible q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[-1] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"triton_backward: head_dim {q.shape[-1]} not supported (supported: {SUPPORTED_HEAD_DIMS})")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"triton_backward: query heads {q.shape[1]} not a multiple of kv heads {k.shape[1]}")
    if tuple(lse.shape) != tuple(q.shape[:-1]) or lse.dtype != torch.float32:
        raise ValueError(f"triton_backward: lse must be fp32 of shape {tuple(q.shape[:-1])}, got {lse.dtype} {tuple(lse.shape)}")
    if config.delta is DeltaMode.STALE:
        if out is None:
            raise ValueError("triton_backward: the stale delta rowsum(dO ∘ O) needs the forward output `out`")
        if out.shape != q.shape:
            raise ValueError(f"triton_backward: out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
    if mask.is_varlen and q.shape[0] != 1:
        raise ValueError(f"triton_backward: packed (cu_seqlens) input must have batch 1, got {q.shape[0]}")
    devs = {t.device for t in (q, k, v, lse, dout)}
    if len(devs) != 1:
        raise ValueError(f"triton_backward: tensors on several devices: {devs}")
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(f"triton_backward: the Triton kernels need CUDA tensors, got {q.device} "
                         "(the PyTorch emulation in reference.py runs anywhere)")
    check_compiled_blocks(config.block_q, config.block_k, "triton_backward", interpreting())


def _launch(q, k, v, out, lse, dout, scale, mask, config, debug):
    _check(q, k, v, out, lse, dout, mask, config)
    b, hq, sq_total, d = q.shape
    hkv, sk_total = k.shape[1], k.shape[2]
    g = hq // hkv
    fp8 = config.backward is BackwardPrecision.FP8
    matched = config.delta is DeltaMode.MATCHED
    bq, bk = config.block_q, config.block_k
    dev = q.device

    if mask.is_varlen:
        cu_q = mask.cu_seqlens_q.to(device=dev, dtype=torch.int32).contiguous()
        cu_k = mask.cu_seqlens_k.to(device=dev, dtype=torch.int32).contiguous()
        n_seq = cu_q.numel() - 1
        max_q, max_k = varlen_max_lengths(mask)  # (0, 0) without sequences
        alloc = torch.zeros  # tokens outside every sequence get zero gradients
    else:
        cu_q = cu_k = lse  # dummies, never read (the kernels load them only when VARLEN)
        n_seq, max_q, max_k = b, sq_total, sk_total
        alloc = torch.empty
    if n_seq * hq > 65535:  # grid axis 1 holds (sequence, head) pairs
        raise ValueError(f"triton_backward: sequences x heads = {n_seq * hq} exceeds the grid limit 65535")
    prequant = fp8 and LAUNCH["prequant"]
    dq = alloc(q.shape, dtype=q.dtype, device=dev)
    dk = alloc(k.shape, dtype=k.dtype, device=dev)
    dv = alloc(v.shape, dtype=v.dtype, device=dev)
    if prequant:
        # LSE', LSE'^do and D' of every row of every sequence are written by the dQ kernel's
        # statistics pass before any launch reads them; rows outside all sequences are never read.
        # Under the interpreter (the CPU tests) they start as NaN, so a row read before it is
        # written shows.
        scratch = functools.partial(torch.full, fill_value=float("nan")) if interpreting() else torch.empty
        lse2 = scratch((b * hq, sq_total), dtype=torch.float32, device=dev)
        delta = scratch((b * hq, sq_total), dtype=torch.float32, device=dev)
        lse2do = scratch((b * hq, sq_total), dtype=torch.float32, device=dev)
    else:
        lse2 = torch.full((b * hq, sq_total), float("-inf"), dtype=torch.float32, device=dev)
        delta = torch.zeros((b * hq, sq_total), dtype=torch.float32, device=dev)
    dbg_ds = torch.zeros((b * hq, sq_total), dtype=torch.float32, device=dev) if debug else delta
    dbg_pabs = torch.zeros((b * hq, sq_total), dtype=torch.float32, device=dev) if debug else delta
    if n_seq == 0 or max_q == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dbg_ds, dbg_pabs
    o = out if out is not None else q  # O is read only by the stale kernel
    window = mask.window if mask.window is not None else 0
    if prequant:
        _launch_prequant(q, k, v, o, lse, dout, dq, dk, dv, lse2, lse2do, delta, dbg_ds, dbg_pabs, cu_q, cu_k,
                         n_seq, max_q, max_k, scale, mask, config, debug)
        return dq, dk, dv, dbg_ds, dbg_pabs
    common = dict(
        HEAD_D=d, BLOCK_D=padded_head_dim(d), BLOCK_Q=bq, BLOCK_K=bk,
        FP8=fp8, CAUSAL=bool(mask.causal), HAS_WINDOW=mask.window is not None, VARLEN=mask.is_varlen,
        POW2=bool(config.pow2_scales), QKV_DTYPE=_tl_fp8(FP8Format.E4M3),
        DO_DTYPE=_tl_fp8(config.do_format), DS_DTYPE=_tl_fp8(config.ds_format),
        DO_MAX=config.do_format.max, DS_MAX=config.ds_format.max,
        INTERPRET=interpreting(),
    )
    qk_scale = float(scale) * LOG2E
    dims = (hq, g, sq_total, sq_total, sk_total)  # SQ/SK: dense lengths (varlen reads cu_seqlens)
    _bwd_dq_kernel[(cdiv(max_q, bq), n_seq * hq)](
        q, k, v, dout, o, lse, dq, lse2, delta, dbg_ds, dbg_pabs, cu_q, cu_k,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *o.stride(), *dq.stride(), *lse.stride(),
        *dims, window, qk_scale, float(scale),
        MATCHED=matched, DEBUG=debug, **common, **LAUNCH["inreg"]["dq"], **COMPILE_OPTIONS,
    )
    _bwd_dkdv_kernel[(cdiv(max_k, bk), n_seq * hkv)](
        q, k, v, dout, lse2, delta, dk, dv, cu_q, cu_k,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
        *dims, window, qk_scale, float(scale),
        **common, **LAUNCH["inreg"]["dkdv"], **COMPILE_OPTIONS,
    )
    return dq, dk, dv, dbg_ds, dbg_pabs


def _launch_prequant(q, k, v, o, lse, dout, dq, dk, dv, lse2, lse2do, delta, dbg_ds, dbg_pabs, cu_q, cu_k,
                     n_seq, max_q, max_k, scale, mask, config, debug):
    """FP8 mode on operands quantized once up front (kernels in backward_prequant.py). ``lse2``,
    ``lse2do``, ``delta``: (B·Hq, Sq) fp32 buffers for LSE', LSE'^do and D' (see that module)."""
    b, hq, sq_total, d = q.shape
    hkv, sk_total = k.shape[1], k.shape[2]
    bq, bk, pow2 = config.block_q, config.block_k, bool(config.pow2_scales)
    varlen = mask.is_varlen
    cq, ck = (cu_q, cu_k) if varlen else (None, None)
    # Row-wise copies for B1/B2 and transposed channel-wise copies per recipe block for B3-B5, made
    # by the forward's quantization kernel (so B1's codes are the forward's F1 codes, bit for bit):
    # one launch for Q and dO, one for K and V.
    (qr, qrs, qct, qcs, toff_q), (dor, dors, doct, docs, _) = quantize_operands(
        (q, dout), (Copies(True, True, config.q_format), Copies(True, True, config.do_format)),
        block=bq, pow2=pow2, cu_seqlens=cq, max_seqlen=max_q)
    (kr, krs, kct, kcs, toff_k), (vr, vrs, _, _, _) = quantize_operands(
        (k, v), (Copies(True, True, config.k_format), Copies(True, False, config.v_format)),
        block=bk, pow2=pow2, cu_seqlens=ck, max_seqlen=max_k)
    if not varlen:  # the kernels read tile offsets only for packed sequences
        toff_q, toff_k = cu_q, cu_k
    interp = interpreting()
    common = dict(HEAD_D=d, BLOCK_D=padded_head_dim(d), CAUSAL=bool(mask.causal),
                  HAS_WINDOW=mask.window is not None, VARLEN=mask.is_varlen, POW2=pow2,
                  DS_DTYPE=_tl_fp8(config.ds_format), DS_MAX=config.ds_format.max, INTERPRET=interp)
    window = mask.window if mask.window is not None else 0
    qk_scale = float(scale) * LOG2E
    matched = config.delta is DeltaMode.MATCHED
    split_stats = matched and LAUNCH["split_dq_stats"]
    dq_passes = ((True, False, "dq_stats"), (False, True, "dq")) if split_stats else ((True, True, "dq"),)
    for stats, grads, launch in dq_passes:
        bm = LAUNCH["free_tile"][launch] or bq
        _bwd_dq_prequant_kernel[(cdiv(max_q, bm), n_seq * hq)](
            qr, qrs, kr, krs, kct, kcs, vr, vrs, dor, dors,
            dout, o, lse, dq, lse2, lse2do, delta, dbg_ds, dbg_pabs, cu_q, cu_k, toff_k,
            *dout.stride(), *o.stride(), *lse.stride(),
            hq, hq // hkv, sq_total, sk_total, kct.shape[-1], kcs.shape[2], sq_total, sk_total, window, qk_scale,
            float(scale), MATCHED=matched, DEBUG=debug, **common, BLOCK_Q=bm, BLOCK_K=bk, STATS=stats, GRADS=grads,
            ALIGNED=not varlen and sq_total % bm == 0 and sk_total % bk == 0,
            **_prequant_launch(launch, bq, bk), **COMPILE_OPTIONS,
        )
    passes = ((True, False, "dk"), (False, True, "dv")) if LAUNCH["split_dkdv"] else ((True, True, "dkdv"),)
    for compute_dk, compute_dv, launch in passes:
        bn = LAUNCH["free_tile"][launch] or bk
        _bwd_dkdv_prequant_kernel[(cdiv(max_k, bn), n_seq * hkv)](
            qr, qrs, qct, qcs, kr, krs, vr, vrs, dor, doct, docs,
            lse2, lse2do, delta, dk, dv, cu_q, cu_k, toff_q,
            hq, hq // hkv, sq_total, sk_total, qct.shape[-1], qcs.shape[2], sq_total, sk_total, window, qk_scale,
            float(scale), **common, BLOCK_Q=bq, BLOCK_K=bn, COMPUTE_DK=compute_dk, COMPUTE_DV=compute_dv,
            ALIGNED=not varlen and sq_total % bq == 0 and sk_total % bn == 0,
            **_prequant_launch(launch, bq, bk), **COMPILE_OPTIONS,
        )


def triton_backward(q, k, v, out, lse, dout, *, scale: float, mask: MaskSpec, config: FP8AttentionConfig):
    """FP8 (or hybrid bf16) attention backward with the matched or stale delta, in Triton.

    Args:
        q: ``(B, Hq, Sq, D)`` bf16/fp16/fp32, any strides; k, v: ``(B, Hkv, Sk, D)``.
        out: forward output ``(B, Hq, Sq, D)``; read only by ``delta="stale"`` (None is fine when matched).
        lse: ``(B, Hq, Sq)`` fp32 natural-log LSE of the forward (-inf on rows with no key); read
            only by the stale delta (the matched delta forms its own normaliser).
        dout: ``(B, Hq, Sq, D)``.
        scale: softmax scale τ. mask: :class:`MaskSpec`. config: the recipe (tile sizes = quant blocks).
    Returns:
        ``(dq, dk, dv)`` contiguous, in the dtypes and shapes of q, k, v.
    """
    dq, dk, dv, _, _ = _launch(q, k, v, out, lse, dout, scale, mask, config, debug=False)
    return dq, dk, dv


def triton_backward_row_sums(q, k, v, out, lse, dout, *, scale: float, mask: MaskSpec, config: FP8AttentionConfig):
    """Diagnostic variant of :func:`triton_backward` (a separately compiled kernel; the default
    path carries none of this).

    Returns ``(dq, dk, dv, ds_row_sum, p_abs_dp_row_sum)``: the last two ``(B, Hq, Sq)`` fp32 hold,
    per query row, Σ_j dS_ij of the fp32 dS the kernel formed (before quantization) and
    Σ_j P_ij |dP_ij|, the natural size of that sum's terms. Their ratio is the zero-row-sum
    residual: fp32 rounding level in matched mode.
    """
    dq, dk, dv, ds_sum, pabs = _launch(q, k, v, out, lse, dout, scale, mask, config, debug=True)
    shape = q.shape[:-1]
    return dq, dk, dv, ds_sum.view(shape), pabs.view(shape)
