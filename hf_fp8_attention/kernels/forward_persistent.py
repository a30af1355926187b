"""The Gluon forward (forward_gluon.py) as a persistent kernel: one program per SM, each running a
list of query blocks one after the other.

Why: the per-block kernel runs one program per SM, and each program spends a few µs before its
first QKᵀ (Q's codes made or loaded, the ring of key tiles filled) and after its last P·V (O and LSE
stored) with nothing else on its SM (on the H100 about 3 µs a program before the first product with
Q's codes made in the kernel: benchmarks/NOTES.md, "Forward"). Here the producer warp goes on to the
next block's Q and key tiles as soon as ring slots free up, so the next block's operands are in
shared memory while the consumers finish the current one.

Each block is computed exactly as forward_gluon's ``_fwd_kernel`` computes it (the same consumer
code, :func:`.forward_gluon._attend_rows`), so O and LSE are the per-block kernel's bit for bit.
With Q_IN the producer brings the block's 16-bit Q by TMA (two boxes of HALF_Q tokens: Q head-major
or token-major, :func:`q_rows`) into one staging buffer, which each consumer warpgroup rotates by a
wgmma from shared memory and releases at once; without it, Q's codes come by TMA into two buffers
used in turn.

Which blocks a program runs: :func:`.persistent_schedule.schedule`, the per-block grid's launch
order given to the programs as the GPU would start them.
"""
from __future__ import annotations

import functools

import torch

from .gluon_hopper import TensorDescriptor, gluon
from .launch import launch as launch_kernel
from .persistent_schedule import launch_table

if gluon is not None:
    from . import forward_gluon as fg
    from .gluon_hopper import (
        gl, mbarrier, mma_layout, program_entries, ring_barriers, ring_tiles, scheduled_block, tma_load,
        warpgroup_mma, warpgroup_mma_wait,
    )


def q_row_layout(q: torch.Tensor) -> tuple[tuple[int, int], int, int, int, int] | None:
    """How :func:`q_rows` views ``q`` (B, H, S, D), without building the view: ((rows, columns), the
    row stride, RB, RH, CH), or None for strides it cannot view (a cheap check for the scope rule)."""
    b, h, s, d = q.shape
    sb, sh, ss, sd = q.stride()
    if sd != 1 or q.storage_offset() != 0:
        return None
    if ss == d and (h == 1 or sh == s * d) and (b == 1 or sb == h * s * d):
        return (b * h * s, d), d, h * s, s, 0
    if ss == h * d and (h == 1 or sh == d) and (b == 1 or sb == s * h * d):
        return (b * s, h * d), h * d, s, 0, d
    return None


def q_rows(q: torch.Tensor) -> tuple[torch.Tensor, int, int, int] | None:
    """``q`` (B, H, S, D) as the 2-D tensor a TMA box of HALF_Q tokens of one head reads, and how a
    token's row and column follow from (batch b, head h, token s): (q2d, RB, RH, CH) with row =
    b·RB + h·RH + s, column = h·CH. Head-major q (contiguous): rows (B·H·S, D); token-major q (an
    attention layer's (B, S, H, D) transposed): rows (B·S, H·D). None for other strides."""
    layout = q_row_layout(q)
    if layout is None:
        return None
    shape, row_stride, rb, rh, ch = layout
    return q.as_strided(shape, (row_stride, 1)), rb, rh, ch


@functools.lru_cache(maxsize=None)
def _q_layout(dtype: torch.dtype, d: int):
    """The MMA shared layout of a (HALF_Q, d) box of the 16-bit Q."""
    return gl.NVMMASharedLayout.get_default_for([fg.HALF_Q, d], gl.bfloat16 if dtype == torch.bfloat16
                                                else gl.float16)


