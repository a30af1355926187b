"""EXPERIMENT (not used by the package): the FP8 attention forward in Gluon for Hopper.

The dense, head-dim-128 case of ``hf_fp8_attention.kernels.forward`` written one level lower, to
test whether explicit asynchrony beats the Triton kernel:

- K and Vᵀ code tiles arrive by TMA into a 3-deep ring of shared memory (an mbarrier per slot);
- FlashAttention-3's order within a warpgroup: QKᵀ of tile t and P·V of tile t-1 are issued
  together as asynchronous wgmma; tile t's softmax runs while P·V of t-1 is on the tensor cores.

Same maths and codes as the Triton kernel (Q quantized by the package's quantizer in one more
launch); on the H200 the outputs agree with ``triton_forward`` to 2e-5 relative, LSE to 0.

Outcome (H200, Triton 3.6; benchmarks/NOTES.md, "Tried and not kept"): correct, but 0.79-0.88x the
autotuned Triton forward at S >= 4k (causal 403 vs 476 TFLOP/s at S = 8k, non-causal 460 vs 556),
so the package does not use it. 128-row tiles over two warpgroups were slower still (the CTA-wide
barrier before each ring refill keeps the two warpgroups in lockstep), and per-tile scale vectors
by 1-D TMA fault (illegal instruction) whenever a head's scales start at an element offset that is
not a multiple of 4. ``gluon_forward_ws.py`` (a TMA producer warp, two consumer warpgroups, neither
the CTA barrier nor the in-loop scale loads) was no faster: 0.84-0.90x the Triton forward.

Its ~190 PRMT/LOP3 per tile beyond the Triton kernel's come from carrying P's fp8 codes into the
next iteration (a loop-carried fp8 tensor is kept as single bytes and repacked each iteration),
not from the layout conversion. Carrying the codes packed four to an int32 word removed them but
gained only a few percent (0.84-0.91x the Triton forward; benchmarks/NOTES.md, "Tried and not kept").

    python benchmarks/experiments/gluon_forward.py             # on a Hopper GPU: check, then A/B
"""
from __future__ import annotations

import functools
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hf_fp8_attention.config import FP8AttentionConfig, FP8Format  # noqa: E402
from hf_fp8_attention.kernels.quantize import Copies, interpreting, quantize_operands  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:
    gluon = None

BLOCK_M, BLOCK_N, BLOCK_D, NUM_WARPS, STAGES = 64, 128, 128, 4, 3
LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, mask: MaskSpec, config: FP8AttentionConfig) -> str | None:
    """None when :func:`gluon_forward` handles this call, else why not (one short phrase)."""
    if gluon is None:
        return "Triton without Gluon"
    if interpreting() or not q.is_cuda:
        return "not on a CUDA device"
    if _capability(q.device.index)[0] != 9:
        return "not a Hopper (sm_90) GPU"
    if mask.is_varlen or mask.window is not None:
        return "packed sequences or a sliding window"
    if q.shape[-1] != BLOCK_D or config.block_k != BLOCK_N:
        return f"head dim {q.shape[-1]} / key tile {config.block_k} (needs {BLOCK_D} / {BLOCK_N})"
    if any(f is not FP8Format.E4M3 for f in (config.q_format, config.k_format, config.v_format, config.p_format)):
        return "a format other than E4M3"
    if q.shape[2] == 0 or k.shape[2] == 0:
        return "an empty sequence"
    return None


