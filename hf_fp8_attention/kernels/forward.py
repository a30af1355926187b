"""Triton FP8 attention forward: S = QKᵀ and O = PV as FP8 MMAs with fp32 accumulation.

Reference maths (what :func:`hf_fp8_attention.reference.emulated_forward` computes), per query row i
and key tile T of ``BLOCK_N = config.block_k`` keys (tiles start at each sequence's start)::

    Qc, sq = quant_row(Q H)          Kc, sk = quant_row(K H − μH)     (per token or per head, E4M3)
    Vc, sv = quant_col(V)            (per channel within each key tile, per channel of the
                                      sequence, or one per head: config.channel_scales)
    s_ij   = τ/b · (Qc Kcᵀ)_ij · sq_i · sk_j                (-inf where masked)

(H, μ, b: the rotation, the key mean and the rotation's block, with ``config.hadamard`` /
``config.smooth_k``; without them H = I, μ = 0, b = 1: :mod:`hf_fp8_attention.transforms`.)
    m_iT   = max_{j∈T} s_ij
    C_ij   = fp8(448 · exp(s_ij − m_iT))                  (P codes, independent of the running max)
    LSE_i  = log Σ_j exp(s_ij)
    O_i    = Σ_T exp(m_iT − LSE_i)/448 · Σ_{j∈T} C_ij · Vc_jc · sv_Tc

The kernel runs an online softmax in base 2 (τ·log2 e folded into the Q scale). Each tile's codes,
and acc and l, are kept relative to a per-row reference r_T, the tile's own max unless that lies
more than G = REF_SLACK below the running max m::

    m_new = max(m, m_T);  r_T = max(m_T, m_new − G);  γ = 2^(r_prev − r_T)
    C     = fp8(2^(s − r_T + log2 448))                   (= fp8(448·exp(s − m_T)) when r_T = m_T)
    l     = γ·l + Σ_j 2^(s_j − r_T + log2 448)
    acc   = γ·acc + (C @ Vc) · sv_T                       (one FMA per element after the γ scaling;
                                                           sequence-wide sv: acc = C @ Vc + γ·acc in
                                                           the MMA, sv applied to O once)
    O     = acc / l,  LSE = ln2 · (r_last + log2 l − log2 448)

m and r are held in the units of x = s / q2 (the row's logit before its factor q2 = τ·log2 e·sq),
and an exponent is (x − r_T)·q2 + log2 448: exactly log2 448 for the element that sets the
reference, at any magnitude of the logits. Formed from log2 units as one FMA, x·q2 − (r_T − log2 448),
the rounding of r_T moved the max's exponent past log2 448 beyond |s| ~ 1e6: a saturated code (448)
counted in l in full gave outputs of 0.70-0.97 instead of 1 at logits 8e6 and 7e7 on the H200. The
exact form costs one add per score (2-6% of the forward; benchmarks/NOTES.md).

Where r_T = m_T (every tile within 2^G of the running max) the codes C depend only on the tile's
own max, equal the emulation's up to the rounding of exp, and the kernel matches the emulation to
accumulation-order noise. Where r_T > m_T the tile's largest term is below 2^-G of the row's, and
its codes are formed relative to r_T instead of m_T (coarser, possibly zero): the tile's whole
weight, at most BLOCK_N·2^-G of the row (2^-25 for G = 32, under fp32 rounding), bounds the
difference. G also bounds acc and l at 2^G times their running-max values, so they overflow only
for |V| beyond ~1e21. Rows with no visible key give O = 0, LSE = -inf. Key tiles that no row of a
query tile can see are never visited; tiles fully visible to every row skip the mask arithmetic.

Logit modifiers (:mod:`.logit_mods`; constexprs, off: the code as without them), in x units
like m and r: ROW_SHIFT adds K-smoothing's row constant back (x + shift₂/q2) and SOFTCAP caps the
logits (x̃ = C·tanh(x/C) with C = c₂/q2 per row: the cap c₂ of the log2 units) before the row max;
SINK starts each row's running max and reference at the head's sink (σ₂/q2) and l at its term
(448·2^(σ − r) = 448, in p's units), so the sink joins l, and so O and LSE, like one more key
without a value. A row with no visible key then has O = 0 and LSE = σ.

Layouts: Q ``(B, Hq, Sq, D)`` any strides, quantized in-kernel per token (each Q tile is loaded
once), or, rotated or with per-head scales, Q's codes ``(B, Hq, Sq, DP)`` + scales ``(B, Hq, Sq)``
from the quantization kernel;
K codes ``(B, Hkv, Sk, DP)`` fp8 + scales ``(B, Hkv, Sk)``; Vᵀ codes ``(B, Hkv, DP, Sk_pad)`` fp8 +
scales ``(B, Hkv, NT, DP)`` (see :mod:`.quantize`). GQA: query head h reads kv head h // G.
"""
from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..config import FP8AttentionConfig, Granularity
from ..masking import MaskSpec, varlen_max_lengths
from .autotune import LaunchTuner
from .constants import LOG2E
from .exponent import fma_bound
from .launch import launch as launch_kernel
from .logit_mods import logit_mods, soft_cap
from .tiles import cdiv, check_compiled_blocks, has_tma, key_tile_range, next_pow2, sm_count, visible
from .quantize import (
    COMPILE_OPTIONS, abs_max, cast_meta, cvt_mode, fp8_cast, interpreting, mul_rounded, padded_head_dim,
    pv_order_fits, pv_token_order, quantize_operands, scale_from_amax, to_fp8,
)
from .operands import backward_kv_copies, backward_q_copies, copies_for, logit_factor, stats_for, stats_then_copies
from . import forward_gluon
from .backward import dq_keys_in_pv_order, takes_kv_copies
from .gluon_hopper import gluon_runs

# The block-free recipes' forward on Hopper: the warp-specialised Gluon kernel (forward_gluon.py) wherever
# it applies, at these head dims; elsewhere _fwd_kernel. The kernel is built for 64 too
# (forward_gluon.HEAD_DIMS), but there it took 1.08x this module's kernel's time at 2 x 8k tokens,
# non-causal, on the H100 (benchmarks/NOTES.md, "Forward"; benchmarks/gluon_variants.py's ``gluon_fwd``).
GLUON_FORWARD = (128, )

