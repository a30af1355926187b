"""How fast plain FlashAttention runs in Triton on this GPU: the ceiling the speed targets meet.

A textbook FlashAttention-2 (forward; backward as a dK/dV kernel plus a dQ kernel, stale delta
rowsum(dO∘O), no atomics) written once and compiled in two element types:

- ``fp8``: per-tensor scaled E4M3 operands quantized before the timed region, P and dS cast to E4M3
  straight from fp32 (P in [0, 1] unscaled, as FlashAttention-3's FP8 forward does; dS times one
  fixed factor). No block scales, no per-tile quantization, no matched delta: none of this
  project's recipe, so its time is what Triton gives FP8 attention before any recipe work.
- ``bf16``: the same kernels on bf16 operands (calibration against SDPA's flash backend).

Same run: SDPA bf16 (cuDNN and flash backends) and this project's ``fp8_attention`` (fp8_delta,
bf16 inputs quantized inside the timed region), timed by bench_attention.py's own ``_time``. The
textbook rows time kernels only: their operands are quantized and transposed beforehand. Every
launch shape in ``*_CONFIGS`` is first checked against a float64 reference at S = 1024 (relative
error of the output and each gradient: bf16 <= 2e-2, fp8 <= 1.5e-1; a failure aborts the run;
tests/test_textbook_attention.py runs the fp8 checks under the interpreter), then timed; the
table uses the fastest shape per kernel. fwd+bwd = forward + delta + dK/dV + dQ launches timed
together: 7 matmul-equivalents, against fp8_delta's 2 + 10.

``--ladder`` times the forward and dQ kernels at each RECIPE level of ``LADDER`` instead (B = 1):
what each piece of the recipe's per-element work costs in an otherwise plain kernel.

    PYTHONPATH=. python benchmarks/experiments/textbook_attention.py [--seqlens 4096,8192,16384]
    PYTHONPATH=. python benchmarks/experiments/textbook_attention.py --ladder --seqlens 8192,16384

TFLOP/s as in bench_attention.py: forward 4·B·H·S²·D (halved when causal), fwd+bwd 3.5x that.
Requires a GPU with FP8 tensor cores and TMA (sm_90); S a multiple of 128.
"""
from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_attention  # noqa: E402  (puts the repository on sys.path)

LOG2E = 1.4426950408889634
FP8_MAX = 448.0
# The backward's normalised P (~1/S) would fall below E4M3's smallest subnormal (2^-9): its tiles
# are formed as P · 2^P_SHIFT (LSE lowered by P_SHIFT, free per row) and dV, dS scaled back.
P_SHIFT = tl.constexpr(8.0)
# (BLOCK_M queries, BLOCK_N keys, warps, stages)
FWD_CONFIGS = [(64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3)]
DKDV_CONFIGS = [(64, 64, 4, 2), (64, 64, 4, 3), (32, 128, 8, 2), (64, 128, 8, 2)]
DQ_CONFIGS = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 8, 2), (64, 128, 4, 2)]
# --ladder: the recipe's per-element work added to the fp8 kernels one piece at a time (RECIPE):
# 1 per-row / per-key scale vectors on S and dP; forward 2: each key tile's P·V times V's
# per-channel scales before it joins acc; dQ 2: dS quantized per row within each key tile, its
# scale applied to the tile's dS·K; dQ 3: also K's per-channel scales of the tile.
LADDER = {"forward": (0, 1, 2), "dQ": (0, 1, 2, 3)}