def launch(descs: tuple, h_desc, q: torch.Tensor | None, q_head_amax, q_scales, k_scales, v_scales, out, lse, *,
           b: int, hq: int, sq: int, sk: int, groups: int, qk_scale: float, slack: float, causal: bool,
           pow2: bool, block_n: int) -> None:
    """forward_gluon.gluon_forward's launch, persistent: ``descs`` its (Q's codes or None, K's codes,
    Vᵀ's codes) descriptors, ``h_desc`` the Hadamard matrix's (Q_IN) or None; ``q`` the 16-bit input
    Q where the kernel makes the codes (it must have :func:`q_rows`), else None; the other tensors
    and numbers as there; ``block_n`` keys per tile."""
    n_blk = sq // fg.BLOCK_M
    table, n_prog = launch_table(n_blk, b * hq, sk, causal, fg.head_group(causal), out.device)
    q_in = q is not None
    if q_in:
        q2d, rb, rh, ch = q_rows(q)
        q_desc = TensorDescriptor(q2d, list(q2d.shape), list(q2d.stride()), [fg.HALF_Q, q.shape[-1]],
                                  _q_layout(q.dtype, q.shape[-1]))
    else:
        q_desc, rb, rh, ch = descs[0], 0, 0, 0
    q_amax = k_scales if q_head_amax is None else q_head_amax
    launch_kernel(_fwd_persistent_kernel, (n_prog, ),
        q_desc, descs[1], descs[2], h_desc, table, q_amax, k_scales if q_scales is None else q_scales, k_scales,
        v_scales, out, *out.stride()[:3], lse, hq, groups, sq, sk, v_scales.shape[2], n_blk, rb, rh, ch,
        qk_scale, slack, Q_IN=q_in, Q_HEAD=q_head_amax is not None, POW2=pow2, OUT_STRIDED=fg.TOKEN_MAJOR_OUT,
        HALF_Q=fg.HALF_Q, BLOCK_N=block_n, D=q_desc.block_shape[-1], CAUSAL=causal, MERGED=fg.merged_mode(),
        STAGES=fg.ring_stages(block_n), LOG2_PMAX=fg.LOG2_PMAX, FMA_BOUND=fg.fma_bound(), P_IN_PLACE=fg.P_IN_PLACE,
        TREE=fg.TREE_REDUCTIONS, PINGPONG=fg.PINGPONG and fg.MERGED_WAITS, CONSUMER_REGS=fg.CONSUMER_REGS,
        PRODUCER_REGS=fg.PRODUCER_REGS, num_warps=4, maxnreg=fg.MAXNREG)