# With a backward ahead that takes them (backward.takes_kv_copies), the forward's K/V quantization
# launch also writes the backward's K channel-wise and V row-wise copies (B4, B2; its K row-wise copy
# is B1 already), handed over under for_backward["kv_copies"]: K and V are read once for both passes
# instead of again by the backward's K/V launch (116.5 us and 235 MB at 2 x 8k tokens on the H100;
# ~64 MB more written here). The eager autograd call then saves no 16-bit V (nor K without soft-cap
# and sinks). Off: 1-2% off a fwd+bwd on the H100, but no gain in the 0.89B Llama's training step at
# 8k (paired steps; benchmarks/NOTES.md, "Backward").
HAND_OVER_KV_COPIES = False

# G of the module docstring, log2 units: a key tile whose row max lies further below the running
# max is formed relative to (running max − G); its weight 2^-G·BLOCK_N is under fp32 rounding.
REF_SLACK = 32.0
# The Triton kernel takes P's codes to P·V in their accumulator's order (pv_token_order), Vᵀ's keys
# written to match (quantize.Copies.col_pv), on dense batches whose key length is a multiple of 16:
# offline (sm_90a, Triton 3.6, d = 64, 64 x 4 warps, causal) the interior loop 913 -> 880
# instructions (SHFL 24 -> 8, SEL 16 -> 0). On the H100 (d = 64, 16k tokens, CUDA graph) the forward
# took 0.965-0.980x the time, the same bits (benchmarks/NOTES.md, "Forward").
P_IN_PLACE_TRITON = True


@triton.jit
def _visit_tiles(
    acc, l_i, m_i, r_i, q_codes, q_scale2, slack_x, pos_q,
    k_base, ks_base, vt_base, vs_base, S_PAD, k_desc, vt_desc, k_row0, vt_row0, k_start,
    shift_x, cap_x, t_lo, t_hi, kv_len, window, fma,
    MASKED: tl.constexpr, TMA: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, LOG2_PMAX: tl.constexpr, P_DTYPE: tl.constexpr,
    P_MANT: tl.constexpr, P_SUB_MAGIC: tl.constexpr, P_SUB_MIN: tl.constexpr, CVT: tl.constexpr,
    KV_ALIGNED: tl.constexpr, K_HEAD: tl.constexpr, V_SEQ: tl.constexpr, INTERPRET: tl.constexpr,
    ROW_SHIFT: tl.constexpr, SOFTCAP: tl.constexpr, FMA_EXP: tl.constexpr, P_IN_PLACE: tl.constexpr = False,
):
    """Fold key tiles ``t_lo <= t < t_hi`` into the running (acc, l, m, r); mask only if MASKED.
    m and r are in the units of x (``slack_x`` = REF_SLACK / q2; module docstring). FMA_EXP: each
    exponent as one FMA from the log2 units (:mod:`.exponent`; K_HEAD without logit modifiers).
    P_IN_PLACE: Vᵀ's keys come in the order of ``quantize.pv_token_order`` and P's codes are put in
    that order before P·V.

    ROW_SHIFT / SOFTCAP: x with the row constants ``shift_x`` added back and capped at ``cap_x``
    (both (BLOCK_M,), x units; module docstring) before the mask and the row max.

    K_HEAD: K has one row scale per (sequence, head), folded into ``q_scale2`` by the caller, so
    the logits skip the per-key scale. V_SEQ: V's channel scales are the sequence's (the same in
    every key tile), applied once to O by the caller, so acc accumulates the raw P·V products.

    ``l`` and ``acc`` are kept relative to the reference r (module docstring) and in units of PMAX
    (448): the P codes are 2^(s − r_T + log2 448) directly, and the factor cancels in O = acc / l
    (the LSE subtracts ln 448 at the end).

    TMA (interior tiles of unpacked batches only): the K and Vᵀ code tiles come by TMA
    through ``k_desc`` (rows of K's codes, 2-D) and ``vt_desc`` (rows of Vᵀ's codes, 2-D) from row
    ``k_row0`` / ``vt_row0`` and key ``k_start``: no per-thread addresses, fewer instructions and
    registers than pointer loads. Boundary tiles keep masked pointer loads (zeros past the sequence),
    except with KV_ALIGNED (dense launch, Sk a multiple of BLOCK_N): no tile reaches past the
    sequence, so masked tiles load like interior ones and are masked by position only.
    """
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for t in range(t_lo, t_hi):
        offs_n = t * BLOCK_N + offs_n0
        # K tile viewed (D, N): memory contiguous along D = K-major B operand of QKᵀ.
        k_ptrs = k_base + offs_n[None, :].to(tl.int64) * BLOCK_D + offs_d[:, None]
        # Vᵀ stored (D, S_pad): the (N, D) view is contiguous along N = K-major B operand of PV.
        v_ptrs = vt_base + offs_d[None, :].to(tl.int64) * S_PAD + offs_n[:, None]
        # KV_ALIGNED (dense, Sk a multiple of BLOCK_N): every tile lies within the sequence, so the
        # masked tiles (diagonal, window edge) load like interior ones and mask only by position.
        if MASKED and not KV_ALIGNED:
            n_ok = offs_n < kv_len
            k_codes = tl.load(k_ptrs, mask=n_ok[None, :], other=0.0)
            if not K_HEAD:
                k_scale = tl.load(ks_base + offs_n, mask=n_ok, other=0.0)
            v_codes = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
        elif TMA:
            k_codes = k_desc.load([k_row0 + t * BLOCK_N, 0]).T  # (N, D) tile -> (D, N) view
            if not K_HEAD:
                k_scale = tl.load(ks_base + offs_n)
            v_codes = vt_desc.load([vt_row0, k_start + t * BLOCK_N]).T  # (D, N) tile -> (N, D) view
        else:
            k_codes = tl.load(k_ptrs)
            if not K_HEAD:
                k_scale = tl.load(ks_base + offs_n)
            v_codes = tl.load(v_ptrs)
        # x = (Qc Kcᵀ)·sk; the logit in log2 units is s = q_scale2 · x with q_scale2 > 0, so the
        # row max commutes with the row factor and the running max and references stay in x units.
        if K_HEAD:
            x = tl.dot(q_codes, k_codes)
        else:
            # Rounded by itself: an FMA of the unrounded product with the reference below would leave
            # the product's rounding residual in the max element's exponent.
            x = mul_rounded(tl.dot(q_codes, k_codes), k_scale[None, :], INTERPRET)
        if ROW_SHIFT:
            x = x + shift_x[:, None]
        if SOFTCAP:
            x = soft_cap(x, cap_x[:, None])
        if MASKED:
            if KV_ALIGNED:
                in_range = offs_n[None, :] < kv_len
            else:
                in_range = n_ok[None, :]
            vis = visible(in_range, pos_q[:, None], offs_n[None, :], window, CAUSAL, HAS_WINDOW)
            x = tl.where(vis, x, float("-inf"))
        m_t = tl.max(x, 1)  # the tile's row max, x units
        m_new = tl.maximum(m_i, m_t)
        # This tile's reference: its own max unless that lies more than REF_SLACK (slack_x = REF_SLACK
        # / q2 in x units) below the running max (the tile then weighs under BLOCK_N·2^-REF_SLACK of
        # the row; module docstring).
        r_t = tl.maximum(m_t, m_new - slack_x)
        if MASKED:
            # Rows with no visible key so far: keep every exponent finite (2^-inf = 0, never NaN).
            r_t_ref = tl.where(r_t == float("-inf"), 0.0, r_t)
        else:
            r_t_ref = r_t
        # 448·2^(s − r_T): exactly 448 where x = r_T, at any magnitude of the logits (module docstring);
        # FMA_EXP, where this program's bound allows (``fma``, uniform): one FMA per score, r_T·q2 −
        # log2 448 rounded once per row (exponent.py).
        if FMA_EXP:
            if fma:
                p = tl.math.exp2(x * q_scale2[:, None] - (r_t_ref * q_scale2 - LOG2_PMAX)[:, None])
            else:
                p = tl.math.exp2((x - r_t_ref[:, None]) * q_scale2[:, None] + LOG2_PMAX)
        else:
            p = tl.math.exp2((x - r_t_ref[:, None]) * q_scale2[:, None] + LOG2_PMAX)
        gamma = tl.math.exp2((r_i - r_t_ref) * q_scale2)
        # acc and l move to the new tile's reference (gamma): one factor per row, and the tile's P·V
        # joins with its channel scales only (per element a multiply and an FMA instead of two and an FMA).
        l_i = l_i * gamma + tl.sum(p, 1)
        p_codes = fp8_cast(p, P_DTYPE, P_MANT, P_SUB_MAGIC, P_SUB_MIN, CVT)  # p <= 448: no clamp
        if P_IN_PLACE:  # the key columns in Vᵀ's order: an accumulator's columns reach P·V in place
            p_codes = pv_token_order(p_codes, 1)
        if V_SEQ:
            # The MMA accumulates into acc itself: Triton then keeps it asynchronous across iterations.
            acc = tl.dot(p_codes, v_codes, acc * gamma[:, None])
        else:
            pv = tl.dot(p_codes, v_codes)
            acc = acc * gamma[:, None] + pv * tl.load(vs_base + t * BLOCK_D + offs_d)[None, :]
        m_i = m_new
        r_i = r_t
    return acc, l_i, m_i, r_i