if gluon is not None:
    # The TMA load was renamed between Triton 3.6 (async_copy_global_to_shared) and 3.7 (async_load).
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    # The CTA barrier likewise (thread_barrier in 3.6, barrier later).
    _cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier

    @gluon.jit
    def _load_tile(k_desc, v_desc, k_smem, v_smem, bars, t, slot, kv_row0, vt_row0, BLOCK_N: gl.constexpr):
        """TMA of key tile t: K code rows (BLOCK_N, D) and Vᵀ code columns (D, BLOCK_N) into ring slot ``slot``."""
        bar = bars.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        _tma_load(k_desc, [kv_row0 + t * BLOCK_N, 0], bar, k_smem.index(slot))
        _tma_load(v_desc, [vt_row0, t * BLOCK_N], bar, v_smem.index(slot))

    @gluon.jit
    def _tile_range(m0, SQ, SK, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """Key tiles the query rows [m0, m0 + BLOCK_M) see: [0, t_hi); [1, f_hi) are visible to all of
        them (no mask arithmetic). Tile 0 always takes the masked path: it may be the only (diagonal) one."""
        shift = SK - SQ  # causal diagonal aligned to the end
        t_hi = gl.cdiv(SK, BLOCK_N)
        f_hi = SK // BLOCK_N
        if CAUSAL:
            last = gl.minimum(m0 + BLOCK_M, SQ) - 1 + shift
            t_hi = gl.maximum(gl.minimum(t_hi, gl.cdiv(last + 1, BLOCK_N)), 0)
            f_hi = gl.minimum(f_hi, (m0 + shift + 1) // BLOCK_N)
        f_hi = gl.maximum(gl.minimum(f_hi, t_hi), 1)
        return t_hi, f_hi

    @gluon.jit
    def _softmax(s, ks, m_i, l_i, q2, pos_q, t, SK, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
                 BLOCK_N: gl.constexpr, LOG2_PMAX: gl.constexpr, mma_layout: gl.constexpr, p_layout: gl.constexpr):
        """Tile t's S = Qc·Kcᵀ (BLOCK_M, BLOCK_N) fp32 → its P codes 448·2^(s − m_T) in fp8 (the A operand
        of P·V) and the running (m, l); alpha rescales the accumulator, beta this tile's P·V."""
        x = s * gl.expand_dims(ks, 0)
        if MASKED:
            offs_n = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
            vis = gl.expand_dims(offs_n < SK, 0)
            if CAUSAL:
                vis = vis & (gl.expand_dims(offs_n, 0) <= gl.expand_dims(pos_q, 1))
            x = gl.where(vis, x, float("-inf"))
        m_t = gl.max(x, 1) * q2
        m_new = gl.maximum(m_i, m_t)
        if MASKED:  # rows with no visible key so far: keep exp2 finite
            m_t_ref = gl.where(m_t == float("-inf"), 0.0, m_t)
            m_new_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_t_ref = m_t
            m_new_ref = m_new
        p = gl.exp2(x * gl.expand_dims(q2, 1) - gl.expand_dims(m_t_ref - LOG2_PMAX, 1))
        alpha = gl.exp2(m_i - m_new_ref)
        beta = gl.exp2(m_t - m_new_ref)
        l_i = l_i * alpha + beta * gl.sum(p, 1)
        p8 = gl.convert_layout(p.to(gl.float8e4nv, fp_downcast_rounding="rtne"), p_layout)
        return p8, alpha, beta, m_new, l_i

    @gluon.jit
    def _tiles(t_lo, t_hi, acc, p8, alpha, beta, m_i, l_i, q_smem, k_smem, v_smem, bars, k_desc, v_desc,
               k_scales_ptr, v_scales_ptr, q2, pos_q, SK, t_end, kv_row0, vt_row0, vs_row0, zero_s, zero_o,
               MASKED: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
               BLOCK_D: gl.constexpr, LOG2_PMAX: gl.constexpr, mma_layout: gl.constexpr, p_layout: gl.constexpr):
        """Key tiles t_lo <= t < t_hi, each: issue QKᵀ(t) and P·V(t-1); softmax(t) while P·V(t-1) runs;
        fold P·V(t-1) into acc; refill t-1's ring slot with tile t-1+STAGES."""
        cols: gl.constexpr = gl.SliceLayout(0, mma_layout)
        for t in range(t_lo, t_hi):
            slot = t % STAGES
            prev = (t - 1) % STAGES
            mbarrier.wait(bars.index(slot), (t // STAGES) & 1)
            s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            pv = warpgroup_mma(p8, v_smem.index(prev).permute((1, 0)), zero_o, use_acc=False, is_async=True)
            offs_n = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols)
            if MASKED:
                ks = gl.load(k_scales_ptr + kv_row0 + offs_n, mask=offs_n < SK, other=0.0)
            else:
                ks = gl.load(k_scales_ptr + kv_row0 + offs_n)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
            p8_new, alpha_new, beta_new, m_i, l_i = _softmax(s, ks, m_i, l_i, q2, pos_q, t, SK, MASKED, CAUSAL,
                                                             BLOCK_N, LOG2_PMAX, mma_layout, p_layout)
            vs = gl.load(v_scales_ptr + vs_row0 + (t - 1) * BLOCK_D + gl.arange(0, BLOCK_D, layout=cols))
            pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv, ))
            acc = acc * gl.expand_dims(alpha, 1) + pv * (gl.expand_dims(beta, 1) * gl.expand_dims(vs, 0))
            p8, alpha, beta = p8_new, alpha_new, beta_new
            _cta_barrier()  # every warp is done with slot `prev` before the TMA overwrites it
            if t - 1 + STAGES < t_end:
                _load_tile(k_desc, v_desc, k_smem, v_smem, bars, t - 1 + STAGES, prev, kv_row0, vt_row0, BLOCK_N)
        return acc, p8, alpha, beta, m_i, l_i

    @gluon.jit
    def _fwd_kernel(
        q_desc, k_desc, v_desc,  # TMA descriptors of the codes: Q (B·Hq·Sq, D), K (B·Hkv·Sk, D), Vᵀ (B·Hkv·D, S_pad)
        q_scales_ptr, k_scales_ptr, v_scales_ptr,  # fp32 scales: Q (B·Hq·Sq), K (B·Hkv·Sk), V (B·Hkv·NT·D)
        out_ptr, sob, soh, sos, lse_ptr,  # out (B, Hq, Sq, D) in the input dtype, unit last stride; lse (B, Hq, Sq)
        HQ, HKV, SQ, SK, NT, qk_scale,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, CAUSAL: gl.constexpr,
        STAGES: gl.constexpr, LOG2_PMAX: gl.constexpr, num_warps: gl.constexpr,
    ):
        n_m = gl.num_programs(0)
        m_blk = n_m - 1 - gl.program_id(0)  # heaviest (last, under a causal mask) query tiles first
        bh = gl.program_id(1)
        b = bh // HQ
        h = bh % HQ
        hk = h // (HQ // HKV)
        m0 = m_blk * BLOCK_M

        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=4)
        rows: gl.constexpr = gl.SliceLayout(1, mma_layout)
        cols: gl.constexpr = gl.SliceLayout(0, mma_layout)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        mbarrier.init(q_bar, count=1)

        q_row0 = (b * HQ + h) * SQ
        kv_row0 = (b * HKV + hk) * SK
        vt_row0 = (b * HKV + hk) * BLOCK_D
        vs_row0 = (b * HKV + hk) * NT * BLOCK_D
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        _tma_load(q_desc, [q_row0 + m0, 0], q_bar, q_smem)

        t_hi, f_hi = _tile_range(m0, SQ, SK, BLOCK_M, BLOCK_N, CAUSAL)
        for i in gl.static_range(STAGES):
            if i < t_hi:
                _load_tile(k_desc, v_desc, k_smem, v_smem, bars, i, i, kv_row0, vt_row0, BLOCK_N)

        offs_m = m0 + gl.arange(0, BLOCK_M, layout=rows)
        m_ok = offs_m < SQ
        pos_q = offs_m + (SK - SQ)  # causal diagonal aligned to the end
        q2 = gl.load(q_scales_ptr + q_row0 + offs_m, mask=m_ok, other=1.0) * qk_scale

        zero_s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
        zero_o = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, mma_layout)
        acc = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, mma_layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, rows)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, rows)
        mbarrier.wait(q_bar, 0)
        if t_hi > 0:
            mbarrier.wait(bars.index(0), 0)
            s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False)
            offs_n = gl.arange(0, BLOCK_N, layout=cols)
            ks = gl.load(k_scales_ptr + kv_row0 + offs_n, mask=offs_n < SK, other=0.0)
            p8, alpha, beta, m_i, l_i = _softmax(s, ks, m_i, l_i, q2, pos_q, 0, SK, True, CAUSAL, BLOCK_N, LOG2_PMAX,
                                                 mma_layout, p_layout)
            acc, p8, alpha, beta, m_i, l_i = _tiles(
                1, f_hi, acc, p8, alpha, beta, m_i, l_i, q_smem, k_smem, v_smem, bars, k_desc, v_desc, k_scales_ptr,
                v_scales_ptr, q2, pos_q, SK, t_hi, kv_row0, vt_row0, vs_row0, zero_s, zero_o, False, CAUSAL, STAGES,
                BLOCK_N, BLOCK_D, LOG2_PMAX, mma_layout, p_layout)
            acc, p8, alpha, beta, m_i, l_i = _tiles(
                f_hi, t_hi, acc, p8, alpha, beta, m_i, l_i, q_smem, k_smem, v_smem, bars, k_desc, v_desc, k_scales_ptr,
                v_scales_ptr, q2, pos_q, SK, t_hi, kv_row0, vt_row0, vs_row0, zero_s, zero_o, True, CAUSAL, STAGES,
                BLOCK_N, BLOCK_D, LOG2_PMAX, mma_layout, p_layout)
            # P·V of the last tile.
            last_slot = (t_hi - 1) % STAGES
            pv = warpgroup_mma(p8, v_smem.index(last_slot).permute((1, 0)), zero_o, use_acc=False)
            vs = gl.load(v_scales_ptr + vs_row0 + (t_hi - 1) * BLOCK_D + gl.arange(0, BLOCK_D, layout=cols))
            acc = acc * gl.expand_dims(alpha, 1) + pv * (gl.expand_dims(beta, 1) * gl.expand_dims(vs, 0))
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        mbarrier.invalidate(q_bar)

        empty = l_i == 0.0  # no visible key: O = 0, LSE = -inf
        out = acc / gl.expand_dims(gl.where(empty, 1.0, l_i), 1)
        lse = gl.where(empty, float("-inf"),
                       (m_i + gl.log2(gl.where(empty, 1.0, l_i)) - LOG2_PMAX) * 0.6931471805599453)
        offs_d = gl.arange(0, BLOCK_D, layout=cols)
        o_ptrs = (out_ptr + b.to(gl.int64) * sob + h.to(gl.int64) * soh + gl.expand_dims(offs_m, 1).to(gl.int64) * sos
                  + gl.expand_dims(offs_d, 0))
        gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(m_ok, 1))
        gl.store(lse_ptr + (b * HQ + h) * SQ + offs_m, lse, mask=m_ok)