if gluon is not None:
    @gluon.jit
    def _staged_q_codes(x_smem, h_smem, q_free, codes_smem, QAMAX, sh, HALF_Q: gl.constexpr, D: gl.constexpr,
                        Q_HEAD: gl.constexpr, POW2: gl.constexpr, rows_s: gl.constexpr):
        """forward_gluon._rotated_q_codes from the 16-bit Q that TMA put in ``x_smem`` (HALF_Q, D): the
        rotation's wgmma reads it there, then releases the buffer (``q_free``); the same scales and
        codes (into ``codes_smem``), returned (HALF_Q,) in ``rows_s``."""
        rot: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        y = warpgroup_mma(x_smem, h_smem.permute((1, 0)), gl.zeros([HALF_Q, D], gl.float32, rot), use_acc=False,
                          is_async=True)
        y = warpgroup_mma_wait(num_outstanding=0, deps=(y, ))
        mbarrier.arrive(q_free, count=1)
        return fg._store_q_codes(y, codes_smem, QAMAX, sh, HALF_Q, Q_HEAD, POW2, rows_s)

    @gluon.jit
    def _consumer(q_stage, q_smem, h_smem, k_smem, vt_smem, h_bar, q_bar, q_free, ready, empty, turn, SCHED, i0, i1,
                  N_BLK, QAMAX, QS, KS, VS, OUT, OUT_SB, OUT_SH, OUT_SS, LSE, H, G, SQ, SK, NT_K, qk_scale, slack,
                  Q_IN: gl.constexpr, Q_HEAD: gl.constexpr, POW2: gl.constexpr, OUT_STRIDED: gl.constexpr,
                  WG: gl.constexpr, HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                  CAUSAL: gl.constexpr, MERGED: gl.constexpr, PINGPONG: gl.constexpr, STAGES: gl.constexpr,
                  LOG2_PMAX: gl.constexpr, FMA_BOUND: gl.constexpr, NQ: gl.constexpr, P_IN_PLACE: gl.constexpr,
                  TREE: gl.constexpr):
        """One warpgroup over the program's blocks, entries i0 <= j < i1 of the schedule: per block its
        64 queries' codes and row factors as forward_gluon._consumer forms them, then
        forward_gluon._attend_rows from ring position c (the key tiles of the blocks before). PINGPONG:
        the two warpgroups take turns issuing products (forward_gluon.PINGPONG) across all blocks; a
        block of t_hi key tiles makes t_hi + 1 issues, so the turns before block n are c + n."""
        rows_s: gl.constexpr = gl.SliceLayout(1, mma_layout(BLOCK_N))
        if Q_IN:
            mbarrier.wait(h_bar, 0)
        if PINGPONG and WG == 1:  # warpgroup 0 issues first
            mbarrier.arrive(turn.index(0), count=1)
        c = 0
        for j in range(i0, i1):
            bh_q, bh_k, m0, t_hi = scheduled_block(SCHED, j, N_BLK, H, G, SK, 2 * HALF_Q, BLOCK_N, CAUSAL)
            n = j - i0
            buf = n % NQ
            q0 = m0 + WG * HALF_Q
            mbarrier.wait(q_bar.index(buf), (n // NQ) & 1)
            if Q_IN:
                q_scale = _staged_q_codes(q_stage.index(WG), h_smem, q_free.index(0), q_smem.index(WG), QAMAX, bh_q,
                                          HALF_Q, D, Q_HEAD, POW2, rows_s)
                q2 = (q_scale * qk_scale) * gl.load(KS + bh_k * SK)
                q_op = q_smem.index(WG)
            else:
                queries = q0 + gl.arange(0, HALF_Q, layout=rows_s)
                q2 = (gl.load(QS + bh_q * SQ + queries) * qk_scale) * gl.load(KS + bh_k * SK)
                q_op = q_smem.index(buf * 2 + WG)
            if OUT_STRIDED:
                out_row0 = (bh_q // H).to(gl.int64) * OUT_SB + (bh_q % H).to(gl.int64) * OUT_SH
            else:  # unused
                out_row0 = 0
            fg._attend_rows(q_op, q2, q0, c, t_hi, k_smem, vt_smem, ready, empty, turn, c + n, VS, OUT, out_row0,
                            OUT_SS, LSE, bh_q, bh_k, SQ, NT_K, slack, OUT_STRIDED, WG, HALF_Q, BLOCK_N, D, CAUSAL,
                            MERGED, PINGPONG, STAGES, LOG2_PMAX, FMA_BOUND, P_IN_PLACE, TREE)
            if not Q_IN:  # every product reading this block's codes has completed
                mbarrier.arrive(q_free.index(buf), count=1)
            c += t_hi

    @gluon.jit
    def _producer(q_desc, k_desc, vt_desc, h_desc, q_dst, h_smem, k_smem, vt_smem, h_bar, q_bar, q_free, ready, empty,
                  SCHED, i0, i1, N_BLK, H, G, SQ, SK, Q_RB, Q_RH, Q_CH, Q_IN: gl.constexpr, HALF_Q: gl.constexpr,
                  BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                  NQ: gl.constexpr):
        """The producer warp: the Hadamard matrix once (Q_IN), then per block of the program its two
        halves of Q (the 16-bit input, Q_IN, else the codes: into buffer n % NQ of ``q_dst`` once the
        consumers released it) and its key tiles into the ring, which runs on across blocks."""
        if Q_IN:
            mbarrier.expect(h_bar, h_desc.block_type.nbytes)
            tma_load(h_desc, [0, 0], h_bar, h_smem)
        c = 0
        for j in range(i0, i1):
            bh_q, bh_k, m0, t_hi = scheduled_block(SCHED, j, N_BLK, H, G, SK, 2 * HALF_Q, BLOCK_N, CAUSAL)
            n = j - i0
            buf = n % NQ
            mbarrier.wait(q_free.index(buf), ((n // NQ) & 1) ^ 1)  # the first round does not wait
            bar = q_bar.index(buf)
            mbarrier.expect(bar, 2 * q_desc.block_type.nbytes)
            if Q_IN:
                row = (bh_q // H) * Q_RB + (bh_q % H) * Q_RH + m0
                col = (bh_q % H) * Q_CH
            else:
                row = bh_q * SQ + m0
                col = 0
            for w in gl.static_range(2):
                tma_load(q_desc, [row + w * HALF_Q, col], bar, q_dst.index(buf * 2 + w))
            ring_tiles(k_desc, None, vt_desc, k_smem, None, vt_smem, ready, empty, c, bh_k * SK, bh_k * D, t_hi,
                       BLOCK_N, STAGES)
            c += t_hi

    @gluon.jit
    def _fwd_persistent_kernel(
        q_desc,  # Q_IN: the 16-bit Q as q_rows' 2-D tensor, boxes (HALF_Q, D); else Q's codes as forward_gluon's
        k_desc, vt_desc,  # as forward_gluon._fwd_kernel's
        h_desc,  # Q_IN: the (D, D) 16-bit ±1 Hadamard matrix, one box; else None
        SCHED,  # int32: schedule()'s table
        QAMAX, QS, KS, VS, OUT, OUT_SB, OUT_SH, OUT_SS, LSE,  # as forward_gluon._fwd_kernel's
        H, G, SQ, SK, NT_K, N_BLK,
        Q_RB, Q_RH, Q_CH,  # Q_IN: a token's row and column in q_desc (q_rows)
        qk_scale, slack,
        Q_IN: gl.constexpr, Q_HEAD: gl.constexpr, POW2: gl.constexpr, OUT_STRIDED: gl.constexpr,
        HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr, MERGED: gl.constexpr,
        STAGES: gl.constexpr, LOG2_PMAX: gl.constexpr, FMA_BOUND: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, P_IN_PLACE: gl.constexpr,
        TREE: gl.constexpr, PINGPONG: gl.constexpr,
    ):
        i0, i1 = program_entries(SCHED)
        # Q_IN: one staging buffer of the 16-bit Q (released as soon as it is rotated) and the codes
        # each warpgroup writes; else two buffers of Q's codes, used in turn.
        NQ: gl.constexpr = 1 if Q_IN else 2
        if Q_IN:
            h_smem = gl.allocate_shared_memory(h_desc.dtype, h_desc.block_type.shape, h_desc.layout)
            q_stage = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
            q_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, HALF_Q, D],
                                               gl.NVMMASharedLayout.get_default_for([HALF_Q, D], gl.float8e4nv))
        else:
            q_smem = gl.allocate_shared_memory(q_desc.dtype, [2 * NQ] + q_desc.block_type.shape, q_desc.layout)
            q_stage = q_smem  # unused: placeholders of the same kind
            h_smem = q_smem
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        vt_smem = gl.allocate_shared_memory(vt_desc.dtype, [STAGES] + vt_desc.block_type.shape, vt_desc.layout)
        h_bar, ready, empty = ring_barriers(STAGES, 1)
        q_bar = gl.allocate_shared_memory(gl.int64, [NQ, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [NQ, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NQ):
            mbarrier.init(q_bar.index(i), count=1)
            mbarrier.init(q_free.index(i), count=2)
        q_dst = q_stage if Q_IN else q_smem
        if PINGPONG:  # one turn barrier per consumer warpgroup
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for w in gl.static_range(2):
                mbarrier.init(turn.index(w), count=1)
        else:  # unused: a placeholder of the same kind (a partition's arguments cannot be None)
            turn = ready
        gl.warp_specialize([
            (_consumer, (q_stage, q_smem, h_smem, k_smem, vt_smem, h_bar, q_bar, q_free, ready, empty, turn, SCHED, i0,
                         i1, N_BLK, QAMAX, QS, KS, VS, OUT, OUT_SB, OUT_SH, OUT_SS, LSE, H, G, SQ, SK, NT_K, qk_scale,
                         slack, Q_IN, Q_HEAD, POW2, OUT_STRIDED, 0, HALF_Q, BLOCK_N, D, CAUSAL, MERGED, PINGPONG,
                         STAGES, LOG2_PMAX, FMA_BOUND, NQ, P_IN_PLACE, TREE)),
            (_consumer, (q_stage, q_smem, h_smem, k_smem, vt_smem, h_bar, q_bar, q_free, ready, empty, turn, SCHED, i0,
                         i1, N_BLK, QAMAX, QS, KS, VS, OUT, OUT_SB, OUT_SH, OUT_SS, LSE, H, G, SQ, SK, NT_K, qk_scale,
                         slack, Q_IN, Q_HEAD, POW2, OUT_STRIDED, 1, HALF_Q, BLOCK_N, D, CAUSAL, MERGED, PINGPONG,
                         STAGES, LOG2_PMAX, FMA_BOUND, NQ, P_IN_PLACE, TREE)),
            (_producer, (q_desc, k_desc, vt_desc, h_desc, q_dst, h_smem, k_smem, vt_smem, h_bar, q_bar, q_free, ready,
                         empty, SCHED, i0, i1, N_BLK, H, G, SQ, SK, Q_RB, Q_RH, Q_CH, Q_IN, HALF_Q, BLOCK_N, D,
                         CAUSAL, STAGES, NQ)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


__all__ = ["launch", "q_row_layout", "q_rows"]