@triton.jit
def _visit_all(
    acc, l_i, m_i, r_i, q_codes, q_scale2, slack_x, pos_q, k_base, ks_base, vt_base, vs_base, S_PAD, k_desc, vt_desc,
    k_row0, vt_row0, k_start, shift_x, cap_x, t_lo, f_lo, f_hi, t_hi, kv_len, window, fma,
    TMA: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    LOG2_PMAX: tl.constexpr, P_DTYPE: tl.constexpr, P_MANT: tl.constexpr, P_SUB_MAGIC: tl.constexpr,
    P_SUB_MIN: tl.constexpr, CVT: tl.constexpr, KV_ALIGNED: tl.constexpr, K_HEAD: tl.constexpr, V_SEQ: tl.constexpr,
    INTERPRET: tl.constexpr, ROW_SHIFT: tl.constexpr, SOFTCAP: tl.constexpr, FMA_EXP: tl.constexpr,
    P_IN_PLACE: tl.constexpr = False,
):
    """A program's key tiles (:func:`key_tile_range`: ``t_lo <= f_lo <= f_hi <= t_hi``) into its running
    (acc, l, m, r): leading masked tiles (window edge), fully visible tiles, trailing masked tiles
    (diagonal, end).

    Without a window there are no leading masked tiles (the key range starts at 0), and that loop is
    not compiled: its pipeline prologue (addresses, predicated loads) ran in every program, 7% of a
    short launch's stall samples. The trailing loop is empty too without causal mask or window when
    Sk is a multiple of BLOCK_N (KV_ALIGNED), and then not compiled either. (A runtime branch around
    it made the non-causal forward slower: benchmarks/NOTES.md.)"""
    if HAS_WINDOW:
        acc, l_i, m_i, r_i = _visit_tiles(acc, l_i, m_i, r_i, q_codes, q_scale2, slack_x, pos_q, k_base, ks_base, vt_base,
                                          vs_base, S_PAD, k_desc, vt_desc, k_row0, vt_row0, k_start, shift_x, cap_x,
                                          t_lo, f_lo, kv_len, window, fma, True, TMA, CAUSAL, HAS_WINDOW, BLOCK_N, BLOCK_D,
                                          LOG2_PMAX, P_DTYPE, P_MANT, P_SUB_MAGIC, P_SUB_MIN, CVT, KV_ALIGNED, K_HEAD,
                                          V_SEQ, INTERPRET, ROW_SHIFT, SOFTCAP, FMA_EXP, P_IN_PLACE)
    acc, l_i, m_i, r_i = _visit_tiles(acc, l_i, m_i, r_i, q_codes, q_scale2, slack_x, pos_q, k_base, ks_base, vt_base,
                                      vs_base, S_PAD, k_desc, vt_desc, k_row0, vt_row0, k_start, shift_x, cap_x,
                                      f_lo, f_hi, kv_len, window, fma, False, TMA, CAUSAL, HAS_WINDOW, BLOCK_N, BLOCK_D,
                                      LOG2_PMAX, P_DTYPE, P_MANT, P_SUB_MAGIC, P_SUB_MIN, CVT, KV_ALIGNED, K_HEAD,
                                      V_SEQ, INTERPRET, ROW_SHIFT, SOFTCAP, FMA_EXP, P_IN_PLACE)
    if CAUSAL or HAS_WINDOW or not KV_ALIGNED:
        acc, l_i, m_i, r_i = _visit_tiles(acc, l_i, m_i, r_i, q_codes, q_scale2, slack_x, pos_q, k_base, ks_base, vt_base,
                                          vs_base, S_PAD, k_desc, vt_desc, k_row0, vt_row0, k_start, shift_x, cap_x,
                                          f_hi, t_hi, kv_len, window, fma, True, TMA, CAUSAL, HAS_WINDOW, BLOCK_N, BLOCK_D,
                                          LOG2_PMAX, P_DTYPE, P_MANT, P_SUB_MAGIC, P_SUB_MIN, CVT, KV_ALIGNED, K_HEAD,
                                          V_SEQ, INTERPRET, ROW_SHIFT, SOFTCAP, FMA_EXP, P_IN_PLACE)
    return acc, l_i, m_i, r_i


