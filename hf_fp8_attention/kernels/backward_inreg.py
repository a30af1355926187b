"""The in-register backward kernels: hybrid bf16 (``config.backward == "bf16"``), and FP8 with
``LAUNCH["prequant"]`` off. Q, K, V and dO tiles are loaded from the bf16/fp16/fp32 inputs and
quantized (or rounded to bf16) in registers inside every program's loop; the maths and the two
kernels' schedule are described in :mod:`.backward`, which launches them.

Logit modifiers (:mod:`.logit_mods`, constexprs): SOFTCAP caps S wherever it is formed and
multiplies dS̃ by the tanh's slope; SINK starts the statistics' running max and normaliser at the
head's sink. These kernels' operands are never K-smoothed, so there is no row constant to add back.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .backward_fp8 import fold_matched_stats
from .backward_quant import quant_cols, quant_rows
from .constants import LOG2E_C
from .logit_mods import cap_slope, soft_cap
from .quantize import mul_rounded
from .tiles import seq_bounds, visible


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
    """(BQ, BK) bool: query at position pos_q may see key offs_k (:func:`.tiles.visible`)."""
    return visible(row_ok[:, None] & (offs_k < k_len)[None, :], pos_q[:, None], offs_k[None, :], window,
                   CAUSAL, HAS_WINDOW)


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
def _scores(q_op, sq_row, k_op, sk_row, vo_op, sdo_row, v_op, sv_row, cap, INTERPRET: tl.constexpr,
            SOFTCAP: tl.constexpr):
    """S (log2 units, scale folded into sq_row; SOFTCAP: capped at ``cap``) and dP, both (BQ, BK) fp32.
    dP is rounded by itself so that dP − D is exactly 0 where D = dP (see backward_fp8._scores)."""
    s = tl.dot(q_op, tl.trans(k_op), out_dtype=tl.float32) * sq_row[:, None] * sk_row[None, :]
    dp = mul_rounded(tl.dot(vo_op, tl.trans(v_op), out_dtype=tl.float32) * sdo_row[:, None], sv_row[None, :],
                     INTERPRET)
    if SOFTCAP:
        s = soft_cap(s, cap)
    return s, dp


# --------------------------------------------------------------------------------------------
# kernel 1: delta (matched pre-pass or stale rowsum) + dQ
# --------------------------------------------------------------------------------------------


@triton.jit
def bwd_dq_inreg_kernel(
    Q, K, V, DO, O, LSE, DQ, LSE2, DELTA, DBG_DSSUM, DBG_PABS,
    CU_Q, CU_K, SINKS,
    sqb, sqh, sqs, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    sdob, sdoh, sdos, sdod,
    sob, soh, sos, sod,
    sdqb, sdqh, sdqs, sdqd,
    slb, slh, sls,
    H, G, SQ_TOTAL, SQ, SK, window, qk_scale, tau, softcap,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, MATCHED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    VARLEN: tl.constexpr, DEBUG: tl.constexpr, POW2: tl.constexpr,
    QKV_DTYPE: tl.constexpr, DO_DTYPE: tl.constexpr, DS_DTYPE: tl.constexpr,
    DO_MAX: tl.constexpr, DS_MAX: tl.constexpr, INTERPRET: tl.constexpr,
    SOFTCAP: tl.constexpr, SINK: tl.constexpr,
):
    """dQ (B, Hq, Sq, D) plus LSE' (log2 units) and D (B·Hq, Sq) fp32 for the dK/dV kernel.

    In exact terms: D_i = Σ_j P_ij dP_ij (matched) or Σ_d dO_id O_id (stale);
    dQ_i = τ Σ_j P_ij (dP_ij − D_i) K_j. Debug: also Σ_j dS_ij and Σ_j P_ij |dP_ij| per row.
    SOFTCAP / SINK: ``softcap`` c₂, ``SINKS`` (Hq,) σ₂ (log2 units; module docstring).
    """
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    seq = pid_bh // H
    h = pid_bh % H
    hk = h // G
    batch, q_start, q_len, k_start, k_len = seq_bounds(seq, CU_Q, CU_K, SQ, SK, VARLEN)
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

    # visible key range of this query tile: the whole range of .tiles.key_tile_range, unsplit (these
    # kernels mask every tile), its start rounded down to a tile
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
        if SINK:  # the sink's term 2^(σ₂ − m) = 1 starts the normaliser; it adds nothing to u (dP = 0)
            m_i = tl.zeros([BLOCK_Q], tl.float32) + tl.load(SINKS + h)
            l_i = l_i + 1.0
        for n0 in range(lo, hi, BLOCK_K):
            offs_n = n0 + offs_n0
            col_ok = offs_n < k_len
            k = _load_tile(k_base, k_start + offs_n, col_ok, offs_d, d_ok, sks, skd)
            v = _load_tile(v_base, k_start + offs_n, col_ok, offs_d, d_ok, svs, svd)
            k_op, sk = _row_operands(k, FP8, 448.0, POW2, QKV_DTYPE, INTERPRET)
            v_op, sv = _row_operands(v, FP8, 448.0, POW2, QKV_DTYPE, INTERPRET)
            s, dp = _scores(q_op, sq, k_op, sk, do_op, sdo, v_op, sv, softcap, INTERPRET, SOFTCAP)
            vis = _visible(pos_q, row_ok, offs_n, k_len, window, CAUSAL, HAS_WINDOW)
            s = tl.where(vis, s, float("-inf"))
            m_i, l_i, u_i, _ = fold_matched_stats(m_i, l_i, u_i, l_i, s, dp, vis, True, False)
        empty = l_i == 0.0
        lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
        delta = tl.where(empty, 0.0, u_i / tl.where(empty, 1.0, l_i))
        tl.store(LSE2 + stat_off, lse2, mask=row_ok)
    else:
        lse_nat = tl.load(LSE + batch.to(tl.int64) * slb + h.to(tl.int64) * slh + rows * sls,
                          mask=row_ok, other=float("-inf"))
        lse2 = lse_nat * LOG2E_C
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
        s, dp = _scores(q_op, sq, k_op, sk, do_op, sdo, v_op, sv, softcap, INTERPRET, SOFTCAP)
        vis = _visible(pos_q, row_ok, offs_n, k_len, window, CAUSAL, HAS_WINDOW)
        p = tl.where(vis, tl.math.exp2(s - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None])
        if DEBUG:
            ds_sum += tl.sum(ds, 1)
            pabs_sum += tl.sum(p * tl.abs(tl.where(vis, dp, 0.0)), 1)
        if SOFTCAP:
            ds = ds * cap_slope(s, softcap)  # dS̃ -> dS (S is finite here: the mask is on P)
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
def bwd_dkdv_inreg_kernel(
    Q, K, V, DO, LSE2, DELTA, DK, DV,
    CU_Q, CU_K,
    sqb, sqh, sqs, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    sdob, sdoh, sdos, sdod,
    sdkb, sdkh, sdks, sdkd,
    sdvb, sdvh, sdvs, sdvd,
    H, G, SQ_TOTAL, SQ, SK, window, qk_scale, tau, softcap,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, VARLEN: tl.constexpr,
    POW2: tl.constexpr, QKV_DTYPE: tl.constexpr, DO_DTYPE: tl.constexpr, DS_DTYPE: tl.constexpr,
    DO_MAX: tl.constexpr, DS_MAX: tl.constexpr, INTERPRET: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """dK = τ Σ_g Σ_i dS_ij Q_i and dV = Σ_g Σ_i P_ij dO_i for one key tile of one kv head.

    Reads LSE' (log2 units) and D written by ``bwd_dq_inreg_kernel``, so P and dS are those of
    kernel 1 (the sinks are in LSE' already). SOFTCAP: S capped at ``softcap`` as there.
    """
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    HKV = H // G
    seq = pid_bh // HKV
    hk = pid_bh % HKV
    batch, q_start, q_len, k_start, k_len = seq_bounds(seq, CU_Q, CU_K, SQ, SK, VARLEN)
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

    # visible query range of this key tile: the whole range of .tiles.query_tiles, unsplit
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
            s, dp = _scores(q_op, sq * qk_scale, k_op, sk, do_op, sdo, v_op, sv, softcap, INTERPRET, SOFTCAP)
            vis = _visible(offs_m + shift, row_ok, offs_n, k_len, window, CAUSAL, HAS_WINDOW)
            p = tl.where(vis, tl.math.exp2(s - lse2[:, None]), 0.0)
            ds = p * (dp - delta[:, None])
            if SOFTCAP:
                ds = ds * cap_slope(s, softcap)
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