def _descriptor(codes_2d: torch.Tensor, block: list[int], layout) -> "TensorDescriptor":
    return TensorDescriptor(codes_2d, list(codes_2d.shape), list(codes_2d.stride()), block, layout)


def launch_operands(q, k, v, config: FP8AttentionConfig, q_rows: int):
    """Everything a Gluon forward launch reads, for q ``(B, Hq, Sq, 128)``, k, v ``(B, Hkv, Sk, 128)``:
    TMA descriptors of the Q / K / Vᵀ codes (Q tiles of ``q_rows`` rows), the fp32 Q / K / V scales,
    and the outputs ``out (B, Hq, Sq, 128)`` in q's dtype and ``lse (B, Hq, Sq)`` fp32 to fill."""
    bsz, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    (q_codes, q_scales, _, _, _), = quantize_operands((q, ), (Copies(row=True, col=False, fmt=config.q_format), ),
                                                      block=BLOCK_N, pow2=config.pow2_scales)
    (k_codes, k_scales, _, _, _), (_, _, vt_codes, v_scales, _) = quantize_operands(
        (k, v), (Copies(row=True, col=False, fmt=config.k_format), Copies(row=False, col=True, fmt=config.v_format)),
        block=BLOCK_N, pow2=config.pow2_scales)
    q_layout = gl.NVMMASharedLayout.get_default_for([q_rows, BLOCK_D], gl.float8e4nv)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], gl.float8e4nv)
    # Tiles past the end of a head read the next head's codes (masked: their keys are beyond Sk,
    # their query rows are not stored) or TMA's zero fill past the end of the tensor.
    descs = (_descriptor(q_codes.view(bsz * hq * sq, d), [q_rows, BLOCK_D], q_layout),
             _descriptor(k_codes.view(bsz * hkv * sk, d), [BLOCK_N, BLOCK_D], kv_layout),
             _descriptor(vt_codes.view(bsz * hkv * d, vt_codes.shape[-1]), [BLOCK_D, BLOCK_N], kv_layout))
    out = torch.empty(bsz, hq, sq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(bsz, hq, sq, dtype=torch.float32, device=q.device)
    return descs, (q_scales, k_scales, v_scales), out, lse


def gluon_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool, config: FP8AttentionConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of ``triton_forward`` for the calls :func:`unsupported_reason` accepts.

    Args:
        q: ``(B, Hq, Sq, 128)``, k, v: ``(B, Hkv, Sk, 128)`` bf16/fp16/fp32 CUDA tensors, any strides.
    Returns:
        ``out (B, Hq, Sq, 128)`` in q's dtype (contiguous) and ``lse (B, Hq, Sq)`` fp32.
    """
    bsz, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    descs, scales, out, lse = launch_operands(q, k, v, config, BLOCK_M)
    _fwd_kernel[(triton.cdiv(sq, BLOCK_M), bsz * hq)](
        *descs, *scales, out, out.stride(0), out.stride(1), out.stride(2), lse,
        hq, hkv, sq, sk, scales[2].shape[2], float(scale) * LOG2E,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, CAUSAL=bool(causal), STAGES=STAGES,
        LOG2_PMAX=math.log2(config.p_format.max), num_warps=NUM_WARPS)
    return out, lse


def compare_with_triton(forward, name: str) -> int:
    """On a Hopper GPU: agreement of ``forward`` (``gluon_forward``'s signature) with ``triton_forward``
    on odd shapes, then TFLOP/s of both and of SDPA cuDNN (bf16) at 16k tokens per batch, H = 16.
    Returns 2 (and says why) where the Gluon kernels cannot run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from hf_fp8_attention.kernels.forward import triton_forward

    cfg = FP8AttentionConfig()
    probe = torch.empty(1, 1, 1, BLOCK_D, device="cuda" if torch.cuda.is_available() else "cpu")
    reason = unsupported_reason(probe, probe, MaskSpec(), cfg)
    if reason is not None:
        print(f"{name}: does not run here ({reason})")
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)  # noqa: E731
    for b, hq, hkv, sq, sk in ((2, 4, 2, 1, 1), (2, 4, 2, 17, 17), (1, 4, 2, 1000, 4097), (1, 4, 2, 1000, 300),
                               (2, 8, 8, 2048, 2048)):
        q, k, v = rand(b, hq, sq, BLOCK_D), rand(b, hkv, sk, BLOCK_D), rand(b, hkv, sk, BLOCK_D)
        for causal in (True, False):
            got, got_lse = forward(q, k, v, scale=BLOCK_D**-0.5, causal=causal, config=cfg)
            want, want_lse = triton_forward(q, k, v, scale=BLOCK_D**-0.5, mask=MaskSpec(causal=causal), config=cfg)
            fin = torch.isfinite(want_lse)
            rel = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()
            dlse = (got_lse[fin] - want_lse[fin]).abs().max().item() if fin.any() else 0.0
            same_empty = torch.equal(torch.isneginf(got_lse), torch.isneginf(want_lse))
            print(f"check {name} B={b} Hq={hq} Hkv={hkv} Sq={sq} Sk={sk} causal={causal}: rel O {rel:.1e}, "
                  f"max |dLSE| {dlse:.1e}, same rows without keys {same_empty}", flush=True)
    for causal in (True, False):
        for s in (4096, 8192, 16384):
            b = 16384 // s
            q, k, v = rand(b, 16, s, BLOCK_D), rand(b, 16, s, BLOCK_D), rand(b, 16, s, BLOCK_D)
            flops = 4 * b * 16 * s * s * BLOCK_D / (2 if causal else 1)
            mask = MaskSpec(causal=causal)
            ms = {  # triton_forward tunes its launch for this length bucket on its first call
                name: do_bench(lambda: forward(q, k, v, scale=BLOCK_D**-0.5, causal=causal, config=cfg)),
                "triton": do_bench(lambda: triton_forward(q, k, v, scale=BLOCK_D**-0.5, mask=mask, config=cfg)),
            }
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ms["cudnn"] = do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v,
                                                                                             is_causal=causal))
            tf = {n: flops / t / 1e9 for n, t in ms.items()}
            print(f"TFLOP/s causal={causal} S={s} B={b}: " + ", ".join(f"{n} {x:.0f}" for n, x in tf.items())
                  + f"; {name} / triton {tf[name] / tf['triton']:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(compare_with_triton(gluon_forward, "gluon_forward"))