@triton.jit
def _fwd_kernel(
    q_ptr, sqb, sqh, sqs, sqd,
    k_codes_ptr, k_scales_ptr, vt_codes_ptr, v_scales_ptr, k_desc, vt_desc,
    out_ptr, sob, soh, sos, sod,
    lse_ptr,
    cu_q_ptr, cu_k_ptr, tile_off_ptr,
    q_codes_ptr, q_scales_ptr,
    shift_ptr, sinks_ptr,
    HQ, HKV, SQ, SK, S_PAD, NT, D, qk_scale, window, softcap,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, IS_VARLEN: tl.constexpr, POW2: tl.constexpr,
    Q_FMAX: tl.constexpr, LOG2_PMAX: tl.constexpr, Q_DTYPE: tl.constexpr,
    Q_MANT: tl.constexpr, Q_SUB_MAGIC: tl.constexpr, Q_SUB_MIN: tl.constexpr,
    P_MANT: tl.constexpr, P_SUB_MAGIC: tl.constexpr, P_SUB_MIN: tl.constexpr, CVT: tl.constexpr,
    REF_SLACK: tl.constexpr, KV_ALIGNED: tl.constexpr, K_HEAD: tl.constexpr, V_SEQ: tl.constexpr,
    Q_CODES: tl.constexpr, INTERPRET: tl.constexpr, SOFTCAP: tl.constexpr, ROW_SHIFT: tl.constexpr,
    SINK: tl.constexpr, FMA_BOUND: tl.constexpr = 0.0, P_IN_PLACE: tl.constexpr = False,
):
    """One program per (query tile, batch·query head). qk_scale = τ·log2 e (times the rotation's
    1/block). Q_CODES: Q comes quantized by the quantization kernel (rotated, with per-token or
    per-(sequence, head) scales: codes ``(B, Hq, Sq, DP)``, scales ``(B, Hq, Sq)``), else the kernel
    quantizes it per token itself. K_HEAD and V_SEQ: see :func:`_visit_tiles`. ``k_desc`` / ``vt_desc``:
    TMA descriptors of K's codes viewed (B·Hkv·Sk, DP) and Vᵀ's viewed (B·Hkv·DP, Sk_pad), read only
    with TMA (the codes tensors themselves otherwise). SOFTCAP / ROW_SHIFT / SINK: the logit
    modifiers (module docstring): ``softcap`` c₂, ``shift_ptr`` (B, Hq, Sq) and ``sinks_ptr`` (Hq,)
    in log2 units. FMA_BOUND: :mod:`.exponent` (0: the exact exponent only; K_HEAD without the
    modifiers). P_IN_PLACE: :func:`_visit_tiles`."""
    n_m = tl.num_programs(0)
    # Heaviest (last, under a causal mask) query tiles first: better tail balance.
    m_blk = n_m - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HQ
    h = bh % HQ
    hk = h // (HQ // HKV)
    if IS_VARLEN:
        q_start = tl.load(cu_q_ptr + b)
        q_len = tl.load(cu_q_ptr + b + 1) - q_start
        k_start = tl.load(cu_k_ptr + b)
        kv_len = tl.load(cu_k_ptr + b + 1) - k_start
        slot0 = tl.load(tile_off_ptr + b)
        bb = b * 0
    else:
        q_start = 0
        q_len = SQ
        k_start = 0
        kv_len = SK
        slot0 = 0
        bb = b
    if m_blk * BLOCK_M >= q_len:
        return
    bb = bb.to(tl.int64)
    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < q_len
    d_ok = offs_d < D
    tok_q = (q_start + offs_m).to(tl.int64)

    # Q tile -> FP8 codes and scales (τ·log2 e folded into the scale).
    if Q_CODES:
        q_row = (bb * HQ + h) * SQ + tok_q
        q_codes = tl.load(q_codes_ptr + q_row[:, None] * BLOCK_D + offs_d[None, :], mask=m_ok[:, None], other=0.0)
        q_scale = tl.load(q_scales_ptr + q_row, mask=m_ok, other=1.0)
    else:
        q_ptrs = q_ptr + bb * sqb + h * sqh + tok_q[:, None] * sqs + offs_d[None, :] * sqd
        q = tl.load(q_ptrs, mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        q_scale = scale_from_amax(abs_max(q, 1), Q_FMAX, POW2)
        q_codes = to_fp8(q, q_scale[:, None], Q_FMAX, Q_DTYPE, Q_MANT, Q_SUB_MAGIC, Q_SUB_MIN, CVT, True)
    q_scale2 = q_scale * qk_scale

    # Query i sits at key position i + kv_len - q_len (causal diagonal aligned to the end).
    shift = kv_len - q_len
    pos_q = offs_m + shift
    pos_lo = m_blk * BLOCK_M + shift
    pos_hi = tl.minimum(m_blk * BLOCK_M + BLOCK_M, q_len) - 1 + shift
    # Key tiles any row of this tile may see, split around those every row sees (the backward's rule,
    # with pos_hi the last row in range: a partial query tile keeps its interior, its rows past the
    # sequence are never stored; so no GUARD_INTERIOR).
    t_lo, f_lo, f_hi, t_hi = key_tile_range(pos_lo, pos_hi, kv_len, window, 0, BLOCK_N, CAUSAL, HAS_WINDOW, False)

    bhk = bb * HKV + hk
    if K_HEAD:  # every key of the (sequence, head) has the same scale: fold it into the row factor
        q_scale2 = q_scale2 * tl.load(k_scales_ptr + bhk * SK + k_start, mask=kv_len > 0, other=1.0)
    k_base = k_codes_ptr + (bhk * SK + k_start) * BLOCK_D
    ks_base = k_scales_ptr + bhk * SK + k_start
    vt_base = vt_codes_ptr + bhk * BLOCK_D * S_PAD + k_start
    vs_base = v_scales_ptr + (bhk * NT + slot0) * BLOCK_D
    k_row0 = (bhk * SK + k_start).to(tl.int32)  # TMA coordinates are 32-bit
    vt_row0 = (bhk * BLOCK_D).to(tl.int32)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running row max (x units)
    r_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # reference of acc and l (x units)
    slack_x = REF_SLACK / q_scale2  # REF_SLACK in x units
    # The logit modifiers in x units (read only with their constexprs).
    shift_x = slack_x
    cap_x = slack_x
    if ROW_SHIFT:
        shift_x = tl.load(shift_ptr + (bb * HQ + h) * SQ + tok_q, mask=m_ok, other=0.0) / q_scale2
    if SOFTCAP:
        cap_x = softcap / q_scale2
    if SINK:
        # The sink's term starts l: 448·2^(σ − r) = 448 (l counts p's units); none for a sink of -inf.
        sink = tl.load(sinks_ptr + h)
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + sink / q_scale2
        r_i = m_i
        l_i = tl.where(m_i == float("-inf"), 0.0, tl.math.exp2(l_i + LOG2_PMAX))
    # The key tiles (leading masked, fully visible, trailing masked: _visit_all), with the exact
    # exponent, or where FMA_BOUND is on and this program's rows' bound is below it (their largest
    # factor, rows past the sequence counting 0: exponent.fma_row_bound), with the one-FMA one.
    fma = False
    if FMA_BOUND > 0.0:
        fma = tl.max(tl.where(m_ok, q_scale2, 0.0), 0) * (BLOCK_D * 448.0 * 448.0) + REF_SLACK + LOG2_PMAX < FMA_BOUND
    acc, l_i, m_i, r_i = _visit_all(
        acc, l_i, m_i, r_i, q_codes, q_scale2, slack_x, pos_q, k_base, ks_base, vt_base, vs_base, S_PAD, k_desc,
        vt_desc, k_row0, vt_row0, k_start, shift_x, cap_x, t_lo, f_lo, f_hi, t_hi, kv_len, window, fma, TMA, CAUSAL,
        HAS_WINDOW, BLOCK_N, BLOCK_D, LOG2_PMAX, Q_DTYPE, P_MANT, P_SUB_MAGIC, P_SUB_MIN, CVT, KV_ALIGNED, K_HEAD,
        V_SEQ, INTERPRET, ROW_SHIFT, SOFTCAP, FMA_BOUND > 0.0, P_IN_PLACE)

    empty = l_i == 0.0  # no visible key: O = 0, LSE = -inf (NaN rows keep NaN)
    if V_SEQ:
        acc = acc * tl.load(vs_base + offs_d)[None, :]  # the sequence's channel scales, once
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if FMA_BOUND > 0.0:  # the FMA form's l counts p relative to its rounded r·q2 − log2 448
        log2_l = tl.math.log2(tl.where(empty, 1.0, l_i))
        # The exact form's r·q2 rounded by itself, as the switch-off kernel computes it (its product
        # sits in another block than the add); contracted here, the exact fallback's LSE differed.
        exact = mul_rounded(r_i, q_scale2, INTERPRET) + log2_l - LOG2_PMAX
        lse2 = tl.where(fma, (r_i * q_scale2 - LOG2_PMAX) + log2_l, exact)
        lse = tl.where(empty, float("-inf"), lse2 * 0.6931471805599453)
    else:
        lse = tl.where(empty, float("-inf"),
                       (r_i * q_scale2 + tl.math.log2(tl.where(empty, 1.0, l_i)) - LOG2_PMAX) * 0.6931471805599453)
    o_ptrs = out_ptr + bb * sob + h * soh + tok_q[:, None] * sos + offs_d[None, :] * sod
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + (bb * HQ + h) * SQ + tok_q, lse, mask=m_ok)