# ----------------------------------------------------------------------------------------- forward
@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, row_k, row_v, n_lo, n_hi, offs_m, qk_scale, qs, KS, VCS, vcs_row,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, FP8: tl.constexpr, RECIPE: tl.constexpr):
    """Online softmax over key tiles [n_lo, n_hi) of one head; acc (BLOCK_M, D), l_i, m_i (BLOCK_M,).
    RECIPE (see LADDER): 1 scales S by per-row ``qs`` and per-key KS vectors, 2 also scales each
    tile's P·V by a per-channel vector of VCS (row ``vcs_row`` + tile) before adding it to acc."""
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, acc.shape[1])
    for n in range(n_lo, n_hi, BLOCK_N):
        k = k_desc.load([row_k + n, 0])  # (BLOCK_N, D)
        if RECIPE >= 1:
            ks = tl.load(KS + row_k + n + offs_n0)
            s = tl.dot(q, k.T) * qs[:, None] * ks[None, :]
        else:
            s = tl.dot(q, k.T) * qk_scale  # log2 units
        if MASKED:
            s = tl.where(offs_m[:, None] >= (n + offs_n0)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if FP8:
            vt = v_desc.load([row_v, n])  # (D, BLOCK_N) of Vᵀ: K-major for the FP8 MMA
            if RECIPE >= 2:  # per-tile channel scales: the MMA cannot accumulate into acc
                svc = tl.load(VCS + (vcs_row + n // BLOCK_N) * acc.shape[1] + offs_d)
                acc += tl.dot(p.to(tl.float8e4nv), vt.T) * svc[None, :]
            else:
                acc = tl.dot(p.to(tl.float8e4nv), vt.T, acc)
        else:
            v = v_desc.load([row_k + n, 0])  # (BLOCK_N, D)
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, QS, KS, VCS, S, qk_scale, out_scale,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                FP8: tl.constexpr, RECIPE: tl.constexpr):
    """One (BLOCK_M, D) query tile of one head. q/k/o descriptors over (B·H·S, D); v over (B·H·D, S)
    (Vᵀ) when FP8, else (B·H·S, D). LSE (B·H·S,) fp32 in log2 units of the scaled logits.
    RECIPE >= 1 (FP8 only): QS, KS (B·H·S,) and VCS (B·H, S // 32, D) scale vectors, see _fwd_tiles."""
    tl.static_assert(FP8 or RECIPE == 0)
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_k = bh * S
    q = q_desc.load([row_k + m0, 0])
    qs = None
    if RECIPE >= 1:
        qs = tl.load(QS + row_k + offs_m)
    vcs_row = bh * (S // 32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    # causal: key tiles wholly below the tile's first row need no mask
    full_hi = (m0 // BLOCK_N) * BLOCK_N if CAUSAL else S
    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, row_k, bh * D, 0, full_hi, offs_m,
                               qk_scale, qs, KS, VCS, vcs_row, BLOCK_N, False, FP8, RECIPE)
    if CAUSAL:
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, row_k, bh * D, full_hi, m0 + BLOCK_M,
                                   offs_m, qk_scale, qs, KS, VCS, vcs_row, BLOCK_N, True, FP8, RECIPE)
    tl.store(LSE + row_k + offs_m, m_i + tl.math.log2(l_i))
    o = acc * (out_scale / l_i)[:, None]
    o_desc.store([row_k + m0, 0], o.to(tl.bfloat16))


# ---------------------------------------------------------------------------------------- backward
@triton.jit
def _delta_kernel(O, DO, DELTA, D: tl.constexpr, BLOCK: tl.constexpr):
    """DELTA_i = Σ_c O_ic dO_ic (fp32) for BLOCK rows of the flattened (B·H·S, D) tensors."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs = rows[:, None].to(tl.int64) * D + tl.arange(0, D)[None, :]
    o = tl.load(O + offs).to(tl.float32)
    do = tl.load(DO + offs).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, 1))


@triton.jit
def _dkdv_tiles(dk, dv, k, v, Q, DO, QT, DOT, LSE, DELTA, bh, S, n0, m_lo, m_hi, qk_scale, dp_scale, ds_mult,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                FP8: tl.constexpr):
    """Query tiles [m_lo, m_hi) into one key tile's dK, dV (BLOCK_N, D): transposed tiles (BLOCK_N, BLOCK_M)."""
    offs_d = tl.arange(0, D)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    base = bh.to(tl.int64) * S * D
    for m in range(m_lo, m_hi, BLOCK_M):
        offs_m = m + tl.arange(0, BLOCK_M)
        row_ptrs = base + offs_m[:, None] * D + offs_d[None, :]  # (BLOCK_M, D) of a row-major copy
        q = tl.load(Q + row_ptrs)
        do = tl.load(DO + row_ptrs)
        lse = tl.load(LSE + bh * S + offs_m) - P_SHIFT
        delta = tl.load(DELTA + bh * S + offs_m)
        pt = tl.math.exp2(tl.dot(k, q.T) * qk_scale - lse[None, :])
        if MASKED:
            pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
        dpt = tl.dot(v, do.T) * dp_scale
        dst = pt * (dpt - delta[None, :]) * ds_mult  # dS times the multiplier (P carries 2^P_SHIFT)
        if FP8:
            t_ptrs = base + offs_d[:, None] * S + offs_m[None, :]  # (D, BLOCK_M) of a transposed copy
            dv = tl.dot(pt.to(tl.float8e4nv), tl.load(DOT + t_ptrs).T, dv)
            dk = tl.dot(dst.to(tl.float8e4nv), tl.load(QT + t_ptrs).T, dk)
        else:
            dv = tl.dot(pt.to(do.dtype), do, dv)
            dk = tl.dot(dst.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def _dkdv_kernel(Q, K, V, DO, QT, DOT, LSE, DELTA, DK, DV, S, qk_scale, dp_scale, ds_mult, dk_scale, dv_scale,
                 D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 FP8: tl.constexpr):
    """dK, dV of one (BLOCK_N, D) key tile of one head; all tensors (B·H, S, D) contiguous, QT / DOT
    (B·H, D, S) (FP8 only)."""
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    ptrs = bh.to(tl.int64) * S * D + offs_n[:, None] * D + offs_d[None, :]
    k = tl.load(K + ptrs)
    v = tl.load(V + ptrs)
    dk = tl.zeros([BLOCK_N, D], tl.float32)
    dv = tl.zeros([BLOCK_N, D], tl.float32)
    if CAUSAL:  # query tiles that see part of the key tile, then those that see all of it
        m_lo = (n0 // BLOCK_M) * BLOCK_M
        m_full = ((n0 + BLOCK_N + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
        dk, dv = _dkdv_tiles(dk, dv, k, v, Q, DO, QT, DOT, LSE, DELTA, bh, S, n0, m_lo, m_full, qk_scale,
                             dp_scale, ds_mult, D, BLOCK_M, BLOCK_N, True, FP8)
    else:
        m_full = 0
    dk, dv = _dkdv_tiles(dk, dv, k, v, Q, DO, QT, DOT, LSE, DELTA, bh, S, n0, m_full, S, qk_scale,
                         dp_scale, ds_mult, D, BLOCK_M, BLOCK_N, False, FP8)
    tl.store(DK + ptrs, (dk * dk_scale).to(DK.dtype.element_ty))
    tl.store(DV + ptrs, (dv * dv_scale).to(DV.dtype.element_ty))


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, K, V, KT, bh, S, m0, n_lo, n_hi, qk_scale, dp_scale, ds_mult, qs, KS, VS, KCS,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              FP8: tl.constexpr, RECIPE: tl.constexpr):
    """Key tiles [n_lo, n_hi) into one query tile's dQ (BLOCK_M, D). RECIPE (see LADDER): 1 scales S
    by per-row ``qs`` and per-key KS vectors and dP by per-key VS; 2 also quantizes dS per row
    within the tile (its scale multiplies the tile's dS·K before it joins dQ); 3 also multiplies
    that product by a per-channel vector of KCS (B·H, S // 32, D), one per key tile."""
    offs_d = tl.arange(0, D)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    base = bh.to(tl.int64) * S * D
    for n in range(n_lo, n_hi, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        row_ptrs = base + offs_n[:, None] * D + offs_d[None, :]
        k = tl.load(K + row_ptrs)
        v = tl.load(V + row_ptrs)
        if RECIPE >= 1:
            ks = tl.load(KS + bh * S + offs_n)
            vs = tl.load(VS + bh * S + offs_n)
            p = tl.math.exp2(tl.dot(q, k.T) * qs[:, None] * ks[None, :] - lse[:, None])
        else:
            p = tl.math.exp2(tl.dot(q, k.T) * qk_scale - lse[:, None])
        if MASKED:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        if RECIPE >= 1:
            dp = tl.dot(do, v.T) * vs[None, :]
        else:
            dp = tl.dot(do, v.T) * dp_scale
        if RECIPE >= 2:  # B4 of the recipe: dS per row within the key tile
            ds = p * (dp - delta[:, None])
            sds = tl.max(tl.abs(ds), 1) / 448.0
            sds = tl.where(sds > 0.0, sds, 1.0)
            ds8 = (ds * (1.0 / sds)[:, None]).to(tl.float8e4nv)
            kt = tl.load(KT + base + offs_d[:, None] * S + offs_n[None, :])
            if RECIPE >= 3:
                skc = tl.load(KCS + (bh * (S // 32) + n // BLOCK_N) * D + offs_d)
                dq += tl.dot(ds8, kt.T) * sds[:, None] * skc[None, :]
            else:
                dq += tl.dot(ds8, kt.T) * sds[:, None]
        else:
            ds = p * (dp - delta[:, None]) * ds_mult  # dS times the multiplier (P carries 2^P_SHIFT)
            if FP8:
                kt = tl.load(KT + base + offs_d[:, None] * S + offs_n[None, :])  # (D, BLOCK_N) of Kᵀ
                dq = tl.dot(ds.to(tl.float8e4nv), kt.T, dq)
            else:
                dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _dq_kernel(Q, K, V, DO, KT, LSE, DELTA, DQ, QS, KS, VS, KCS, S, qk_scale, dp_scale, ds_mult, dq_scale,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
               FP8: tl.constexpr, RECIPE: tl.constexpr):
    """dQ of one (BLOCK_M, D) query tile of one head (layouts as in _dkdv_kernel; KT (B·H, D, S));
    RECIPE >= 1 (FP8 only): scale vectors, see _dq_tiles."""
    tl.static_assert(FP8 or RECIPE == 0)
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    ptrs = bh.to(tl.int64) * S * D + offs_m[:, None] * D + offs_d[None, :]
    q = tl.load(Q + ptrs)
    do = tl.load(DO + ptrs)
    lse = tl.load(LSE + bh * S + offs_m) - P_SHIFT
    delta = tl.load(DELTA + bh * S + offs_m)
    qs = None
    if RECIPE >= 1:
        qs = tl.load(QS + bh * S + offs_m)
    dq = tl.zeros([BLOCK_M, D], tl.float32)
    full_hi = (m0 // BLOCK_N) * BLOCK_N if CAUSAL else S
    dq = _dq_tiles(dq, q, do, lse, delta, K, V, KT, bh, S, m0, 0, full_hi, qk_scale, dp_scale, ds_mult,
                   qs, KS, VS, KCS, D, BLOCK_M, BLOCK_N, False, FP8, RECIPE)
    if CAUSAL:
        dq = _dq_tiles(dq, q, do, lse, delta, K, V, KT, bh, S, m0, full_hi, m0 + BLOCK_M, qk_scale, dp_scale,
                       ds_mult, qs, KS, VS, KCS, D, BLOCK_M, BLOCK_N, True, FP8, RECIPE)
    tl.store(DQ + ptrs, (dq * dq_scale).to(DQ.dtype.element_ty))


# ------------------------------------------------------------------------------------------ host
class Operands:
    """Inputs of one shape in the kernels' layouts. q, k, v, do: (B, H, S, D) bf16.

    fp8: per-tensor scales (amax / 448), codes (B·H, S, D) plus transposed copies (B·H, D, S) of V,
    Q, dO, K for the MMAs that contract over tokens; ``ds_mult`` maps dS onto E4M3's range (from the
    reference dS when given, else 1: its value does not change the time). The RECIPE levels read
    the same per-tensor scales from per-row / per-key / per-channel vectors, as block scales would
    come: qs (B·H·S,) = τ·log2(e)·sq, ks = sk, vs = sdo·sv, and per key tile of up to 32 keys kcs = sk,
    vcs = sv (B·H, S // 32, D)."""

    def __init__(self, q, k, v, do, fp8: bool, ds_amax: float | None = None):
        b, h, s, d = q.shape
        self.shape, self.fp8 = (b, h, s, d), fp8
        self.sm_scale = d ** -0.5
        flat = [x.reshape(b * h, s, d).contiguous() for x in (q, k, v, do)]
        if fp8:
            self.scales = [x.abs().amax().float().item() / FP8_MAX for x in flat]
            codes = [(x.float() / sc).to(torch.float8_e4m3fn) for x, sc in zip(flat, self.scales)]
            self.q, self.k, self.v, self.do = codes
            self.qt, self.kt, self.vt, self.dot = [x.transpose(1, 2).contiguous() for x in codes]
            self.ds_mult = FP8_MAX / ds_amax if ds_amax else 1.0
            sq, sk, sv, sdo = self.scales
            vec = lambda value, *shape: torch.full(shape, value, dtype=torch.float32, device=q.device)  # noqa: E731
            self.qs, self.ks, self.vs = (vec(x, b * h * s) for x in (self.sm_scale * LOG2E * sq, sk, sdo * sv))
            self.kcs, self.vcs = (vec(x, b * h, s // 32, d) for x in (sk, sv))
        else:
            self.scales = [1.0] * 4
            self.q, self.k, self.v, self.do = flat
            self.qt = self.kt = self.vt = self.dot = self.q  # never read
            self.qs = self.ks = self.vs = self.kcs = self.vcs = self.q  # never read
            self.ds_mult = 1.0
        self.do_bf16 = flat[3]
        self.out = torch.empty(b * h, s, d, dtype=torch.bfloat16, device=q.device)
        self.lse = torch.empty(b * h, s, dtype=torch.float32, device=q.device)
        self.delta = torch.empty_like(self.lse)
        self.dq, self.dk, self.dv = (torch.empty_like(self.out) for _ in range(3))


def forward(op: Operands, cfg, causal: bool, recipe: int = 0):
    bm, bn, warps, stages = cfg
    b, h, s, d = op.shape
    sq, sk, sv, _ = op.scales
    q_desc = TensorDescriptor.from_tensor(op.q.view(-1, d), [bm, d])
    k_desc = TensorDescriptor.from_tensor(op.k.view(-1, d), [bn, d])
    v_desc = (TensorDescriptor.from_tensor(op.vt.view(-1, s), [d, bn]) if op.fp8
              else TensorDescriptor.from_tensor(op.v.view(-1, d), [bn, d]))
    o_desc = TensorDescriptor.from_tensor(op.out.view(-1, d), [bm, d])
    out_scale = 1.0 if recipe >= 2 else sv  # at RECIPE 2 every tile's P·V carries sv already
    _fwd_kernel[(s // bm, b * h)](q_desc, k_desc, v_desc, o_desc, op.lse, op.qs, op.ks, op.vcs, s,
                                  op.sm_scale * LOG2E * sq * sk, out_scale, D=d, BLOCK_M=bm, BLOCK_N=bn,
                                  CAUSAL=causal, FP8=op.fp8, RECIPE=recipe, num_warps=warps, num_stages=stages)


def delta(op: Operands):
    b, h, s, d = op.shape
    _delta_kernel[(b * h * s // 64,)](op.out, op.do_bf16, op.delta, D=d, BLOCK=64, num_warps=4)


def _bwd_scales(op: Operands):
    """qk scale (log2 units), dP scale, dS multiplier for P·2^P_SHIFT, dK, dQ and dV output scales."""
    sq, sk, sv, sdo = op.scales
    shift = 2.0 ** P_SHIFT.value
    qk = op.sm_scale * LOG2E * sq * sk
    return qk, sdo * sv, op.ds_mult / shift, sq * op.sm_scale / op.ds_mult, sk * op.sm_scale / op.ds_mult, sdo / shift


def dkdv(op: Operands, cfg, causal: bool):
    bm, bn, warps, stages = cfg
    b, h, s, d = op.shape
    qk, dp, mult, dk_s, _, dv_s = _bwd_scales(op)
    _dkdv_kernel[(s // bn, b * h)](op.q, op.k, op.v, op.do, op.qt, op.dot, op.lse, op.delta, op.dk, op.dv, s,
                                   qk, dp, mult, dk_s, dv_s, D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal,
                                   FP8=op.fp8, num_warps=warps, num_stages=stages)


def dq(op: Operands, cfg, causal: bool, recipe: int = 0):
    bm, bn, warps, stages = cfg
    b, h, s, d = op.shape
    qk, dp, mult, _, dq_s, _ = _bwd_scales(op)
    if recipe >= 2:  # dS quantized per row: its scale carries dS's units (times 2^P_SHIFT), no ds_mult
        dq_s = op.sm_scale / 2.0 ** P_SHIFT.value * (1.0 if recipe >= 3 else op.scales[1])
    _dq_kernel[(s // bm, b * h)](op.q, op.k, op.v, op.do, op.kt, op.lse, op.delta, op.dq, op.qs, op.ks, op.vs, op.kcs,
                                 s, qk, dp, mult, dq_s, D=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, FP8=op.fp8,
                                 RECIPE=recipe, num_warps=warps, num_stages=stages)


def reference(q, k, v, do, causal: bool):
    """float64 O, dQ, dK, dV and max |dS| (B, H, S, D)."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = s.softmax(-1)
    o = p @ v
    o.backward(do.double())
    dp = do.double() @ v.detach().transpose(-1, -2)
    ds = p.detach() * (dp - (o.detach() * do.double()).sum(-1, keepdim=True))
    return o.detach(), q.grad, k.grad, v.grad, ds.abs().amax().item()


def _rel(x, ref):
    return ((x.double().reshape(ref.shape) - ref).norm() / ref.norm()).item()


def _check_inputs(causal: bool, device, s: int):
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, s, 128, device=device, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    return (q, k, v, do), reference(q, k, v, do, causal)


def _expect(err, bound, what):
    print(f"check {what}: rel err {err}", flush=True)
    if not max(err) <= bound:
        raise RuntimeError(f"textbook kernel wrong: {what}: relative errors {err} above {bound}")


def check(fp8: bool, causal: bool, device, s: int = 1024) -> None:
    """Every launch shape against float64 at B = 1, H = 2, S = s, D = 128; aborts on a failure."""
    inputs, (ref_o, ref_dq, ref_dk, ref_dv, ds_amax) = _check_inputs(causal, device, s)
    op = Operands(*inputs, fp8, ds_amax)
    bound = 1.5e-1 if fp8 else 2e-2
    tag = f"{'fp8' if fp8 else 'bf16'} causal={causal}"
    for cfg in FWD_CONFIGS:
        forward(op, cfg, causal)
        _expect((_rel(op.out, ref_o),), bound, f"{tag} forward {cfg}")
    forward(op, FWD_CONFIGS[0], causal)
    delta(op)
    for cfg in DKDV_CONFIGS:
        dkdv(op, cfg, causal)
        _expect((_rel(op.dk, ref_dk), _rel(op.dv, ref_dv)), bound, f"{tag} dK/dV {cfg}")
    for cfg in DQ_CONFIGS:
        dq(op, cfg, causal)
        _expect((_rel(op.dq, ref_dq),), bound, f"{tag} dQ {cfg}")


def check_ladder(causal: bool, device, s: int = 1024) -> None:
    """The fp8 forward and dQ kernels at every RECIPE level > 0 and launch shape, as :func:`check`."""
    inputs, (ref_o, ref_dq, _, _, ds_amax) = _check_inputs(causal, device, s)
    op = Operands(*inputs, True, ds_amax)
    for level in LADDER["forward"][1:]:
        for cfg in FWD_CONFIGS:
            forward(op, cfg, causal, level)
            _expect((_rel(op.out, ref_o),), 1.5e-1, f"fp8 causal={causal} forward RECIPE={level} {cfg}")
    forward(op, FWD_CONFIGS[0], causal)
    delta(op)
    for level in LADDER["dQ"][1:]:
        for cfg in DQ_CONFIGS:
            dq(op, cfg, causal, level)
            _expect((_rel(op.dq, ref_dq),), 1.5e-1, f"fp8 causal={causal} dQ RECIPE={level} {cfg}")


def _best(fn, configs, label):
    times = {}
    for cfg in configs:
        times[cfg] = do_bench(lambda: fn(cfg), warmup=10, rep=50, return_mode="median")
        print(f"  {label} {cfg}: {times[cfg]:.3f} ms", flush=True)
    best = min(times, key=times.get)
    return best, times[best]


def _times(impl, q, k, v):
    """(forward, fwd+bwd) median ms of ``impl(q, k, v)``, as bench_attention.py times them."""
    return tuple(bench_attention._time(impl, mode, q, k, v, warmup=25, rep=100) for mode in ("fwd", "fwdbwd"))


def ladder(seqlens, heads, dev) -> None:
    """The textbook fp8 forward and dQ kernels at each RECIPE level (B = 1, D = 128), best launch
    shape per level, beside fp8_delta's public forward at the same shape."""
    for causal in (True, False):
        check_ladder(causal, dev)
    rows = []
    for s in seqlens:
        gen = torch.Generator(device=dev).manual_seed(s)
        q, k, v, do = (torch.randn(1, heads, s, 128, device=dev, dtype=torch.bfloat16, generator=gen)
                       for _ in range(4))
        op = Operands(q, k, v, do, True)
        for causal in (True, False):
            f = bench_attention.flops("fwd", 1, heads, s, 128, causal)
            ours = bench_attention._time(bench_attention._ours_fn("fp8_delta", causal), "fwd", q, k, v, 25, 100)
            rows.append((s, causal, "forward", "fp8_delta", ours, "", f / ours / 1e9))
            for level in LADDER["forward"]:
                cfg, ms = _best(lambda c: forward(op, c, causal, level), FWD_CONFIGS, f"forward RECIPE={level}")
                rows.append((s, causal, "forward", level, ms, cfg, f / ms / 1e9))
            forward(op, FWD_CONFIGS[1], causal)
            delta(op)
            for level in LADDER["dQ"]:
                cfg, ms = _best(lambda c: dq(op, c, causal, level), DQ_CONFIGS, f"dQ RECIPE={level}")
                rows.append((s, causal, "dQ", level, ms, cfg, 1.5 * f / ms / 1e9))  # 3 of the forward's 2 matmuls
    print(f"\nRECIPE ladder, B = 1, H = {heads}, D = 128 (dQ TFLOP/s count its 3 matmuls)\n")
    print("| S | causal | kernel | RECIPE | ms | launch | TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    for s, causal, kernel, level, ms, cfg, tf in rows:
        print(f"| {s} | {causal} | {kernel} | {level} | {ms:.3f} | {cfg} | {tf:.0f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", default="4096,8192,16384")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ladder", action="store_true", help="time the RECIPE levels instead (B = 1)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
          f"python {platform.python_version()}", flush=True)
    if args.ladder:
        return ladder([int(x) for x in args.seqlens.split(",")], args.heads, dev)
    for fp8 in (True, False):
        for causal in (True, False):
            check(fp8, causal, dev)
    rows = []
    for s in [int(x) for x in args.seqlens.split(",")]:
        b, h, d = args.tokens // s, args.heads, 128
        gen = torch.Generator(device=dev).manual_seed(s)
        q, k, v, do = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
        for causal in (True, False):
            f = bench_attention.flops("fwd", b, h, s, d, causal)
            res = {"S": s, "causal": causal}
            for be in ("cudnn", "flash"):
                res[f"sdpa_{be}"] = _times(bench_attention._sdpa_fn(be, causal), q, k, v)
            res["fp8_delta"] = _times(bench_attention._ours_fn("fp8_delta", causal), q, k, v)
            for fp8 in (True, False):
                name = "textbook_fp8" if fp8 else "textbook_bf16"
                op = Operands(q, k, v, do, fp8)
                print(f"S={s} causal={causal} {name}", flush=True)
                cf, tf = _best(lambda c: forward(op, c, causal), FWD_CONFIGS, "forward")
                forward(op, cf, causal)
                ck, _ = _best(lambda c: dkdv(op, c, causal), DKDV_CONFIGS, "dK/dV")
                cq, _ = _best(lambda c: dq(op, c, causal), DQ_CONFIGS, "dQ")

                def step():
                    forward(op, cf, causal)
                    delta(op)
                    dkdv(op, ck, causal)
                    dq(op, cq, causal)
                res[name] = (tf, do_bench(step, return_mode="median"))
                res[name + "_configs"] = (cf, ck, cq)
            rows.append((res, f))
            print(res, flush=True)
    names = ["sdpa_cudnn", "sdpa_flash", "fp8_delta", "textbook_fp8", "textbook_bf16"]
    print("\nTFLOP/s (x cuDNN); H = %d, D = 128, %d tokens per batch\n" % (args.heads, args.tokens))
    print("| S | causal | mode | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for res, f in rows:
        for i, mode in enumerate(("fwd", "fwd+bwd")):
            ff = f * bench_attention.FLOP_FACTOR["fwdbwd" if i else "fwd"]
            cudnn = ff / res["sdpa_cudnn"][i] / 1e9
            cells = [f"{ff / res[n][i] / 1e9:.0f} ({ff / res[n][i] / 1e9 / cudnn:.2f}x)" for n in names]
            print(f"| {res['S']} | {res['causal']} | {mode} | " + " | ".join(cells) + " |")
    print("\nlaunch shapes (forward, dK/dV, dQ) as (BLOCK_M, BLOCK_N, warps, stages):")
    for res, _ in rows:
        print(f"S={res['S']} causal={res['causal']}: fp8 {res['textbook_fp8_configs']}, "
              f"bf16 {res['textbook_bf16_configs']}")


if __name__ == "__main__":
    main()
