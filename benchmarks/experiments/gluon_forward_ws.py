"""EXPERIMENT (not used by the package): the warp-specialized version of ``gluon_forward.py``.

Outcome (H200, Triton 3.6; benchmarks/NOTES.md, "Tried and not kept"): correct (rel O <= 2.1e-5 against
``triton_forward``, LSE equal, on every odd shape; ``results/h200_v12_gluon_ws.log``), but
0.84-0.90x the Triton forward at S >= 4k: 417 vs 480 TFLOP/s causal and 461 vs 549 non-causal at
S = 8k. Nsight Compute (``results/h200_v12_ncu_summary.txt``): its loop issues more instructions per
tile than Triton's (908 vs 792; the P-code layout conversion alone takes about 190 PRMT/LOP3 against
Triton's 16 PRMT), and its consumers stall on the ring's barriers 29% of the time.

Why: the non-specialized Gluon kernel ran at 0.79-0.88x the Triton forward. With 128-row tiles it
needed a CTA-wide barrier before every refill of the K/V ring (both warpgroups read each slot),
which kept its two warpgroups in lockstep; with 64-row tiles every CTA streams all of K and V from
L2 on its own, and each warpgroup issues its own TMA and loads its own scale vectors on the
critical path. Here, as in FlashAttention-3:

- a producer warp (24 registers) issues the TMA of Q, K and Vᵀ code tiles into a STAGES-deep ring
  and stages each tile's K and V scale vectors into shared memory with plain loads (a 1-D TMA of
  those vectors faults at unaligned offsets), then arrives on the slot's ``ready`` barrier;
- two consumer warpgroups (64 query rows each, 128 per CTA, sharing every K/V tile) run the
  softmax and the asynchronous wgmma of ``gluon_forward.py`` and release a slot by arriving on its
  ``empty`` barrier (count 2: both must be done) — no CTA-wide barrier anywhere.

Both consumers walk the CTA's key-tile range (the producer loads each tile once); on a tile that
none of a warpgroup's rows can see, its masked softmax leaves (m, l, acc) unchanged.

    python benchmarks/experiments/gluon_forward_ws.py          # on a Hopper GPU: check, then A/B
    python benchmarks/experiments/gluon_forward_ws.py --compile-only   # any machine: sm_90a build
    python benchmarks/experiments/gluon_forward_ws.py --overlap-window # any machine: what overlaps P·V

What overlaps P·V in the SASS (``--overlap-window``): ptxas puts the wait for P·V
in front of the softmax's first warp shuffle (the row max), so only the K-scale multiply and the
mask (105-285 SASS instructions per loop, no exp2) run while P·V is in flight, although the PTX
has the whole softmax between the two waits. With the row max and row sum replaced by shuffle-free
stand-ins (a diagnostic build, wrong numerics), 41-42 exp2 move into the window. Forcing the
overlap with a row max through shared memory (``gluon_forward_ws_smem_row_max.diff``: all 64 exp2
in the window of the non-causal loop) made the kernel 4-8% slower, so the missing overlap is not
what limits it.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gluon_forward import (  # noqa: E402  (the shared pieces of the non-specialized kernel)
    BLOCK_D, BLOCK_N, LOG2E, FP8AttentionConfig, compare_with_triton, gluon, launch_operands,
)

WS_BLOCK_M, WS_STAGES = 128, 3  # two consumer warpgroups of 64 rows; K/V ring depth
CONSUMER_REGS, PRODUCER_REGS, MAXNREG = 232, 24, 168  # 4 + 4 + 1 (-> 4) warps: 128·(168·12) <= 64K

if gluon is not None:
    from gluon_forward import _softmax, _tile_range, _tma_load, gl, mbarrier, warpgroup_mma, warpgroup_mma_wait

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, ks_smem, vs_smem, q_bars, ready, empty,
                  k_scales_ptr, v_scales_ptr, m0, q_row0, kv_row0, vt_row0, vs_row0, SQ, SK,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, CAUSAL: gl.constexpr,
                  STAGES: gl.constexpr):
        """One warp: Q's two 64-row halves, then per key tile t its K rows, Vᵀ columns (TMA) and its K
        and V scale vectors (loads + shared stores) into ring slot t % STAGES once both consumers
        have released it."""
        HALF: gl.constexpr = BLOCK_M // 2
        for w in gl.static_range(2):
            mbarrier.expect(q_bars.index(w), q_desc.block_type.nbytes)
            _tma_load(q_desc, [q_row0 + m0 + w * HALF, 0], q_bars.index(w), q_smem.index(w))
        t_hi, f_hi = _tile_range(m0, SQ, SK, BLOCK_M, BLOCK_N, CAUSAL)
        vec: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])
        offs = gl.arange(0, BLOCK_N, layout=vec)
        for t in range(0, t_hi):
            slot = t % STAGES
            # mbarriers start with phase 1 complete: the first round over the ring does not wait.
            mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            _tma_load(k_desc, [kv_row0 + t * BLOCK_N, 0], bar, k_smem.index(slot))
            _tma_load(v_desc, [vt_row0, t * BLOCK_N], bar, v_smem.index(slot))
            keys = t * BLOCK_N + offs
            ks_smem.index(slot).store(gl.load(k_scales_ptr + kv_row0 + keys, mask=keys < SK, other=0.0))
            vs_smem.index(slot).store(gl.load(v_scales_ptr + vs_row0 + t * BLOCK_D + offs))
            mbarrier.arrive(bar, count=1)  # the second of the slot's two arrivals (expect is the first)

    @gluon.jit
    def _consumer_tiles(t_lo, t_hi, acc, p8, alpha, beta, m_i, l_i, q_tile, k_smem, v_smem, ks_smem, vs_smem,
                        ready, empty, q2, pos_q, SK, zero_s, zero_o, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
                        STAGES: gl.constexpr, BLOCK_N: gl.constexpr, LOG2_PMAX: gl.constexpr,
                        mma_layout: gl.constexpr, p_layout: gl.constexpr):
        """gluon_forward's loop with the ring's barriers: QKᵀ(t) and P·V(t-1) in flight together,
        softmax(t) during P·V(t-1), then slot t-1 released to the producer."""
        cols: gl.constexpr = gl.SliceLayout(0, mma_layout)
        for t in range(t_lo, t_hi):
            slot = t % STAGES
            prev = (t - 1) % STAGES
            mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
            s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            pv = warpgroup_mma(p8, v_smem.index(prev).permute((1, 0)), zero_o, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
            ks = ks_smem.index(slot).load(cols)
            p8_new, alpha_new, beta_new, m_i, l_i = _softmax(s, ks, m_i, l_i, q2, pos_q, t, SK, MASKED, CAUSAL,
                                                             BLOCK_N, LOG2_PMAX, mma_layout, p_layout)
            pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv, ))
            vs = vs_smem.index(prev).load(cols)
            mbarrier.arrive(empty.index(prev), count=1)
            acc = acc * gl.expand_dims(alpha, 1) + pv * (gl.expand_dims(beta, 1) * gl.expand_dims(vs, 0))
            p8, alpha, beta = p8_new, alpha_new, beta_new
        return acc, p8, alpha, beta, m_i, l_i

    @gluon.jit
    def _consumer(q_smem, k_smem, v_smem, ks_smem, vs_smem, q_bars, ready, empty, q_scales_ptr, out_ptr, lse_ptr,
                  m0, q_row0, lse_row0, out_off, sos, SQ, SK, qk_scale, WG: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                  LOG2_PMAX: gl.constexpr):
        """One warpgroup: query rows m0 + WG·64 .. + 64 of the CTA's tile; writes their O and LSE."""
        HALF: gl.constexpr = BLOCK_M // 2
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=4)
        rows: gl.constexpr = gl.SliceLayout(1, mma_layout)
        cols: gl.constexpr = gl.SliceLayout(0, mma_layout)

        offs_m = m0 + WG * HALF + gl.arange(0, HALF, layout=rows)
        m_ok = offs_m < SQ
        pos_q = offs_m + SK - SQ
        q2 = gl.load(q_scales_ptr + q_row0 + offs_m, mask=m_ok, other=1.0) * qk_scale
        t_hi, f_hi = _tile_range(m0, SQ, SK, BLOCK_M, BLOCK_N, CAUSAL)

        zero_s = gl.zeros([HALF, BLOCK_N], gl.float32, mma_layout)
        zero_o = gl.zeros([HALF, BLOCK_D], gl.float32, mma_layout)
        acc = gl.zeros([HALF, BLOCK_D], gl.float32, mma_layout)
        l_i = gl.zeros([HALF], gl.float32, rows)
        m_i = gl.full([HALF], float("-inf"), gl.float32, rows)
        q_tile = q_smem.index(WG)
        mbarrier.wait(q_bars.index(WG), 0)
        if t_hi > 0:
            mbarrier.wait(ready.index(0), 0)
            s = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), zero_s, use_acc=False)
            ks = ks_smem.index(0).load(cols)
            p8, alpha, beta, m_i, l_i = _softmax(s, ks, m_i, l_i, q2, pos_q, 0, SK, True, CAUSAL, BLOCK_N, LOG2_PMAX,
                                                 mma_layout, p_layout)
            acc, p8, alpha, beta, m_i, l_i = _consumer_tiles(
                1, f_hi, acc, p8, alpha, beta, m_i, l_i, q_tile, k_smem, v_smem, ks_smem, vs_smem, ready, empty, q2,
                pos_q, SK, zero_s, zero_o, False, CAUSAL, STAGES, BLOCK_N, LOG2_PMAX, mma_layout, p_layout)
            acc, p8, alpha, beta, m_i, l_i = _consumer_tiles(
                f_hi, t_hi, acc, p8, alpha, beta, m_i, l_i, q_tile, k_smem, v_smem, ks_smem, vs_smem, ready, empty,
                q2, pos_q, SK, zero_s, zero_o, True, CAUSAL, STAGES, BLOCK_N, LOG2_PMAX, mma_layout, p_layout)
            last = (t_hi - 1) % STAGES
            pv = warpgroup_mma(p8, v_smem.index(last).permute((1, 0)), zero_o, use_acc=False)
            vs = vs_smem.index(last).load(cols)
            acc = acc * gl.expand_dims(alpha, 1) + pv * (gl.expand_dims(beta, 1) * gl.expand_dims(vs, 0))

        empty_row = l_i == 0.0  # no visible key: O = 0, LSE = -inf
        out = acc / gl.expand_dims(gl.where(empty_row, 1.0, l_i), 1)
        lse = gl.where(empty_row, float("-inf"),
                       (m_i + gl.log2(gl.where(empty_row, 1.0, l_i)) - LOG2_PMAX) * 0.6931471805599453)
        offs_d = gl.arange(0, BLOCK_D, layout=cols)
        o_ptrs = out_ptr + out_off + gl.expand_dims(offs_m, 1).to(gl.int64) * sos + gl.expand_dims(offs_d, 0)
        gl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(m_ok, 1))
        gl.store(lse_ptr + lse_row0 + offs_m, lse, mask=m_ok)

    @gluon.jit
    def _ws_fwd_kernel(
        q_desc, k_desc, v_desc,  # TMA descriptors of the codes: Q (B·Hq·Sq, D), K (B·Hkv·Sk, D), Vᵀ (B·Hkv·D, S_pad)
        q_scales_ptr, k_scales_ptr, v_scales_ptr,  # fp32 scales: Q (B·Hq·Sq), K (B·Hkv·Sk), V (B·Hkv·NT·D)
        out_ptr, sob, soh, sos, lse_ptr,  # out (B, Hq, Sq, D) in the input dtype, unit last stride; lse (B, Hq, Sq)
        HQ, HKV, SQ, SK, NT, qk_scale,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, CAUSAL: gl.constexpr,
        STAGES: gl.constexpr, LOG2_PMAX: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        gl.static_assert(BLOCK_D == BLOCK_N, "the producer loads K's and V's scale vectors with one layout")
        n_m = gl.num_programs(0)
        m_blk = n_m - 1 - gl.program_id(0)  # heaviest (last, under a causal mask) query tiles first
        bh = gl.program_id(1)
        b = bh // HQ
        h = bh % HQ
        hk = h // (HQ // HKV)
        m0 = m_blk * BLOCK_M
        q_row0 = (b * HQ + h) * SQ
        kv_row0 = (b * HKV + hk) * SK
        vt_row0 = (b * HKV + hk) * BLOCK_D
        vs_row0 = (b * HKV + hk) * NT * BLOCK_D
        out_off = b.to(gl.int64) * sob + h.to(gl.int64) * soh

        scale_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        ks_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], scale_layout)
        vs_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_D], scale_layout)
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(q_bars.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=2)  # the producer's expect (TMA bytes) and its scale stores
            mbarrier.init(empty.index(i), count=2)  # both consumer warpgroups

        lse_row0 = (b * HQ + h) * SQ
        # The constexprs are written into each partition's argument tuple directly: passing them
        # through a tuple variable did not compile with Triton 3.6.
        gl.warp_specialize([
            (_consumer, (q_smem, k_smem, v_smem, ks_smem, vs_smem, q_bars, ready, empty, q_scales_ptr, out_ptr,
                         lse_ptr, m0, q_row0, lse_row0, out_off, sos, SQ, SK, qk_scale, 0, BLOCK_M, BLOCK_N, BLOCK_D,
                         CAUSAL, STAGES, LOG2_PMAX)),
            (_consumer, (q_smem, k_smem, v_smem, ks_smem, vs_smem, q_bars, ready, empty, q_scales_ptr, out_ptr,
                         lse_ptr, m0, q_row0, lse_row0, out_off, sos, SQ, SK, qk_scale, 1, BLOCK_M, BLOCK_N, BLOCK_D,
                         CAUSAL, STAGES, LOG2_PMAX)),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, ks_smem, vs_smem, q_bars, ready, empty,
                         k_scales_ptr, v_scales_ptr, m0, q_row0, kv_row0, vt_row0, vs_row0, SQ, SK, BLOCK_M, BLOCK_N,
                         BLOCK_D, CAUSAL, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def gluon_forward_ws(q, k, v, *, scale: float, causal: bool, config: FP8AttentionConfig):
    """``gluon_forward`` with the warp-specialized kernel: q ``(B, Hq, Sq, 128)``, k, v ``(B, Hkv, Sk,
    128)`` CUDA tensors → ``out (B, Hq, Sq, 128)`` in q's dtype, ``lse (B, Hq, Sq)`` fp32."""
    bsz, hq, sq, _ = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    descs, scales, out, lse = launch_operands(q, k, v, config, WS_BLOCK_M // 2)
    _ws_fwd_kernel[(triton.cdiv(sq, WS_BLOCK_M), bsz * hq)](
        *descs, *scales, out, out.stride(0), out.stride(1), out.stride(2), lse,
        hq, hkv, sq, sk, scales[2].shape[2], float(scale) * LOG2E,
        BLOCK_M=WS_BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, CAUSAL=bool(causal), STAGES=WS_STAGES,
        LOG2_PMAX=math.log2(config.p_format.max), CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS,
        num_warps=4, maxnreg=MAXNREG)
    return out, lse


def compile_offline(causal: bool = True):
    """Build for sm_90a on any machine (no GPU): the CompiledKernel (asm: ttgir, ptx, cubin)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    q_layout = gl.NVMMASharedLayout.get_default_for([WS_BLOCK_M // 2, BLOCK_D], gl.float8e4nv)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_D], gl.float8e4nv)
    desc = lambda shape, lay: f"tensordesc<fp8e4nv[{shape[0]},{shape[1]}],{lay!r}>"  # noqa: E731
    names = list(_ws_fwd_kernel.arg_names)
    sig = {n: "i32" for n in names}
    sig.update(q_desc=desc((WS_BLOCK_M // 2, BLOCK_D), q_layout), k_desc=desc((BLOCK_N, BLOCK_D), kv_layout),
               v_desc=desc((BLOCK_D, BLOCK_N), kv_layout), q_scales_ptr="*fp32", k_scales_ptr="*fp32",
               v_scales_ptr="*fp32", out_ptr="*bf16", lse_ptr="*fp32", qk_scale="fp32")
    consts = dict(BLOCK_M=WS_BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, CAUSAL=causal, STAGES=WS_STAGES,
                  LOG2_PMAX=math.log2(448.0), CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS)
    for n in consts:
        sig[n] = "constexpr"
    src = GluonASTSource(_ws_fwd_kernel, sig, constexprs={(names.index(n), ): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=MAXNREG))


def overlap_window(kernel) -> list[tuple[int, int]]:
    """Per consumer loop of a compiled kernel: (SASS instructions, MUFU.EX2 among them) between the
    wait for QKᵀ (``WARPGROUP.DEPBAR.LE gsb0, 0x1``) and the wait for P·V (``... 0x0``): the work
    that actually overlaps P·V, whatever order the source and the PTX give."""
    from triton.tools.disasm import get_sass

    lines = get_sass(kernel.asm["cubin"]).splitlines()
    waits = [(i, line) for i, line in enumerate(lines) if "WARPGROUP.DEPBAR.LE" in line]
    return [(j - i, sum("MUFU.EX2" in s for s in lines[i:j])) for (i, a), (j, b) in zip(waits, waits[1:])
            if a.rstrip().endswith("0x1;") and b.rstrip().endswith("0x0;")]


def main(argv: list[str]) -> int:
    if "--overlap-window" in argv:
        for causal in (True, False):
            print(f"causal={causal}: (instructions, exp2) between the QKᵀ and P·V waits per loop: "
                  f"{overlap_window(compile_offline(causal))}", flush=True)
        return 0
    if "--compile-only" in argv:
        for causal in (True, False):
            kernel = compile_offline(causal)
            print(f"causal={causal}: compiled for sm_90a, shared memory {kernel.metadata.shared} B", flush=True)
        return 0
    return compare_with_triton(gluon_forward_ws, "gluon_forward_ws")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