# (BLOCK_M, num_warps, num_stages) tried by the autotuner; BLOCK_N is fixed by the recipe
# (config.block_k). Few on purpose: every entry is one more compile per key on first use.
AUTOTUNE_SPACE = ((128, 8, 2), (128, 8, 3), (128, 4, 3), (64, 4, 3), (64, 4, 4))
# Head dim 256 (the space above serves padded head dims up to 128). A 64-row warpgroup holds a
# 256-channel fp32 accumulator, 128 registers per thread, beside the 128-key S tile (64): the space
# above spills 0.3-4 KB per thread there (and 64-row tiles with 4 stages exceed shared memory).
# 8 warps on 64 rows split the accumulator over two warpgroups (each computes the tile's S, so
# QKᵀ runs twice). Offline for sm_90a (benchmarks/results/cpu_kernel_resources.txt): (64, 8, 2)
# spills at most 464 B over every recipe and mask kind; the single-stage shapes up to 0.5 KB on
# dense calls ((64, 4, 1) 1.5 KB with a partial key tile), 1.7-2.2 KB on packed ones (fp8_delta;
# the tile recipe up to 3.4 KB). The tuner times them per key (mask kind and packing are in it).
AUTOTUNE_SPACE_D256 = ((64, 4, 1), (64, 8, 1), (64, 8, 2), (128, 8, 1))
# "BLOCK_M,num_warps,num_stages" pins one launch configuration (no autotuning): tests, profiling.
# Entries "DP:BLOCK_M,num_warps,num_stages" after a ";" pin padded head dim DP on its own (e.g.
# "128,8,3;256:64,8,2"); the entry without a DP serves the other head dims.
PIN_ENV = "HF_FP8_ATTENTION_FWD_CONFIG"


