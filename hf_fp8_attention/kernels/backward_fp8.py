"""The default FP8 backward: kernels on pre-quantized operands (launched by :mod:`.backward`).

Same schedule and numerics as the in-register kernels of :mod:`.backward_inreg` (read the docstring
of :mod:`.backward` for the maths), but Q, K, V and dO are quantized once, before the attention kernels, by
:func:`hf_fp8_attention.kernels.quantize.quantize_operand` (IEEE division, RNE saturating cast:
codes and scales bit-identical to the emulation):

    Q : row-wise (per token, B1) and channel-wise per query tile (B5), the latter transposed
    K : row-wise (B1) and channel-wise per key tile (B4), transposed
    V : row-wise (B2);   dO: row-wise (B2) and channel-wise per query tile (B3), transposed

(the tile recipe; recipe v2 rotates Q and K and smooths K in their B1 copies, may take one row
scale per (sequence, head), and channel scales per channel of the sequence or per head: see
:mod:`.operands`, and the KV_HEAD / COL_SEQ / P_FIXED options of the kernels below)

DS_HEAD (``ds_scales="head"``): dS is cast with one scale per (sequence, query head), from the
statistics launch's per-row bound (:func:`ds_row_bound`) folded per head (:func:`ds_head_scale`), so
the dQ and dK products accumulate in the MMA instead of being scaled per tile.

The transposed channel-wise copies ``(B, H, DP, S_pad)`` make every matmul that contracts over
tokens read a K-major operand (Hopper's FP8 MMA wants both operands K-major). Only P and dS are
quantized inside the kernels, from fp32 registers; their codes use ``x · (1/scale)`` with the
reciprocal computed once per row/column (exact for power-of-two scales; otherwise within one fp32
ulp of ``x / scale``, which moves a code only at a rounding tie).

The dK/dV kernel works in the transposed orientation (Sᵀ = K Qᵀ, tiles (BLOCK_K, BLOCK_Q)), so
Pᵀ and dSᵀ are the A operands of dV and dK directly and "per column within the query tile"
becomes a per-row scale.

dO's row scale is folded into two per-query values instead of multiplying every dP element:
dS_ij = P_ij (dP_ij − D_i) = P'_ij (dP'_ij − D'_i) with dP' = dP / sdo_i (the MMA result times V's
row scale only), P' = P · sdo_i = 2^(S_ij − LSE'^do_i) where LSE'^do = LSE' − log2 sdo, and
D' = D / sdo. The statistics pass forms D' directly (its sum runs over dP'), and stores LSE'
(for dV's P), LSE'^do and D'; the dQ and dK loops read the latter two, and the dK loop no longer
reads sdo at all. One multiply per element fewer in the statistics, dQ and dK loops; dS itself
changes only by fp32 rounding, so the matched zero-row-sum identity holds as before.

Each tile loop runs in three parts, as in the forward kernel: leading boundary tiles, interior
tiles, trailing boundary tiles (bounds: :func:`.tiles.key_tiles`, :func:`.tiles.query_tiles`).
Interior tiles (every row and key in range, every (query, key) pair visible) skip the visibility
mask, its
``tl.where`` and the load masks: elementwise work that would otherwise compete with the FP8 MMAs.
Visible elements see the same operations in the same order either way: bit-identical under the
interpreter. Compiled with FP fusion (Triton's default), the interior statistics loop may round
differently in the last bit (see :func:`_dq_stats_tiles`).

Logit modifiers (:mod:`.logit_mods`; constexprs, off: the code as without them): ROW_SHIFT adds
K-smoothing's row constant back to S and SOFTCAP caps it (c₂·tanh(S/c₂)) wherever S is formed;
with a cap, dS = P ∘ (dP − D) ∘ (1 − (S̃/c₂)²) is what is quantized (the DEBUG row sums stay those of
P ∘ (dP − D), the zero-sum one). SINK: the statistics pass starts each row's running max and
normaliser at the head's sink σ₂ (m = σ₂, l = 1), so LSE' includes it; the sink's gradient comes
from LSE'^do and D' afterwards (:func:`.logit_mods.sink_grad`).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .backward_quant import cast_saturating
from .constants import LOG2E_C
from .logit_mods import cap_slope, modify_logits
from .quantize import abs_max, mul_rounded, pv_token_order, scale_from_amax
from .tiles import key_tiles, query_tiles, seq_bounds, tile_slot, visible


@triton.jit
def _quant_tile(x, AXIS: tl.constexpr, FMT_MAX: tl.constexpr, POW2: tl.constexpr, DTYPE: tl.constexpr,
                INTERPRET: tl.constexpr):
    """x (R, C) fp32 -> codes, scales: one scale per row (AXIS=1) or per column (AXIS=0)."""
    scale = scale_from_amax(abs_max(x, AXIS), FMT_MAX, POW2)
    inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
    if AXIS == 1:
        xs = x * inv[:, None]
    else:
        xs = x * inv[None, :]
    return cast_saturating(xs, FMT_MAX, DTYPE, INTERPRET), scale


@triton.jit
def _rows(base, tok, ok, offs_d, BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    """(T, BLOCK_D) fp8 codes of a row-wise copy laid out (..., S, BLOCK_D); MASKED: rows outside ``ok`` read 0."""
    ptrs = base + tok[:, None].to(tl.int64) * BLOCK_D + offs_d[None, :]
    if MASKED:
        x = tl.load(ptrs, mask=ok[:, None], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _cols_t(base, tok, ok, offs_d, S_PAD, MASKED: tl.constexpr):
    """(C, T) fp8 codes of channels ``offs_d`` (C,) of a transposed channel-wise copy laid out
    (..., BLOCK_D, S_PAD); MASKED: columns outside ``ok`` read 0."""
    ptrs = base + offs_d[:, None].to(tl.int64) * S_PAD + tok[None, :]
    if MASKED:
        x = tl.load(ptrs, mask=ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _vec(ptrs, ok, other, MASKED: tl.constexpr):
    """(T,) per-token values; MASKED: tokens outside ``ok`` read ``other``."""
    if MASKED:
        x = tl.load(ptrs, mask=ok, other=other)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _out_channels(offs_d, BLOCK_D: tl.constexpr, BLOCK_DO: tl.constexpr):
    """The output channels this program accumulates: all BLOCK_D (``offs_d``), or, when the launch
    splits them (BLOCK_DO < BLOCK_D: head dim 256, where a whole-width accumulator beside the S and
    dP tiles would spill), block ``program_id(2)`` of BLOCK_DO channels."""
    if BLOCK_DO == BLOCK_D:
        offs_o = offs_d
    else:
        offs_o = tl.program_id(2) * BLOCK_DO + tl.arange(0, BLOCK_DO)
    return offs_o


@triton.jit
def _scores(q8, do8, sq, kr_base, vr_base, krs_base, vrs_base, keys, col_ok, offs_d, shift, cap,
            BLOCK_D: tl.constexpr, MASKED: tl.constexpr, KV_HEAD: tl.constexpr, INTERPRET: tl.constexpr,
            ROW_SHIFT: tl.constexpr, SOFTCAP: tl.constexpr):
    """S (log2 units) and dP' = dP / sdo (dO's row scale left out, see the module docstring), both
    (BLOCK_Q, BLOCK_K) fp32, of the dQ kernel's query tile against one key tile, from the row-wise
    codes; MASKED: keys outside ``col_ok`` read zero codes, unit scales. KV_HEAD: K's and V's scales
    are one per (sequence, head), folded by the caller into ``sq`` and into dO's row scale, so
    neither product is scaled per key here. dP' is rounded by itself (:func:`.quantize.mul_rounded`):
    dS = P (dP' − D') must be exactly 0 where D' = dP' (a query that sees one key), which an FMA of
    the unrounded product with −D' is not. ROW_SHIFT / SOFTCAP: S with the row constants ``shift``
    (BLOCK_Q,) added back and capped at ``cap`` (:func:`.logit_mods.modify_logits`)."""
    k8 = _rows(kr_base, keys, col_ok, offs_d, BLOCK_D, MASKED)
    v8 = _rows(vr_base, keys, col_ok, offs_d, BLOCK_D, MASKED)
    if KV_HEAD:
        s = tl.dot(q8, tl.trans(k8), out_dtype=tl.float32) * sq[:, None]
        dp = tl.dot(do8, tl.trans(v8), out_dtype=tl.float32)
    else:
        sk = _vec(krs_base + keys, col_ok, 1.0, MASKED)
        sv = _vec(vrs_base + keys, col_ok, 1.0, MASKED)
        s = tl.dot(q8, tl.trans(k8), out_dtype=tl.float32) * sq[:, None] * sk[None, :]
        dp = mul_rounded(tl.dot(do8, tl.trans(v8), out_dtype=tl.float32), sv[None, :], INTERPRET)
    s = modify_logits(s, shift, cap, ROW_SHIFT, SOFTCAP, 0)
    return s, dp


@triton.jit
def fold_matched_stats(m_i, l_i, u_i, w_i, s, dp, vis, MASKED: tl.constexpr, BOUND: tl.constexpr):
    """Fold one key tile into a query tile's matched statistics, all (BLOCK_Q,): running max m of S,
    l = Σ_j 2^(S_ij − m), u = Σ_j 2^(S_ij − m) dP_ij, and with BOUND w = max_j 2^(S_ij − m) |dP_ij|
    (NaN kept; for dS's bound, :func:`ds_row_bound`). ``s`` and ``dp`` (BLOCK_Q, BLOCK_K): logits in
    log2 units, -inf where not visible, and dP; MASKED: only the pairs in ``vis`` add to u and w.
    Shared by this module's kernel and the in-register one (backward_inreg.py)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows with no visible key so far keep every exponent finite. Kept on interior tiles too (one
    # value per row): logits that overflow to -inf stay handled exactly as on boundary tiles.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_safe)
    # Without the caller's tl.where on S (interior tiles), FP fusion may contract S's last scale
    # multiply and this subtraction into one FMA: last-bit differences from the boundary rounding.
    e = tl.math.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(e, 1)
    edp = e * dp
    if MASKED:
        edp = tl.where(vis, edp, 0.0)
    u_i = u_i * alpha + tl.sum(edp, 1)
    if BOUND:
        w_i = tl.maximum(w_i * alpha, abs_max(edp, 1), propagate_nan=tl.PropagateNan.ALL)
    return m_new, l_i, u_i, w_i


@triton.jit
def ds_row_bound(m_i, l_i, w_i, lse2do, delta_do):
    """Per query row (BLOCK_Q,), the bound max_j P_ij |dP_ij| + |D_i| max_j P_ij ≥ max_j |dS_ij| from
    the statistics (:func:`fold_matched_stats`; the reference's ``ds_head_bound``): P'_ij = 2^(S_ij −
    LSE'^do) = 2^(S_ij − m) · 2^(m − LSE'^do), so max_j P'|dP'| = w · 2^(m − LSE'^do) and max_j P' =
    2^(m − LSE'^do) (dO's row scale cancels in both terms). 0 on rows with no visible key."""
    empty = l_i == 0.0  # (LSE'^do is -inf there: the exponent is zeroed, not inf times 0)
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    bound = (w_i + tl.abs(delta_do)) * tl.math.exp2(tl.where(empty, 0.0, m_safe - lse2do))
    return tl.where(empty, 0.0, bound)


@triton.jit
def ds_head_scale(DS_BOUND, seq, h, H, DS_MAX: tl.constexpr, POW2: tl.constexpr):
    """dS's scale and its reciprocal for query head ``h`` of sequence ``seq`` (ds_scales "head"),
    from the largest row bound the statistics launch left in ``DS_BOUND`` (int32 bits of fp32)."""
    scale = scale_from_amax(tl.load(DS_BOUND + seq * H + h).to(tl.float32, bitcast=True), DS_MAX, POW2)
    return scale, tl.math.div_rn(1.0, scale)


@triton.jit
def _dq_stats_tiles(
    m_i, l_i, u_i, w_i, q8, do8, sq, row_ok, pos_q,
    kr_base, vr_base, krs_base, vrs_base, k_start, k_len, window, shift, cap, t_lo, t_hi,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, KV_HEAD: tl.constexpr, INTERPRET: tl.constexpr,
    ROW_SHIFT: tl.constexpr, SOFTCAP: tl.constexpr, BOUND: tl.constexpr,
):
    """Fold key tiles t_lo <= t < t_hi into the matched statistics of one query tile, all (BLOCK_Q,):
    running max m of S, l = Σ_j 2^(S_ij − m), u = Σ_j 2^(S_ij − m) dP'_ij (so u / l = D'), and with
    BOUND w = max_j 2^(S_ij − m) |dP'_ij|. Masks only if MASKED."""
    offs_n0 = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    for t in range(t_lo, t_hi):
        offs_n = t * BLOCK_K + offs_n0
        col_ok = offs_n < k_len  # read only if MASKED
        s, dp = _scores(q8, do8, sq, kr_base, vr_base, krs_base, vrs_base, k_start + offs_n, col_ok,
                        offs_d, shift, cap, BLOCK_D, MASKED, KV_HEAD, INTERPRET, ROW_SHIFT, SOFTCAP)
        vis = None  # interior tiles: every pair is visible
        if MASKED:
            vis = visible(row_ok[:, None] & col_ok[None, :], pos_q[:, None], offs_n[None, :], window,
                           CAUSAL, HAS_WINDOW)
            s = tl.where(vis, s, float("-inf"))
        m_i, l_i, u_i, w_i = fold_matched_stats(m_i, l_i, u_i, w_i, s, dp, vis, MASKED, BOUND)
    return m_i, l_i, u_i, w_i


@triton.jit
def _a_operand(codes, A_IN_PLACE: tl.constexpr):
    """``codes`` (rows, tokens): the A operand of a product that contracts over tokens (dS·K, Pᵀ·dO,
    dSᵀ·Q). A_IN_PLACE: its token columns put in :func:`.quantize.pv_token_order`'s order, the one the
    other operand's channel-wise copy holds its tokens in (``quantize.Copies.col_pv``), so that the
    MMA takes the codes from the registers the accumulator left them in instead of moving them
    between threads. The product's sums then run over the tokens in another order (fp32 rounding)."""
    if A_IN_PLACE:
        codes = pv_token_order(codes, 1)
    return codes


@triton.jit
def _dq_tiles(
    dq, ds_sum, pabs_sum, q8, do8, sq, lse2do, delta_do, ds_inv, row_ok, pos_q,
    kr_base, vr_base, krs_base, vrs_base, kct_base, kcs_base, k_start, k_len, window, SK_PAD, shift, cap, t_lo, t_hi,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DEBUG: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, POW2: tl.constexpr, DS_DTYPE: tl.constexpr,
    DS_MAX: tl.constexpr, INTERPRET: tl.constexpr, KV_HEAD: tl.constexpr, COL_SEQ: tl.constexpr,
    ROW_SHIFT: tl.constexpr, SOFTCAP: tl.constexpr, DS_HEAD: tl.constexpr,
    BLOCK_DO: tl.constexpr, A_IN_PLACE: tl.constexpr,
):
    """Add key tiles t_lo <= t < t_hi to one query tile's dQ (BLOCK_Q, BLOCK_DO) (before the factor τ
    and, with DS_HEAD, before dS's scale: ``ds_inv`` is its reciprocal, one per (sequence, head))
    and, with DEBUG, to its row sums Σ_j dS_ij and Σ_j P_ij |dP_ij| (BLOCK_Q,). Masks only if MASKED.
    ``lse2do`` / ``delta_do``: LSE'^do and D' (BLOCK_Q,), see the module docstring. ``kcs_base``
    points at the sequence's first key tile of K's channel-wise scales. COL_SEQ: those scales are the
    sequence's, the same in every tile: the caller applies them once, after the loop. BLOCK_DO: dQ's
    channels this program forms (:func:`_out_channels`); S and dP contract over all BLOCK_D."""
    offs_n0 = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    offs_o = _out_channels(offs_d, BLOCK_D, BLOCK_DO)
    # DS_HEAD: dS's reciprocal scale joins P's exponent (one multiply per element fewer); the
    # DEBUG row sums need dS itself.
    lse_p = lse2do
    if DS_HEAD and not DEBUG:
        lse_p = lse2do - tl.math.log2(ds_inv)
    for t in range(t_lo, t_hi):
        offs_n = t * BLOCK_K + offs_n0
        col_ok = offs_n < k_len  # read only if MASKED
        keys = k_start + offs_n
        s, dp = _scores(q8, do8, sq, kr_base, vr_base, krs_base, vrs_base, keys, col_ok,
                        offs_d, shift, cap, BLOCK_D, MASKED, KV_HEAD, INTERPRET, ROW_SHIFT, SOFTCAP)
        p = tl.math.exp2(s - lse_p[:, None])  # P' = P · sdo (· 1/dS's scale); P' dP' = P dP
        if MASKED:
            vis = visible(row_ok[:, None] & col_ok[None, :], pos_q[:, None], offs_n[None, :], window,
                           CAUSAL, HAS_WINDOW)
            p = tl.where(vis, p, 0.0)
        ds = p * (dp - delta_do[:, None])
        if DEBUG:
            ds_sum += tl.sum(ds, 1)
            dp_abs = tl.abs(dp)
            if MASKED:
                dp_abs = tl.where(vis, dp_abs, 0.0)
            pabs_sum += tl.sum(p * dp_abs, 1)
        if SOFTCAP:
            ds = ds * cap_slope(s, cap)  # dS̃ -> dS (S is finite here: the mask is on P)
        # B4: dS per row within this key tile, or per head; K per channel within this key tile
        # or per sequence (pre-quantized). With neither scale varying along the loop, the MMA
        # accumulates dQ in place.
        kct = _cols_t(kct_base, keys, col_ok, offs_o, SK_PAD, MASKED)
        if DS_HEAD:
            if DEBUG:
                ds = ds * ds_inv
            ds8 = _a_operand(cast_saturating(ds, DS_MAX, DS_DTYPE, INTERPRET), A_IN_PLACE)
            if COL_SEQ:
                dq = tl.dot(ds8, tl.trans(kct), dq, out_dtype=tl.float32)
            else:
                skc = tl.load(kcs_base + t * BLOCK_D + offs_o)
                dq += tl.dot(ds8, tl.trans(kct), out_dtype=tl.float32) * skc[None, :]
        else:
            ds8, sds = _quant_tile(ds, 1, DS_MAX, POW2, DS_DTYPE, INTERPRET)
            ds8 = _a_operand(ds8, A_IN_PLACE)
            if COL_SEQ:
                dq += tl.dot(ds8, tl.trans(kct), out_dtype=tl.float32) * sds[:, None]
            else:
                skc = tl.load(kcs_base + t * BLOCK_D + offs_o)
                dq += tl.dot(ds8, tl.trans(kct), out_dtype=tl.float32) * sds[:, None] * skc[None, :]
    return dq, ds_sum, pabs_sum


@triton.jit
def _dq_sweep_tiles(
    acc_a, acc_b, a_sum, b_sum, l_i, u_i, w_i, pmax_i, pabs_sum, q8, do8, sq, lse2do, a_inv, pb_mul, row_ok, pos_q,
    kr_base, vr_base, krs_base, vrs_base, kct_base, k_start, k_len, window, SK_PAD, shift, t_lo, t_hi,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DEBUG: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, DS_DTYPE: tl.constexpr, DS_MAX: tl.constexpr,
    INTERPRET: tl.constexpr, ROW_SHIFT: tl.constexpr, DS_HEAD: tl.constexpr, BLOCK_DO: tl.constexpr,
    A_IN_PLACE: tl.constexpr,
):
    """Key tiles t_lo <= t < t_hi of one query tile's statistics sweep that also forms dQ
    (``dq_in_stats``, KV_HEAD and sequence-wide K channel scales; see the config's docstring).
    P' = 2^(S − LSE^do) = P · sdo from the forward's LSE, so P'dP' = P dP. Accumulates, all
    (BLOCK_Q,) but the two (BLOCK_Q, BLOCK_DO) MMA accumulators: A += fq(P dP) K (codes of
    P dP · ``a_inv``, the row's power-of-two reciprocal scale) and B += fp8(448 P) K (``pb_mul`` =
    448 / sdo), their codes' row sums ``a_sum`` / ``b_sum``, l = Σ P', u = Σ P'dP' (u / l = D'), and
    with DS_HEAD w = max P'|dP'|, pmax = max P' for dK's bound; with DEBUG Σ P'|dP'|."""
    offs_n0 = tl.arange(0, BLOCK_K)
    offs_d = tl.arange(0, BLOCK_D)
    offs_o = _out_channels(offs_d, BLOCK_D, BLOCK_DO)
    for t in range(t_lo, t_hi):
        offs_n = t * BLOCK_K + offs_n0
        col_ok = offs_n < k_len  # read only if MASKED
        keys = k_start + offs_n
        s, dp = _scores(q8, do8, sq, kr_base, vr_base, krs_base, vrs_base, keys, col_ok,
                        offs_d, shift, 0.0, BLOCK_D, MASKED, True, INTERPRET, ROW_SHIFT, False)
        p = tl.math.exp2(s - lse2do[:, None])
        if MASKED:
            vis = visible(row_ok[:, None] & col_ok[None, :], pos_q[:, None], offs_n[None, :], window,
                           CAUSAL, HAS_WINDOW)
            p = tl.where(vis, p, 0.0)
        pdp = p * dp
        l_i += tl.sum(p, 1)
        u_i += tl.sum(pdp, 1)
        if DS_HEAD:
            w_i = tl.maximum(w_i, abs_max(pdp, 1), propagate_nan=tl.PropagateNan.ALL)
            pmax_i = tl.maximum(pmax_i, tl.max(p, 1))
        if DEBUG:
            pabs_sum += tl.sum(tl.abs(pdp), 1)
        a8 = cast_saturating(pdp * a_inv[:, None], DS_MAX, DS_DTYPE, INTERPRET)
        pb8 = cast_saturating(p * pb_mul[:, None], 448.0, tl.float8e4nv, INTERPRET)
        kct = _cols_t(kct_base, keys, col_ok, offs_o, SK_PAD, MASKED)
        acc_a = tl.dot(_a_operand(a8, A_IN_PLACE), tl.trans(kct), acc_a, out_dtype=tl.float32)
        acc_b = tl.dot(_a_operand(pb8, A_IN_PLACE), tl.trans(kct), acc_b, out_dtype=tl.float32)
        a_sum += tl.sum(a8.to(tl.float32), 1)
        b_sum += tl.sum(pb8.to(tl.float32), 1)
    return acc_a, acc_b, a_sum, b_sum, l_i, u_i, w_i, pmax_i, pabs_sum


@triton.jit
def _dq_sweep(
    DQ, LSE2, LSE2DO, DELTA, DBG_DSSUM, DBG_PABS, DS_BOUND, lse2, q8, do8, sq, sdo, row_ok, stat_ok, pos_q, rows,
    stat_off, bh_q, seq, h, H, SQ_TOTAL, kr_base, vr_base, krs_base, vrs_base, kct_base, kcs_base, k_start, k_len,
    window, SK_PAD, shift, tau, t_lo, f_lo, f_hi, t_hi, o_ok,
    HEAD_D: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, DEBUG: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, DS_DTYPE: tl.constexpr,
    DS_MAX: tl.constexpr, INTERPRET: tl.constexpr, ROW_SHIFT: tl.constexpr, DS_HEAD: tl.constexpr,
    BLOCK_DO: tl.constexpr, A_IN_PLACE: tl.constexpr,
):
    """The statistics and dQ of one query tile in one sweep (``dq_in_stats``; bwd_dq_fp8_kernel's
    ONE_SWEEP): stores LSE2 = the forward's LSE (log2), LSE'^do, D' = u / l and, with DS_HEAD, folds
    the row bound max P'|dP'| + |D'| max P' into DS_BOUND as the statistics launch does; then
    dQ = τ · s_a (A − (Σ a / Σ b) B) · K's channel scales, where (Σ a / Σ b) is D' in code units,
    so the effective dS of dQ, fq(P dP) − D' P̂, sums to zero over each row."""
    lse2do = lse2 - tl.math.log2(sdo)
    offs_d = tl.arange(0, BLOCK_D)
    offs_o = _out_channels(offs_d, BLOCK_D, BLOCK_DO)
    # A's row scale: a power of two at or above ||dO_i|| sqrt(d) amax(V) / DS_MAX, which bounds
    # |P dP| before the sweep (sdo holds V's one scale too: amax(V) = 448 sv).
    dof = do8.to(tl.float32)
    root_d = tl.sqrt(tl.full([BLOCK_Q], HEAD_D, tl.float32))
    a_bound = tl.sqrt(tl.sum(dof * dof, 1)) * sdo * root_d * (448.0 / DS_MAX)
    a_scale = tl.where(a_bound > 0.0,
                       tl.math.exp2(tl.math.ceil(tl.math.log2(tl.where(a_bound > 0.0, a_bound, 1.0)))), 1.0)
    a_inv = tl.math.div_rn(tl.full([BLOCK_Q], 1.0, tl.float32), a_scale)
    pb_mul = tl.math.div_rn(tl.full([BLOCK_Q], 448.0, tl.float32), sdo)
    acc_a = tl.zeros([BLOCK_Q, BLOCK_DO], tl.float32)
    acc_b = tl.zeros([BLOCK_Q, BLOCK_DO], tl.float32)
    a_sum = tl.zeros([BLOCK_Q], tl.float32)
    b_sum = tl.zeros([BLOCK_Q], tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    u_i = tl.zeros([BLOCK_Q], tl.float32)
    w_i = tl.zeros([BLOCK_Q], tl.float32)
    pmax_i = tl.zeros([BLOCK_Q], tl.float32)
    pabs_sum = tl.zeros([BLOCK_Q], tl.float32)
    if HAS_WINDOW:
        acc_a, acc_b, a_sum, b_sum, l_i, u_i, w_i, pmax_i, pabs_sum = _dq_sweep_tiles(
            acc_a, acc_b, a_sum, b_sum, l_i, u_i, w_i, pmax_i, pabs_sum, q8, do8, sq, lse2do, a_inv, pb_mul, row_ok,
            pos_q, kr_base, vr_base, krs_base, vrs_base, kct_base, k_start, k_len, window, SK_PAD, shift, t_lo, f_lo,
            True, CAUSAL, HAS_WINDOW, DEBUG, BLOCK_K, BLOCK_D, DS_DTYPE, DS_MAX, INTERPRET, ROW_SHIFT, DS_HEAD,
            BLOCK_DO, A_IN_PLACE)
    acc_a, acc_b, a_sum, b_sum, l_i, u_i, w_i, pmax_i, pabs_sum = _dq_sweep_tiles(
        acc_a, acc_b, a_sum, b_sum, l_i, u_i, w_i, pmax_i, pabs_sum, q8, do8, sq, lse2do, a_inv, pb_mul, row_ok,
        pos_q, kr_base, vr_base, krs_base, vrs_base, kct_base, k_start, k_len, window, SK_PAD, shift, f_lo, f_hi,
        False, CAUSAL, HAS_WINDOW, DEBUG, BLOCK_K, BLOCK_D, DS_DTYPE, DS_MAX, INTERPRET, ROW_SHIFT, DS_HEAD,
        BLOCK_DO, A_IN_PLACE)
    if CAUSAL or HAS_WINDOW or not ALIGNED:
        acc_a, acc_b, a_sum, b_sum, l_i, u_i, w_i, pmax_i, pabs_sum = _dq_sweep_tiles(
            acc_a, acc_b, a_sum, b_sum, l_i, u_i, w_i, pmax_i, pabs_sum, q8, do8, sq, lse2do, a_inv, pb_mul, row_ok,
            pos_q, kr_base, vr_base, krs_base, vrs_base, kct_base, k_start, k_len, window, SK_PAD, shift, f_hi, t_hi,
            True, CAUSAL, HAS_WINDOW, DEBUG, BLOCK_K, BLOCK_D, DS_DTYPE, DS_MAX, INTERPRET, ROW_SHIFT, DS_HEAD,
            BLOCK_DO, A_IN_PLACE)
    empty = l_i == 0.0
    delta_do = tl.where(empty, 0.0, u_i / tl.where(empty, 1.0, l_i))  # Σ P'dP' / Σ P' = D / sdo
    tl.store(LSE2 + stat_off, lse2, mask=stat_ok)
    tl.store(LSE2DO + stat_off, lse2do, mask=stat_ok)
    tl.store(DELTA + stat_off, delta_do, mask=stat_ok)
    if DS_HEAD:
        bound = tl.where(empty, 0.0, w_i + tl.abs(delta_do) * pmax_i)
        bits = tl.where(bound != bound, 0x7FFFFFFF, bound.to(tl.int32, bitcast=True))  # NaN as the largest
        tl.atomic_max(DS_BOUND + seq * H + h, tl.max(tl.where(stat_ok, bits, 0), 0))
    # A row whose P̂ codes all round to 0 (uniform weight over ~2^17 keys or more) keeps A alone.
    ratio = tl.where(b_sum > 0.0, a_sum / tl.where(b_sum > 0.0, b_sum, 1.0), 0.0)
    dq = (acc_a - ratio[:, None] * acc_b) * a_scale[:, None]
    dq = dq * tl.load(kcs_base + offs_o)[None, :] * tau
    dq_ptrs = DQ + bh_q * SQ_TOTAL * HEAD_D + rows[:, None].to(tl.int64) * HEAD_D + offs_o[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & o_ok[None, :])
    if DEBUG:  # Σ_j of dQ's effective dS in real units, and Σ_j P|dP|
        tl.store(DBG_DSSUM + stat_off, (a_sum - ratio * b_sum) * a_scale, mask=stat_ok)
        tl.store(DBG_PABS + stat_off, pabs_sum, mask=stat_ok)


@triton.jit
def bwd_dq_fp8_kernel(
    QR, QRS, KR, KRS, KCT, KCS, VR, VRS, DOR, DORS,  # quantized operands and their scales
    DO, O, LSE, DQ, LSE2, LSE2DO, DELTA, DBG_DSSUM, DBG_PABS,
    CU_Q, CU_K, TOFF_K, SHIFT, SINKS, DS_BOUND,
    sdob, sdoh, sdos, sdod, sob, soh, sos, sod, slb, slh, sls,
    H, G, SQ_TOTAL, SK_TOTAL, SK_PAD, NT_K, SQ, SK, window, qk_scale, tau, softcap,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    MATCHED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, VARLEN: tl.constexpr,
    DEBUG: tl.constexpr, POW2: tl.constexpr, DS_DTYPE: tl.constexpr, DS_MAX: tl.constexpr,
    INTERPRET: tl.constexpr, STATS: tl.constexpr, GRADS: tl.constexpr, ALIGNED: tl.constexpr,
    KV_HEAD: tl.constexpr, COL_SEQ: tl.constexpr, SOFTCAP: tl.constexpr, ROW_SHIFT: tl.constexpr,
    SINK: tl.constexpr, DS_HEAD: tl.constexpr, ONE_SWEEP: tl.constexpr,
    BLOCK_DO: tl.constexpr, A_IN_PLACE: tl.constexpr = False,
):
    """LSE' (log2 units), LSE'^do, D' and dQ = τ Σ_j dS_ij K_j for one query tile of one query head
    (BLOCK_DO < BLOCK_D: for dQ's channel block program_id(2); the statistics are then every
    block's, stored by block 0).

    KV_HEAD (one K and one V scale per (sequence, head)): K's joins sq and V's joins dO's row
    scale sdo, so LSE'^do and D' are formed for dP'' = dP / (sdo · sv) and no logit or dP element is
    scaled per key. COL_SEQ: K's channel scales are the sequence's, applied to dQ once at the end.

    STATS: form LSE', LSE'^do = LSE' − log2 sdo and D' = D / sdo and store them (LSE2, LSE2DO,
    DELTA); GRADS: form and store dQ. Matched, they may run as two launches (STATS only, then GRADS
    only, reading LSE'^do and D' back): the statistics pass then holds no dQ operands in shared
    memory, so more programs fit on an SM (LAUNCH["split_dq_stats"]).

    ALIGNED (dense launch, SQ a multiple of BLOCK_Q and SK of BLOCK_K): no tile is partial, so the
    trailing boundary loop is compiled only for the causal diagonal or a window, and the leading one
    only for a window (it is empty otherwise): its prologue would run in every program.

    SOFTCAP / ROW_SHIFT / SINK: the logit modifiers (module docstring): ``softcap`` c₂, ``SHIFT``
    (B·Hq, Sq) the row constants, ``SINKS`` (Hq,) σ₂, all log2 units.

    DS_HEAD (ds_scales "head"): the statistics launch (STATS without GRADS; matched or stale: the
    stale delta then runs the statistics loop for the bound alone) folds each row's dS bound
    (:func:`ds_row_bound`) into ``DS_BOUND`` (n_seq·H,) int32 by an atomic max of its fp32 bits
    (non-negative, NaN as 0x7FFFFFFF: order-independent, so deterministic); the GRADS launch
    quantizes dS with that one scale per (sequence, head) and accumulates dQ in place.

    ONE_SWEEP (``dq_in_stats``; with STATS, GRADS, MATCHED, KV_HEAD and COL_SEQ, no soft-cap or
    sink): the statistics and dQ in one sweep over the keys from the forward's LSE (:func:`_dq_sweep`).

    A_IN_PLACE (dense batches, SK a multiple of 16): ``KCT`` holds each aligned 16 keys in
    :func:`.quantize.pv_token_order`'s order, and dS's codes are taken to dQ in that order
    (:func:`_a_operand`)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    seq = pid_bh // H
    h = pid_bh % H
    hk = h // G
    HKV = H // G
    batch, q_start, q_len, k_start, k_len = seq_bounds(seq, CU_Q, CU_K, SQ, SK, VARLEN)
    m0 = pid_m * BLOCK_Q
    if m0 >= q_len:
        return
    offs_m = m0 + tl.arange(0, BLOCK_Q)
    row_ok = offs_m < q_len
    pos_q = offs_m + (k_len - q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    rows = q_start + offs_m
    offs_o = _out_channels(offs_d, BLOCK_D, BLOCK_DO)
    if BLOCK_DO == BLOCK_D:
        o_ok = d_ok
        stat_ok = row_ok
    else:
        o_ok = offs_o < HEAD_D
        # (compared per row: the interpreter cannot mask with a scalar condition and-ed in)
        stat_ok = row_ok & (offs_m * 0 + tl.program_id(2) == 0)

    bh_q = (batch * H + h).to(tl.int64)
    bh_k = (batch * HKV + hk).to(tl.int64)
    q8 = _rows(QR + bh_q * SQ_TOTAL * BLOCK_D, rows, row_ok, offs_d, BLOCK_D, True)
    do8 = _rows(DOR + bh_q * SQ_TOTAL * BLOCK_D, rows, row_ok, offs_d, BLOCK_D, True)
    sq = tl.load(QRS + bh_q * SQ_TOTAL + rows, mask=row_ok, other=1.0) * qk_scale
    sdo = tl.load(DORS + bh_q * SQ_TOTAL + rows, mask=row_ok, other=1.0)
    if KV_HEAD:
        has_keys = k_len > 0
        sq = sq * tl.load(KRS + bh_k * SK_TOTAL + k_start, mask=has_keys, other=1.0)
        sdo = sdo * tl.load(VRS + bh_k * SK_TOTAL + k_start, mask=has_keys, other=1.0)
    kr_base = KR + bh_k * SK_TOTAL * BLOCK_D
    vr_base = VR + bh_k * SK_TOTAL * BLOCK_D
    krs_base = KRS + bh_k * SK_TOTAL
    vrs_base = VRS + bh_k * SK_TOTAL
    kct_base = KCT + bh_k * BLOCK_D * SK_PAD
    kcs_base = KCS + (bh_k * NT_K + tile_slot(seq, 0, TOFF_K, VARLEN)) * BLOCK_D
    # Both loops visit key tiles in order: leading boundary tiles (window edge), interior tiles
    # (no mask work), trailing boundary tiles (causal diagonal, window edge, sequence end).
    t_lo, f_lo, f_hi, t_hi = key_tiles(m0, q_len, k_len, window, BLOCK_Q, BLOCK_K, CAUSAL, HAS_WINDOW)

    stat_off = bh_q * SQ_TOTAL + rows
    shift = 0.0  # read only with ROW_SHIFT
    if ROW_SHIFT:
        shift = tl.load(SHIFT + stat_off, mask=row_ok, other=0.0)
    if ONE_SWEEP:
        lse2 = tl.load(LSE + batch.to(tl.int64) * slb + h.to(tl.int64) * slh + rows * sls,
                       mask=row_ok, other=float("-inf")) * LOG2E_C
        _dq_sweep(DQ, LSE2, LSE2DO, DELTA, DBG_DSSUM, DBG_PABS, DS_BOUND, lse2, q8, do8, sq, sdo, row_ok, stat_ok,
                  pos_q, rows, stat_off, bh_q, seq, h, H, SQ_TOTAL, kr_base, vr_base, krs_base, vrs_base, kct_base,
                  kcs_base, k_start, k_len, window, SK_PAD, shift, tau, t_lo, f_lo, f_hi, t_hi, o_ok,
                  HEAD_D, CAUSAL, HAS_WINDOW, DEBUG, ALIGNED, BLOCK_Q, BLOCK_K, BLOCK_D, DS_DTYPE, DS_MAX,
                  INTERPRET, ROW_SHIFT, DS_HEAD, BLOCK_DO, A_IN_PLACE)
        return
    if (MATCHED or DS_HEAD) and not STATS:  # a statistics launch ran first
        lse2do = tl.load(LSE2DO + stat_off, mask=row_ok, other=float("-inf"))
        delta_do = tl.load(DELTA + stat_off, mask=row_ok, other=0.0)
    else:
        if MATCHED or DS_HEAD:
            m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_Q], tl.float32)
            u_i = tl.zeros([BLOCK_Q], tl.float32)
            w_i = tl.zeros([BLOCK_Q], tl.float32)
            if SINK:  # the sink's term 2^(σ₂ − m) = 1 starts the normaliser; it adds nothing to u (dP = 0)
                m_i = tl.zeros([BLOCK_Q], tl.float32) + tl.load(SINKS + h)
                l_i = l_i + 1.0
            if HAS_WINDOW:
                m_i, l_i, u_i, w_i = _dq_stats_tiles(m_i, l_i, u_i, w_i, q8, do8, sq, row_ok, pos_q,
                                                     kr_base, vr_base, krs_base, vrs_base, k_start, k_len, window,
                                                     shift, softcap, t_lo, f_lo, True, CAUSAL, HAS_WINDOW, BLOCK_K,
                                                     BLOCK_D, KV_HEAD, INTERPRET, ROW_SHIFT, SOFTCAP, DS_HEAD)
            m_i, l_i, u_i, w_i = _dq_stats_tiles(m_i, l_i, u_i, w_i, q8, do8, sq, row_ok, pos_q,
                                                 kr_base, vr_base, krs_base, vrs_base, k_start, k_len, window,
                                                 shift, softcap, f_lo, f_hi, False, CAUSAL, HAS_WINDOW, BLOCK_K,
                                                 BLOCK_D, KV_HEAD, INTERPRET, ROW_SHIFT, SOFTCAP, DS_HEAD)
            if CAUSAL or HAS_WINDOW or not ALIGNED:
                m_i, l_i, u_i, w_i = _dq_stats_tiles(m_i, l_i, u_i, w_i, q8, do8, sq, row_ok, pos_q,
                                                     kr_base, vr_base, krs_base, vrs_base, k_start, k_len, window,
                                                     shift, softcap, f_hi, t_hi, True, CAUSAL, HAS_WINDOW, BLOCK_K,
                                                     BLOCK_D, KV_HEAD, INTERPRET, ROW_SHIFT, SOFTCAP, DS_HEAD)
        if MATCHED:
            empty = l_i == 0.0
            lse2 = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
            delta_do = tl.where(empty, 0.0, u_i / tl.where(empty, 1.0, l_i))  # u sums P dP': D' directly
        else:
            lse2 = tl.load(LSE + batch.to(tl.int64) * slb + h.to(tl.int64) * slh + rows * sls,
                           mask=row_ok, other=float("-inf")) * LOG2E_C
            dmask = row_ok[:, None] & d_ok[None, :]
            do_ptr = DO + batch.to(tl.int64) * sdob + h.to(tl.int64) * sdoh + rows[:, None].to(tl.int64) * sdos + offs_d[None, :] * sdod
            o_ptr = O + batch.to(tl.int64) * sob + h.to(tl.int64) * soh + rows[:, None].to(tl.int64) * sos + offs_d[None, :] * sod
            delta = tl.sum(tl.load(do_ptr, mask=dmask, other=0.0).to(tl.float32)
                           * tl.load(o_ptr, mask=dmask, other=0.0).to(tl.float32), 1)
            delta_do = tl.math.div_rn(delta, sdo)
        lse2do = lse2 - tl.math.log2(sdo)
        if DS_HEAD:
            bound = ds_row_bound(m_i, l_i, w_i, lse2do, delta_do)
            bits = tl.where(bound != bound, 0x7FFFFFFF, bound.to(tl.int32, bitcast=True))  # NaN as the largest
            tl.atomic_max(DS_BOUND + seq * H + h, tl.max(tl.where(stat_ok, bits, 0), 0))
    if STATS:
        tl.store(LSE2 + stat_off, lse2, mask=stat_ok)
        tl.store(LSE2DO + stat_off, lse2do, mask=stat_ok)
        tl.store(DELTA + stat_off, delta_do, mask=stat_ok)
    if not GRADS:
        return

    ds_scale = 1.0  # DS_HEAD: dS's one scale (and ds_inv its reciprocal) for this (sequence, head)
    ds_inv = 1.0
    if DS_HEAD:
        ds_scale, ds_inv = ds_head_scale(DS_BOUND, seq, h, H, DS_MAX, POW2)
    dq = tl.zeros([BLOCK_Q, BLOCK_DO], tl.float32)
    ds_sum = tl.zeros([BLOCK_Q], tl.float32)  # DEBUG row sums (unused, and compiled away, otherwise)
    pabs_sum = tl.zeros([BLOCK_Q], tl.float32)
    if HAS_WINDOW:
        dq, ds_sum, pabs_sum = _dq_tiles(dq, ds_sum, pabs_sum, q8, do8, sq, lse2do, delta_do, ds_inv, row_ok, pos_q,
                                         kr_base, vr_base, krs_base, vrs_base, kct_base, kcs_base, k_start, k_len,
                                         window, SK_PAD, shift, softcap, t_lo, f_lo, True, CAUSAL, HAS_WINDOW, DEBUG,
                                         BLOCK_K, BLOCK_D, POW2, DS_DTYPE, DS_MAX, INTERPRET, KV_HEAD, COL_SEQ,
                                         ROW_SHIFT, SOFTCAP, DS_HEAD, BLOCK_DO, A_IN_PLACE)
    dq, ds_sum, pabs_sum = _dq_tiles(dq, ds_sum, pabs_sum, q8, do8, sq, lse2do, delta_do, ds_inv, row_ok, pos_q,
                                     kr_base, vr_base, krs_base, vrs_base, kct_base, kcs_base, k_start, k_len,
                                     window, SK_PAD, shift, softcap, f_lo, f_hi, False, CAUSAL, HAS_WINDOW, DEBUG,
                                     BLOCK_K, BLOCK_D, POW2, DS_DTYPE, DS_MAX, INTERPRET, KV_HEAD, COL_SEQ,
                                     ROW_SHIFT, SOFTCAP, DS_HEAD, BLOCK_DO, A_IN_PLACE)
    if CAUSAL or HAS_WINDOW or not ALIGNED:
        dq, ds_sum, pabs_sum = _dq_tiles(dq, ds_sum, pabs_sum, q8, do8, sq, lse2do, delta_do, ds_inv, row_ok, pos_q,
                                         kr_base, vr_base, krs_base, vrs_base, kct_base, kcs_base, k_start, k_len,
                                         window, SK_PAD, shift, softcap, f_hi, t_hi, True, CAUSAL, HAS_WINDOW, DEBUG,
                                         BLOCK_K, BLOCK_D, POW2, DS_DTYPE, DS_MAX, INTERPRET, KV_HEAD, COL_SEQ,
                                         ROW_SHIFT, SOFTCAP, DS_HEAD, BLOCK_DO, A_IN_PLACE)
    if DS_HEAD:
        dq = dq * ds_scale
    if COL_SEQ:
        dq = dq * tl.load(kcs_base + offs_o)[None, :]
    dq = dq * tau
    dq_ptrs = DQ + bh_q * SQ_TOTAL * HEAD_D + rows[:, None].to(tl.int64) * HEAD_D + offs_o[None, :]
    tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & o_ok[None, :])
    if DEBUG:
        tl.store(DBG_DSSUM + stat_off, ds_sum, mask=stat_ok)
        tl.store(DBG_PABS + stat_off, pabs_sum, mask=stat_ok)


@triton.jit
def _dkdv_tiles(
    dk, dv, k8, v8, sk, sv, ds_scale, ds_inv, sq_head, sdo_head, col_ok, offs_n,
    qr_base, dor_base, qrs_base, dors_base, lse2_base, lse2do_base, delta_base, qct_base, doct_base, qcs_base,
    docs_base, q_start, q_len, shift, window, SQ_PAD, rshift_base, cap, t_lo, t_hi,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, POW2: tl.constexpr, DS_DTYPE: tl.constexpr,
    DS_MAX: tl.constexpr, INTERPRET: tl.constexpr, COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr,
    KV_HEAD: tl.constexpr, COL_SEQ: tl.constexpr, P_FIXED: tl.constexpr, ROW_SHIFT: tl.constexpr,
    SOFTCAP: tl.constexpr, DS_HEAD: tl.constexpr, QDO_HEAD: tl.constexpr,
    BLOCK_DO: tl.constexpr, A_IN_PLACE: tl.constexpr,
):
    """Add query tiles t_lo <= t < t_hi of one query head to one key tile's dK (before the factor τ)
    and dV, both (BLOCK_K, BLOCK_DO) (the channels of :func:`_out_channels`; Sᵀ and dPᵀ contract over
    all BLOCK_D), in transposed tiles (BLOCK_K, BLOCK_Q). Masks only if MASKED.
    COMPUTE_DK / COMPUTE_DV: which of the two to form (dV alone needs neither dPᵀ nor dO's
    row-wise codes; dK alone does not quantize Pᵀ).
    The ``*_base`` pointers are the query head's (``lse2_base``: LSE' for dV's P; ``lse2do_base`` and
    ``delta_base``: LSE'^do and D' for dK's dS, see the module docstring); ``qcs_base`` /
    ``docs_base`` point at the sequence's first query tile of the channel-wise scales.
    KV_HEAD: ``sk`` is K's one scale (a scalar, τ·log2 e included) and V's scale is in LSE'^do and
    D' (see the dQ kernel). COL_SEQ: Q's and dO's channel scales are the sequence's; the caller
    applies them per query head. P_FIXED: dV's P is cast as fp8(448 · P), its 1/448 applied by the
    caller. ``shift`` is the queries' position offset k_len − q_len; ROW_SHIFT / SOFTCAP: Sᵀ with the
    row constants at ``rshift_base`` (the query head's) added back and capped at ``cap``.
    DS_HEAD: dS is cast with ``ds_inv``, the reciprocal of the query head's one scale ``ds_scale``;
    with COL_SEQ the caller applies that scale (dK and dV then accumulate in the MMA, no rescale per
    tile), else it joins each tile's channel scales.

    One exponential per element where both gradients are formed on the fixed grid (COMPUTE_DK,
    COMPUTE_DV and P_FIXED): dS's P'ᵀ = Pᵀ · sdo is (448·Pᵀ) · sdo/448, so dSᵀ is formed from dV's
    448·Pᵀ and the per-query factor sdo/448 (``dors_base``: dO's row scales, times V's one scale
    ``sv`` with KV_HEAD) joins dS's reciprocal scale instead of a second exp2 over the tile (the
    exp2 unit, 16 results per clock and SM, was as busy as the FP8 MMAs here). QDO_HEAD: Q's and
    dO's row scales are one per (sequence, head), ``sq_head`` and ``sdo_head`` (dO's times sv),
    read once by the caller instead of per query tile."""
    offs_m0 = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    offs_o = _out_channels(offs_d, BLOCK_D, BLOCK_DO)
    for t in range(t_lo, t_hi):
        offs_m = t * BLOCK_Q + offs_m0
        row_ok = offs_m < q_len  # read only if MASKED
        rows = q_start + offs_m
        q8 = _rows(qr_base, rows, row_ok, offs_d, BLOCK_D, MASKED)
        # per-query values (1, BLOCK_Q) of the transposed tiles, or one scalar with QDO_HEAD
        if QDO_HEAD:
            sq = sq_head
        else:
            sq = _vec(qrs_base + rows, row_ok, 1.0, MASKED)[None, :]
        # transposed tiles (BLOCK_K, BLOCK_Q): Sᵀ = K Qᵀ, and dP'ᵀ = V dOᵀ for dK
        if KV_HEAD:
            st = tl.dot(k8, tl.trans(q8), out_dtype=tl.float32) * (sq * sk)
        else:
            st = tl.dot(k8, tl.trans(q8), out_dtype=tl.float32) * sk[:, None] * sq
        rshift = 0.0  # read only with ROW_SHIFT
        if ROW_SHIFT:
            rshift = _vec(rshift_base + rows, row_ok, 0.0, MASKED)
        st = modify_logits(st, rshift, cap, ROW_SHIFT, SOFTCAP, 1)
        if MASKED:
            vis = visible(col_ok[:, None] & row_ok[None, :], (offs_m + shift)[None, :], offs_n[:, None], window,
                           CAUSAL, HAS_WINDOW)
        if COMPUTE_DV:
            lse2 = _vec(lse2_base + rows, row_ok, float("-inf"), MASKED)
            if P_FIXED:
                lse2 = lse2 - 8.807354922057604  # log2(448): Pᵀ comes out as 448·Pᵀ, on fp8's grid below
            pt = tl.math.exp2(st - lse2[None, :])
            if MASKED:
                pt = tl.where(vis, pt, 0.0)
        if COMPUTE_DK:
            do8 = _rows(dor_base, rows, row_ok, offs_d, BLOCK_D, MASKED)
            if KV_HEAD:
                dpt = tl.dot(v8, tl.trans(do8), out_dtype=tl.float32)
            else:
                dpt = mul_rounded(tl.dot(v8, tl.trans(do8), out_dtype=tl.float32), sv[:, None], INTERPRET)  # see _scores
            delta = _vec(delta_base + rows, row_ok, 0.0, MASKED)
            if COMPUTE_DV and P_FIXED:
                # dSᵀ · 448/sdo from dV's 448·Pᵀ; ds_mul below carries sdo/448 (one exp2 per element)
                dst = pt * (dpt - delta[None, :])
                if QDO_HEAD:
                    sdo = sdo_head
                else:
                    sdo = _vec(dors_base + rows, row_ok, 1.0, MASKED)[None, :]
                    if KV_HEAD:
                        sdo = sdo * sv
                ds_mul = sdo * (1.0 / 448.0)
                if not DS_HEAD:  # per-tile dS scales: the factor goes in before their amax
                    dst = dst * ds_mul
            else:
                lse2do = _vec(lse2do_base + rows, row_ok, float("-inf"), MASKED)
                ptdo = tl.math.exp2(st - lse2do[None, :])  # P'ᵀ = Pᵀ · sdo
                if MASKED:
                    ptdo = tl.where(vis, ptdo, 0.0)
                dst = ptdo * (dpt - delta[None, :])
                ds_mul = 1.0
            if SOFTCAP:
                dst = dst * cap_slope(st, cap)  # dS̃ᵀ -> dSᵀ (Sᵀ is finite here: the mask is on P)
        if COMPUTE_DV:
            doct = _cols_t(doct_base, rows, row_ok, offs_o, SQ_PAD, MASKED)
            # B3: P per column of the query tile (= per row of Pᵀ) or on the fixed grid; dO per
            # channel within the tile, or the sequence's channel scales (applied by the caller).
            if P_FIXED and COL_SEQ:
                p8 = _a_operand(cast_saturating(pt, 448.0, tl.float8e4nv, INTERPRET), A_IN_PLACE)
                dv = tl.dot(p8, tl.trans(doct), dv, out_dtype=tl.float32)
            else:
                if P_FIXED:
                    p8 = _a_operand(cast_saturating(pt, 448.0, tl.float8e4nv, INTERPRET), A_IN_PLACE)
                    pv = tl.dot(p8, tl.trans(doct), out_dtype=tl.float32)
                else:
                    p8, sp = _quant_tile(pt, 1, 448.0, POW2, tl.float8e4nv, INTERPRET)
                    pv = tl.dot(_a_operand(p8, A_IN_PLACE), tl.trans(doct), out_dtype=tl.float32) * sp[:, None]
                if COL_SEQ:
                    dv += pv
                else:
                    dv += pv * tl.load(docs_base + t * BLOCK_D + offs_o)[None, :]
        if COMPUTE_DK:
            # B5: dS per column of the query tile or per head, Q per channel within the tile or per
            # sequence.
            qct = _cols_t(qct_base, rows, row_ok, offs_o, SQ_PAD, MASKED)
            if DS_HEAD:
                ds8 = _a_operand(cast_saturating(dst * (ds_mul * ds_inv), DS_MAX, DS_DTYPE, INTERPRET), A_IN_PLACE)
                if COL_SEQ:
                    dk = tl.dot(ds8, tl.trans(qct), dk, out_dtype=tl.float32)
                else:
                    sqc = tl.load(qcs_base + t * BLOCK_D + offs_o) * ds_scale
                    dk += tl.dot(ds8, tl.trans(qct), out_dtype=tl.float32) * sqc[None, :]
            else:
                ds8, sds = _quant_tile(dst, 1, DS_MAX, POW2, DS_DTYPE, INTERPRET)
                ds8 = _a_operand(ds8, A_IN_PLACE)
                if COL_SEQ:
                    dk += tl.dot(ds8, tl.trans(qct), out_dtype=tl.float32) * sds[:, None]
                else:
                    sqc = tl.load(qcs_base + t * BLOCK_D + offs_o)
                    dk += tl.dot(ds8, tl.trans(qct), out_dtype=tl.float32) * sds[:, None] * sqc[None, :]
    return dk, dv


@triton.jit
def bwd_dkdv_fp8_kernel(
    QR, QRS, QCT, QCS, KR, KRS, VR, VRS, DOR, DORS, DOCT, DOCS,
    LSE2, LSE2DO, DELTA, DK, DV,
    CU_Q, CU_K, TOFF_Q, SHIFT, DS_BOUND,
    H, G, SQ_TOTAL, SK_TOTAL, SQ_PAD, NT_Q, SQ, SK, window, qk_scale, tau, softcap,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, VARLEN: tl.constexpr, POW2: tl.constexpr,
    DS_DTYPE: tl.constexpr, DS_MAX: tl.constexpr, INTERPRET: tl.constexpr,
    COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr, ALIGNED: tl.constexpr,
    KV_HEAD: tl.constexpr, COL_SEQ: tl.constexpr, P_FIXED: tl.constexpr, SOFTCAP: tl.constexpr,
    ROW_SHIFT: tl.constexpr, DS_HEAD: tl.constexpr, QDO_HEAD: tl.constexpr,
    BLOCK_DO: tl.constexpr, A_IN_PLACE: tl.constexpr = False,
):
    """dK = τ Σ_g Σ_i dS_ij Q_i and/or dV = Σ_g Σ_i P_ij dO_i (COMPUTE_DK / COMPUTE_DV) for one key
    tile of one kv head (transposed tiles). Forming them in two launches recomputes Sᵀ once more but
    holds one accumulator instead of two (see LAUNCH["split_dkdv"] in backward.py). BLOCK_DO <
    BLOCK_D: the channel block program_id(2) of both (:func:`_out_channels`).

    ALIGNED (as in the dQ kernel): the leading boundary loop is compiled only for the causal
    diagonal or a window, the trailing one only for a window.

    COL_SEQ: each query head's channel scales of Q (dK) and dO (dV) are constant over the sequence,
    so its products accumulate unscaled: before head g the accumulator is multiplied by
    c_{g-1} / c_g (1 for g = 0), and by the last head's c once at the end, which gives
    Σ_g c_g · (head g's products) with one rescale per head instead of one per tile.

    DS_HEAD: dS takes each query head's one scale (``DS_BOUND``, see the dQ kernel), which joins
    that head's rescale of dK (COL_SEQ: c_g is then Q's channel scales times dS's scale) or, with
    per-tile channel scales, each tile's channel scales.

    SOFTCAP / ROW_SHIFT: as in the dQ kernel (``SHIFT`` (B·Hq, Sq), ``softcap`` c₂); the sinks are
    in LSE' and LSE'^do already.

    QDO_HEAD: Q's and dO's row scales (``QRS``, ``DORS`` (B·Hq, Sq)) are one per (sequence, head),
    read once per query head. ``DORS`` is read only by the one-exponential form of
    :func:`_dkdv_tiles` (dK and dV together on the fixed grid).

    A_IN_PLACE (dense batches, SQ a multiple of 16): ``QCT`` and ``DOCT`` hold each aligned 16
    queries in :func:`.quantize.pv_token_order`'s order, and Pᵀ's and dSᵀ's codes are taken to dV
    and dK in that order (:func:`_a_operand`)."""
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
    keys = k_start + offs_n
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_D
    shift = k_len - q_len
    offs_o = _out_channels(offs_d, BLOCK_D, BLOCK_DO)
    if BLOCK_DO == BLOCK_D:
        o_ok = d_ok
    else:
        o_ok = offs_o < HEAD_D

    bh_k = (batch * HKV + hk).to(tl.int64)
    k8 = _rows(KR + bh_k * SK_TOTAL * BLOCK_D, keys, col_ok, offs_d, BLOCK_D, True)
    v8 = _rows(VR + bh_k * SK_TOTAL * BLOCK_D, keys, col_ok, offs_d, BLOCK_D, True)
    if KV_HEAD:  # one scale per (sequence, head); V's is in LSE'^do and D' (sv: for dS's factor)
        sk = tl.load(KRS + bh_k * SK_TOTAL + k_start) * qk_scale
        sv = tl.load(VRS + bh_k * SK_TOTAL + k_start)
    else:
        sk = tl.load(KRS + bh_k * SK_TOTAL + keys, mask=col_ok, other=1.0) * qk_scale
        sv = tl.load(VRS + bh_k * SK_TOTAL + keys, mask=col_ok, other=1.0)
    # Per query head, query tiles in order: leading boundary tiles (causal diagonal, window edge),
    # interior tiles (no mask work), trailing boundary tiles (window edge, sequence end).
    t_lo, f_lo, f_hi, t_hi = query_tiles(n0, q_len, k_len, window, BLOCK_Q, BLOCK_K, CAUSAL, HAS_WINDOW)
    slot0 = tile_slot(seq, 0, TOFF_Q, VARLEN)

    dk = tl.zeros([BLOCK_K, BLOCK_DO], tl.float32)
    dv = tl.zeros([BLOCK_K, BLOCK_DO], tl.float32)
    one = tl.full([BLOCK_DO], 1.0, tl.float32)
    c_q = one  # COL_SEQ: the current query head's channel scales of Q and dO
    c_do = one
    for g in range(0, G):
        bh_q = (batch * H + hk * G + g).to(tl.int64)
        qr_base = QR + bh_q * SQ_TOTAL * BLOCK_D
        dor_base = DOR + bh_q * SQ_TOTAL * BLOCK_D
        qrs_base = QRS + bh_q * SQ_TOTAL
        lse2_base = LSE2 + bh_q * SQ_TOTAL
        lse2do_base = LSE2DO + bh_q * SQ_TOTAL
        delta_base = DELTA + bh_q * SQ_TOTAL
        rshift_base = SHIFT + bh_q * SQ_TOTAL
        qct_base = QCT + bh_q * BLOCK_D * SQ_PAD
        doct_base = DOCT + bh_q * BLOCK_D * SQ_PAD
        qcs_base = QCS + (bh_q * NT_Q + slot0) * BLOCK_D
        docs_base = DOCS + (bh_q * NT_Q + slot0) * BLOCK_D
        dors_base = DORS + bh_q * SQ_TOTAL
        ds_inv = 1.0  # DS_HEAD: the reciprocal of head g's dS scale
        ds_scale = 1.0
        sq_head = 1.0  # QDO_HEAD: Q's and dO's (times V's with KV_HEAD) one row scale for head g
        sdo_head = 1.0
        if QDO_HEAD:
            has_q = q_len > 0
            sq_head = tl.load(qrs_base + q_start, mask=has_q, other=1.0)
            sdo_head = tl.load(dors_base + q_start, mask=has_q, other=1.0)
            if KV_HEAD:
                sdo_head = sdo_head * sv
        if DS_HEAD and COMPUTE_DK:
            ds_scale, ds_inv = ds_head_scale(DS_BOUND, seq, hk * G + g, H, DS_MAX, POW2)
        if COL_SEQ:
            if COMPUTE_DK:
                c_new = tl.load(qcs_base + offs_o) * ds_scale
                dk = dk * tl.math.div_rn(c_q, c_new)[None, :]
                c_q = c_new
            if COMPUTE_DV:
                c_new = tl.load(docs_base + offs_o)
                dv = dv * tl.math.div_rn(c_do, c_new)[None, :]
                c_do = c_new
        if CAUSAL or HAS_WINDOW:
            dk, dv = _dkdv_tiles(dk, dv, k8, v8, sk, sv, ds_scale, ds_inv, sq_head, sdo_head, col_ok, offs_n, qr_base,
                                 dor_base, qrs_base, dors_base, lse2_base, lse2do_base, delta_base, qct_base,
                                 doct_base, qcs_base, docs_base,
                                 q_start, q_len, shift, window, SQ_PAD, rshift_base, softcap, t_lo, f_lo, True,
                                 CAUSAL, HAS_WINDOW, BLOCK_Q, BLOCK_D, POW2, DS_DTYPE, DS_MAX, INTERPRET,
                                 COMPUTE_DK, COMPUTE_DV, KV_HEAD, COL_SEQ, P_FIXED, ROW_SHIFT, SOFTCAP, DS_HEAD,
                                 QDO_HEAD, BLOCK_DO, A_IN_PLACE)
        dk, dv = _dkdv_tiles(dk, dv, k8, v8, sk, sv, ds_scale, ds_inv, sq_head, sdo_head, col_ok, offs_n, qr_base,
                             dor_base, qrs_base, dors_base, lse2_base, lse2do_base, delta_base, qct_base,
                             doct_base, qcs_base, docs_base,
                             q_start, q_len, shift, window, SQ_PAD, rshift_base, softcap, f_lo, f_hi, False,
                             CAUSAL, HAS_WINDOW, BLOCK_Q, BLOCK_D, POW2, DS_DTYPE, DS_MAX, INTERPRET,
                             COMPUTE_DK, COMPUTE_DV, KV_HEAD, COL_SEQ, P_FIXED, ROW_SHIFT, SOFTCAP, DS_HEAD,
                             QDO_HEAD, BLOCK_DO, A_IN_PLACE)
        if HAS_WINDOW or not ALIGNED:
            dk, dv = _dkdv_tiles(dk, dv, k8, v8, sk, sv, ds_scale, ds_inv, sq_head, sdo_head, col_ok, offs_n, qr_base,
                                 dor_base, qrs_base, dors_base, lse2_base, lse2do_base, delta_base, qct_base,
                                 doct_base, qcs_base, docs_base,
                                 q_start, q_len, shift, window, SQ_PAD, rshift_base, softcap, f_hi, t_hi, True,
                                 CAUSAL, HAS_WINDOW, BLOCK_Q, BLOCK_D, POW2, DS_DTYPE, DS_MAX, INTERPRET,
                                 COMPUTE_DK, COMPUTE_DV, KV_HEAD, COL_SEQ, P_FIXED, ROW_SHIFT, SOFTCAP, DS_HEAD,
                                 QDO_HEAD, BLOCK_DO, A_IN_PLACE)
    st_mask = col_ok[:, None] & o_ok[None, :]
    off = bh_k * SK_TOTAL * HEAD_D + keys[:, None].to(tl.int64) * HEAD_D + offs_o[None, :]
    if COL_SEQ:
        dk = dk * c_q[None, :]
        dv = dv * c_do[None, :]
    if P_FIXED:
        dv = dv * (1.0 / 448.0)
    if COMPUTE_DK:
        tl.store(DK + off, (dk * tau).to(DK.dtype.element_ty), mask=st_mask)
    if COMPUTE_DV:
        tl.store(DV + off, dv.to(DV.dtype.element_ty), mask=st_mask)