def autotune_space(dp: int) -> tuple[tuple[int, int, int], ...]:
    """The launch configurations the autotuner tries for padded head dim ``dp``."""
    return AUTOTUNE_SPACE_D256 if dp > 128 else AUTOTUNE_SPACE


def default_launch(block_m: int, dp: int) -> tuple[int, int, int]:
    """(BLOCK_M, num_warps, num_stages) for a query tile fixed by the caller (``block_m``)."""
    if dp > 128:
        return block_m, 8 if block_m >= 64 else 1, 1
    return block_m, 4 if block_m >= 64 else 1, 2


def _pinned_launch(dp: int) -> tuple[int, int, int] | None:
    """The launch ``PIN_ENV`` pins for padded head dim ``dp``, or None."""
    value = os.environ.get(PIN_ENV)
    if not value:
        return None
    pins = {}
    try:
        for entry in value.split(";"):
            dim, _, cfg = entry.rpartition(":")
            bm, w, st = (int(x) for x in cfg.split(","))
            pins[int(dim) if dim else None] = (bm, w, st)
    except ValueError:
        raise ValueError(f"{PIN_ENV}={value!r} must be 'BLOCK_M,num_warps,num_stages', e.g. '128,8,3', optionally "
                         "followed by ';DP:BLOCK_M,num_warps,num_stages' entries for padded head dims DP") from None
    return pins.get(dp, pins.get(None))


# The autotuner's choice per (block_k, padded head dim, causal, window, varlen, pow2, dtype, TMA,
# length bucket, wave bucket); FORWARD_TUNER.choices is what benchmarks report.
FORWARD_TUNER = LaunchTuner("triton_forward", AUTOTUNE_SPACE)


def length_bucket(n: int) -> int:
    """The sequence-length part of the autotune key: ``n`` rounded up to a power of two within
    [256, 8192]. Without it the first call's length chose the launch for every length: tuned on a
    17-token call, the 8k-token causal forward ran at 390 instead of 475 TFLOP/s on the H200
    (benchmarks/NOTES.md)."""
    return min(max(next_pow2(n), 256), 8192)


def wave_bucket(programs: int, sm_count: int) -> int:
    """The grid part of the autotune key: how many waves of 64-row query tiles the call fills on
    ``sm_count`` multiprocessors, rounded up to a power of two within [1, 16]. Without it, a length
    bucket kept the launch tuned on its first call whatever that call's batch·heads: tuned on
    (B=1, H=4, Sq=1000, Sk=4097), 64 programs on 132 SMs, the same bucket then ran the 8k causal
    forward with B·H = 32 at 351 instead of 476-480 TFLOP/s on the H200 (benchmarks/NOTES.md)."""
    return min(next_pow2(cdiv(max(programs, 1), sm_count)), 16)


@functools.lru_cache(maxsize=64)
def _kernel_meta(config: FP8AttentionConfig, d: int, causal: bool, has_window: bool, varlen: bool, cvt: int,
                 tma: bool, kv_aligned: bool) -> dict:
    """The forward kernel's constexprs (cached: rebuilt only for a new recipe or mask kind)."""
    return dict(
        K_HEAD=config.kv_scales is Granularity.HEAD, V_SEQ=config.channel_scales is not Granularity.TILE,
        Q_CODES=_quantizes_q_first(config),
        BLOCK_N=config.block_k, BLOCK_D=padded_head_dim(d), TMA=tma, CAUSAL=causal, HAS_WINDOW=has_window,
        IS_VARLEN=varlen, POW2=config.pow2_scales, Q_FMAX=config.q_format.max,
        LOG2_PMAX=math.log2(config.p_format.max), Q_DTYPE=tl.float8e4nv, **cast_meta(config.q_format, "Q"),
        **cast_meta(config.p_format, "P"), CVT=cvt, REF_SLACK=REF_SLACK, KV_ALIGNED=kv_aligned,
        INTERPRET=interpreting(),
    )


def _quantizes_q_first(config: FP8AttentionConfig) -> bool:
    """Whether Q is quantized by the quantization kernel before the attention kernel: when it is
    rotated or takes one scale per (sequence, head). The rotation in the attention kernel held the
    Hadamard matrix in its shared memory beside the K/V pipeline (972 against 902 µs at 8k causal:
    benchmarks/results/h200_v20_kernels.log); a per-head scale needs the sequence statistics first."""
    return config.hadamard or config.qdo_scales is Granularity.HEAD


# The Triton kernel writes O token-major where q is and the caller asks (output_buffer); the Gluon
# kernel's switch is forward_gluon.TOKEN_MAJOR_OUT (on too).
TOKEN_MAJOR_OUT = True

# "0" turns the TMA loads of interior K/V tiles off (A/B comparisons; pointer loads everywhere).
TMA_ENV = "HF_FP8_ATTENTION_FWD_TMA"


def _use_tma(device: torch.device) -> bool:
    return not interpreting() and has_tma(device.index) and os.environ.get(TMA_ENV, "1") != "0"


# Q's statistics (the fast recipes' per-head scale, the backward's handed-over statistics) in the
# K/V statistics launch where Q shares their token axis (q_stats_beside_kv): one launch fewer per
# forward, for steps whose forward waits on the host. Off: a launch of their own (A/Bs).
Q_STATS_BESIDE_KV = True


def q_stats_beside_kv(q: torch.Tensor, k: torch.Tensor, mask: MaskSpec) -> bool:
    """Whether Q's statistics share the K/V statistics launch (:data:`Q_STATS_BESIDE_KV`): Q and K on
    one token axis (the same batch and length; packed, the same ``cu_seqlens`` tensor for both), of
    one head dim and dtype. ``q`` (B, Hq, Sq, D), ``k`` (B, Hkv, Sk, D)."""
    if not Q_STATS_BESIDE_KV or q.dtype != k.dtype:
        return False
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        return False
    return not mask.is_varlen or (mask.cu_seqlens_q is mask.cu_seqlens_k and mask.max_seqlen_q == mask.max_seqlen_k)


def output_buffer(q: torch.Tensor, *, zeros: bool, token_major: bool = True) -> torch.Tensor:
    """O's buffer ``(B, Hq, Sq, D)`` in q's dtype and device (zero-filled with ``zeros``), laid out as
    q where q is token-major (a ``(B, Sq, Hq, D)`` tensor transposed, as attention layers make it) and
    ``token_major`` allows, else contiguous. Token-major, the caller's transpose back to ``(B, Sq, Hq,
    D)`` is contiguous as it is, with no copy (PyTorch's SDPA lays its output out so too)."""
    bsz, hq, sq, d = q.shape
    alloc = torch.zeros if zeros else torch.empty
    if token_major and hq > 1 and q.transpose(1, 2).is_contiguous():
        return alloc(bsz, sq, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    return alloc(bsz, hq, sq, d, dtype=q.dtype, device=q.device)


def triton_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    mask: MaskSpec,
    config: FP8AttentionConfig,
    block_m: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    for_backward: dict | None = None,
    token_major_out: bool = False,
    hand_over_copies: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 attention forward with the Triton kernels (same contract as ``emulated_forward``).

    Args:
        q: ``(B, Hq, Sq, D)`` bf16/fp16/fp32, any strides; k, v: ``(B, Hkv, Sk, D)``, D in ``config.SUPPORTED_HEAD_DIMS``.
        mask: causal / window / varlen (``B == 1``, int32 cu_seqlens) as in :mod:`..masking`.
        block_m: fix the Triton kernel's query tile (skips autotuning and the Gluon kernel; used under
            the interpreter and in tests).
        softcap, sinks ``(Hq,)`` fp32: the logit modifiers (:mod:`hf_fp8_attention.reference`).
        for_backward: a dict to receive, under ``"kv_stats"``, K's and V's sequence statistics for
            the FP8 backward's copies as well (:func:`.backward.triton_backward`'s ``kv_stats``),
            computed in the forward's statistics launches instead of two more in the backward;
            under ``"q_stats"`` Q's, where the forward computes Q's statistics anyway; and with
            :data:`HAND_OVER_KV_COPIES` and ``hand_over_copies``, under ``"kv_copies"``, the
            backward's copies of K and V themselves (its ``kv_copies``).
        hand_over_copies: False where the copies must not be kept for the backward (the caller's
            saved tensors are packed by hooks, e.g. activation checkpointing: the copies would
            outlive them).
        token_major_out: O laid out as a token-major q is (:func:`output_buffer`) where the kernel
            that runs is switched to (``TOKEN_MAJOR_OUT`` here, the Gluon one's in forward_gluon).
    Returns:
        ``out (B, Hq, Sq, D)`` in q's dtype, contiguous unless ``token_major_out`` (see there), and
        ``lse (B, Hq, Sq)`` fp32.
    """
    check_compiled_blocks(config.block_q, config.block_k, "triton_forward", interpreting())
    bsz, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    bn = config.block_k
    varlen = mask.is_varlen
    max_q = max_k = None
    if varlen:
        max_q, max_k = varlen_max_lengths(mask)
    # K's row-wise copy (F1: smoothed, rotated) and V's transposed channel-wise copy (F2), one launch,
    # after the statistics launches (one pair for both) their sequence-wide scales and K's mean need.
    # With the backward's copies as well (HAND_OVER_KV_COPIES): K channel-wise and V row-wise too.
    hand_over = (for_backward is not None and HAND_OVER_KV_COPIES and hand_over_copies
                 and takes_kv_copies(q, k, mask, config))
    mods = logit_mods(q, k, scale, mask, config, softcap, sinks)
    mod_meta = mods.meta()
    use_gluon = block_m is None and gluon_runs(forward_gluon, GLUON_FORWARD, q, k, mask, config, mod_meta,
                                           "triton_forward")
    # K's channel-wise copy (the backward's, handed over) in the order its dQ launch takes.
    k_copies = copies_for("k", config, row=True, col=hand_over)._replace(
        col_pv=hand_over and dq_keys_in_pv_order(q, k, mask, config, mod_meta))
    # Vᵀ's keys in the P·V order of the kernel that runs (quantize.pv_token_order): the Gluon one's
    # (forward_gluon.P_IN_PLACE), the Triton one's with P_IN_PLACE_TRITON.
    triton_pv = not use_gluon and P_IN_PLACE_TRITON and pv_order_fits(sk, varlen)
    v_copies = copies_for("v", config, row=hand_over, col=True)._replace(
        col_pv=(use_gluon and forward_gluon.P_IN_PLACE) or triton_pv)
    q_first = _quantizes_q_first(config)
    q_copies = copies_for("q", config, row=True, col=False) if q_first else None
    # Where Q's statistics launch runs anyway, it computes the backward's statistics of Q as well.
    q_hand_over = q_first and for_backward is not None and q_copies.needs_stats
    q_also = backward_q_copies(config) if q_hand_over else None
    beside = ((q, q_copies, q_also) if q_first and q_copies.needs_stats and q_stats_beside_kv(q, k, mask)
              else None)
    stats, (k_all, v_all) = stats_then_copies(
        (k, v), (k_copies, v_copies), block=bn, pow2=config.pow2_scales, cu_seqlens=mask.cu_seqlens_k,
        max_seqlen=max_k, also=None if for_backward is None else backward_kv_copies(config), beside=beside)
    kv_stats = stats[:2]
    (k_codes, k_scales, _, _, _), (_, _, vt_codes, v_scales, tile_off) = k_all, v_all
    if for_backward is not None:
        for_backward["kv_stats"] = kv_stats
        if hand_over:  # a list the backward empties, so that it can free each copy after its last reader
            for_backward["kv_copies"] = [(k_all, (*v_all[:2], None, None, None), k_copies.col_pv)]  # (Vᵀ: F2 only)
    q_codes = q_scales = q  # dummies, never read unless Q is quantized first
    q_stats = (None, )
    # The Gluon kernel makes the rotated Q's codes itself (forward_gluon.QUANTIZE_Q).
    q_in_kernel = use_gluon and forward_gluon.q_quantization_reason(q, config, bool(mask.causal)) is None
    if q_first:
        q_stats = stats[2:] if beside is not None else stats_for(
            (q,), (q_copies,), mask.cu_seqlens_q, max_q, also=None if q_also is None else (q_also,))
        if q_hand_over:
            for_backward["q_stats"] = q_stats[0]
        if not q_in_kernel:
            (q_codes, q_scales, _, _, _), = quantize_operands(
                (q,), (q_copies,), block=config.block_q, pow2=config.pow2_scales, cu_seqlens=mask.cu_seqlens_q,
                max_seqlen=max_q, stats=q_stats)
    token_major_out = token_major_out and (forward_gluon.TOKEN_MAJOR_OUT if use_gluon else TOKEN_MAJOR_OUT)
    out = output_buffer(q, zeros=varlen, token_major=token_major_out)  # varlen: tokens outside sequences read 0
    if varlen:
        lse = torch.full((bsz, hq, sq), float("-inf"), dtype=torch.float32, device=q.device)
        cu_q, cu_k = mask.cu_seqlens_q, mask.cu_seqlens_k  # int32, contiguous (MaskSpec)
        n_prog1 = (cu_q.numel() - 1) * hq
        rows = max_q
    else:
        lse = torch.empty(bsz, hq, sq, dtype=torch.float32, device=q.device)
        cu_q = cu_k = tile_off = q  # dummies, never read
        n_prog1 = bsz * hq
        rows = sq
    qk_scale = float(scale) * LOG2E * logit_factor(config, d)
    if use_gluon:  # (its scope has positive lengths); the Triton launch's arguments are not needed
        if q_in_kernel:  # per (sequence, head): the statistics launch's amax of the rotated Q
            q_head_amax = None if q_stats[0] is None else q_stats[0].row_amax
            forward_gluon.gluon_forward(None, None, k_codes, k_scales, vt_codes, v_scales, out, lse, groups=hq // hkv,
                                        qk_scale=qk_scale, slack=REF_SLACK, causal=bool(mask.causal), q=q,
                                        q_head_amax=q_head_amax, pow2=config.pow2_scales, block_n=bn)
        else:
            forward_gluon.gluon_forward(q_codes, q_scales, k_codes, k_scales, vt_codes, v_scales, out, lse,
                                        groups=hq // hkv, qk_scale=qk_scale, slack=REF_SLACK,
                                        causal=bool(mask.causal), block_n=bn)
        return out, lse
    if max(rows, 0) == 0:
        return out, lse
    window = mask.window_arg
    # Packed sequences start at any key: a TMA box of Vᵀ whose innermost start coordinate is not
    # 16-byte aligned faults (illegal instruction, H200), so they keep pointer loads. Without any
    # key there is no interior tile to load (and a descriptor cannot describe an empty tensor).
    tma = not varlen and k_codes.numel() > 0 and _use_tma(q.device)
    if tma:  # 2-D views: K's codes (B·Hkv·Sk, DP), Vᵀ's (B·Hkv·DP, Sk_pad); one tile per box
        dp = k_codes.shape[-1]
        k_desc = TensorDescriptor.from_tensor(k_codes.view(-1, dp), [bn, dp])
        vt_desc = TensorDescriptor.from_tensor(vt_codes.view(-1, vt_codes.shape[-1]), [dp, bn])
    else:
        k_desc, vt_desc = k_codes, vt_codes  # never read as descriptors
    shift2, sinks2, softcap2 = mods.args(lse)
    args = (
        q, *q.stride(), k_codes, k_scales, vt_codes, v_scales, k_desc, vt_desc, out, *out.stride(), lse,
        cu_q, cu_k, tile_off, q_codes, q_scales, shift2, sinks2,
        hq, hkv, sq, sk, vt_codes.shape[-1], v_scales.shape[2], d,
        qk_scale, window, softcap2,
    )
    meta = {**_kernel_meta(config, d, bool(mask.causal), mask.window is not None, varlen, cvt_mode(), tma,
                           not varlen and sk % config.block_k == 0), **mod_meta}
    # The one-FMA exponent (exponent.py): block-free K (its scale in the row factor), no logit modifiers.
    plain_logits = not (meta["SOFTCAP"] or meta["ROW_SHIFT"] or meta["SINK"])
    meta["FMA_BOUND"] = fma_bound(triton=True) if meta["K_HEAD"] and plain_logits else 0.0
    meta["P_IN_PLACE"] = triton_pv

    def launch(cfg: tuple[int, int, int]) -> None:
        bm, warps, stages = cfg
        launch_kernel(_fwd_kernel, (cdiv(rows, bm), n_prog1), *args, BLOCK_M=bm, **meta, num_warps=warps,
                      num_stages=stages, **COMPILE_OPTIONS)

    if block_m is not None:
        launch(default_launch(block_m, meta["BLOCK_D"]))
    elif interpreting():
        launch((16, 1, 1))
    else:
        pinned = _pinned_launch(meta["BLOCK_D"])
        key = (bn, meta["BLOCK_D"], meta["CAUSAL"], meta["HAS_WINDOW"], varlen, meta["POW2"], q.dtype, tma,
               meta["K_HEAD"], meta["V_SEQ"], meta["Q_CODES"], meta["SOFTCAP"], meta["ROW_SHIFT"], meta["SINK"],
               meta["FMA_BOUND"], triton_pv,
               length_bucket(max(rows, max_k if varlen else sk)),
               wave_bucket(cdiv(rows, 64) * n_prog1, sm_count(q.device.index)))
        launch(pinned or FORWARD_TUNER.pick(key, launch, autotune_space(meta["BLOCK_D"])))
    return out, lse


__all__ = ["GLUON_FORWARD", "LOG2E", "triton_forward"]
