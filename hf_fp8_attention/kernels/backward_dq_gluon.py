"""The block-free recipes' dQ launch on Hopper, written in Gluon and warp-specialised.

It computes what ``bwd_dq_fp8_kernel`` (backward_fp8.py) computes in its dQ launch (GRADS after
the statistics launch, ``ds_scales="head"``), from the same FP8 copies, statistics and scales, and
writes the same dQ up to the order of the fp32 accumulation: per key tile

    S = (Q Kᵀ) · sq,   dP' = dO Vᵀ,   P' = 2^(S − LSE'^do + log2 s_dS),   dS' = P' (dP' − D'),
    dQ += fp8(dS') · Kcᵀ

and at the end dQ · s_dS · c_K · τ (``s_dS``: the query head's dS scale, ``c_K``: K's channel
scales of the sequence). The mirror image of backward_dkdv_gluon.py: a producer warp brings each
64-key tile's three FP8 copies (K and V row-wise for S and dP, Kᵀ channel-wise for dQ) by TMA into
a ``STAGES``-deep ring; two consumer warpgroups own 64 queries each (128 per program) and share
every key tile, each holding its Q and dO codes in registers (the A operands of S and dP).
``LAYOUTS`` names the alternatives the kernel is built and tested in: Q and dO read from shared
memory, with 64- or 128-key tiles.

One program per (128 queries, batch · query head); causal programs with the most key tiles first.
Scope (:func:`scope_reason`): the block-free recipes (``fp8_delta``, ``fp8_delta_fast``, their stale
twins; Q's and dO's scales are per row here, so per token or per head alike) in E4M3, head dim 128,
dense batches, query lengths a multiple of 128 and key lengths of 64, causal only with as many
queries as keys, no soft-cap or K-smoothing row constant, no debug row sums.
"""
from __future__ import annotations

import torch

from ..config import FP8AttentionConfig
from ..masking import MaskSpec
from .gluon_hopper import descriptor, device_reason, gluon, head_group, recipe_reason, shape_reason
from .launch import launch as launch_kernel
from .persistent_schedule import launch_table

if gluon is not None:
    from .gluon_hopper import (
        a_operand_codes, a_operand_layout, cta_fence, ds_head_scale, gl, mbarrier, mma_layout,
        persistent_query_side_codes, persistent_query_side_producer, program_entries, query_block,
        query_side_producer, ring_barriers, scheduled_block, warpgroup_mma, warpgroup_mma_wait,
    )

HEAD_DIMS = (128, )
HALF_Q, BLOCK_N, STAGES = 64, 64, 3  # queries per consumer warpgroup; keys per tile; ring depth
BLOCK_M = 2 * HALF_Q
# Q's and dO's codes as the register A operand of S and dP' (True), or read by those MMAs from shared
# memory (False). Shared memory frees 32 registers per thread: offline (sm_90a, Triton 3.9) it
# leaves 128-key tiles (BLOCK_N = 128) spill-free and unserialised, with ~10% fewer instructions per
# key than 64-key tiles; not yet measured on a GPU (benchmarks/NOTES.md, "Backward").
QDO_IN_REGISTERS = True
# P's exponentials worked on while dP' is in flight: S and dP' are issued together and S is waited
# for alone, but ptxas issues dP's wait after the first 6 of a tile's 32 exponentials unless a CTA
# fence stands before it (gluon_hopper.cta_fence; offline, sm_90a, Triton 3.6: with it all 32 sit
# between the two waits, 208 instructions a tile against 207). The same bits; not yet timed on a
# GPU (benchmarks/NOTES.md, "Backward"): off until it is.
EXP_UNDER_DP = False
# The operand layouts the kernel is built and tested in: name -> values of LAYOUT_CONSTANTS; the
# first is the default above.
LAYOUT_CONSTANTS = ("QDO_IN_REGISTERS", "BLOCK_N", "EXP_UNDER_DP")
LAYOUTS = {"qdo_registers_k64": (True, 64, False), "qdo_shared_k64": (False, 64, False),
           "qdo_shared_k128": (False, 128, False), "qdo_registers_k64_exp_under_dp": (True, 64, True)}
CONSUMER_REGS, PRODUCER_REGS, MAXNREG = 240, 24, 168  # as backward_dkdv_gluon.py
# The launch as a persistent kernel (one program per SM over a list of query blocks,
# persistent_schedule.py; the next block's codes and key tiles loaded while the current one
# finishes): the same bits. With Q and dO in registers only (the default layout).
PERSISTENT = False
# dS's codes handed to dS·K in the registers its accumulator put them in (gluon_hopper.a_operand_in_place;
# K's channel-wise copy written with its keys in that order, ``quantize.Copies.col_pv``) instead of moved
# to the FP8 A operand's layout: offline (sm_90a, Triton 3.6) 228 -> 204 instructions per key tile.
A_IN_PLACE = True


def scope_reason(shape_q: tuple, shape_k: tuple, mask: MaskSpec, config: FP8AttentionConfig,
                 mod_meta: dict) -> str | None:
    """None when the call is in the kernel's scope (any device), else why not (one short phrase).
    ``shape_q`` (B, Hq, Sq, D), ``shape_k`` (B, Hkv, Sk, D); ``mod_meta``: ``LogitMods.meta``."""
    return (recipe_reason(shape_q, shape_k, mask, config, mod_meta)
            or shape_reason(shape_q, shape_k, mask, HEAD_DIMS, BLOCK_M, BLOCK_N))


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, mask: MaskSpec, config: FP8AttentionConfig,
                       mod_meta: dict) -> str | None:
    """None when :func:`gluon_dq` runs this backward's dQ, else why not: :func:`scope_reason`, then
    the device (:func:`.gluon_hopper.device_reason`)."""
    return scope_reason(tuple(q.shape), tuple(k.shape), mask, config, mod_meta) or device_reason(q)


def gluon_dq(qr, qrs, kr, krs, kct, kcs, vr, dor, lse2do, delta, ds_bound, dq, *, groups: int, qk_scale: float,
             tau: float, causal: bool, pow2: bool, keys_in_pv_order: bool = False) -> None:
    """Fill ``dq`` (B, Hq, Sq, 128), in the inputs' dtype, after the backward's statistics launch
    (backward.py's ``_launch_fp8``):

    - ``qr``, ``dor`` (B, Hq, Sq, 128) e4m3: row-wise codes of Q and dO; ``qrs`` (B, Hq, Sq) fp32:
      Q's scales (per token, or one per head repeated per token);
    - ``kr``, ``vr`` (B, Hkv, Sk, 128) e4m3 and ``krs`` (B, Hkv, Sk) fp32: K's and V's codes, K's
      scales; ``kct`` (B, Hkv, 128, Sk_pad) e4m3: K's channel-wise transposed codes, ``kcs``
      (B, Hkv, n_tiles, 128) fp32 their channel scales (the sequence's, in tile 0);
    - ``lse2do``, ``delta`` (B·Hq, Sq) fp32: LSE'^do and D'; ``ds_bound`` (B·Hq,) int32: the bits
      of each query head's fp32 dS bound.

    ``groups``: query heads per kv head; ``qk_scale``: softmax scale · log2 e (and the recipe's logit
    factor); ``tau``: the softmax scale; ``keys_in_pv_order``: ``kct``'s keys in the order of
    ``quantize.pv_token_order`` (``Copies.col_pv``), dS's codes then handed to dS·K in place."""
    b, hq, sq, d = qr.shape
    sk = kr.shape[2]
    descs = (descriptor(qr.view(-1, d), (HALF_Q, d)), descriptor(dor.view(-1, d), (HALF_Q, d)),
             descriptor(kr.view(-1, d), (BLOCK_N, d)), descriptor(vr.view(-1, d), (BLOCK_N, d)),
             descriptor(kct.view(-1, kct.shape[-1]), (d, BLOCK_N)))
    if PERSISTENT and QDO_IN_REGISTERS:
        n_blk = sq // BLOCK_M
        table, n_prog = launch_table(n_blk, b * hq, sk, causal, head_group(causal), dq.device)
        launch_kernel(_dq_persistent_kernel, (n_prog, ),
            *descs, table, qrs, krs, kcs, lse2do, delta, ds_bound, dq, hq, groups, sq, sk, kcs.shape[2], n_blk,
            qk_scale, tau, HALF_Q=HALF_Q, BLOCK_N=BLOCK_N, D=d, CAUSAL=causal, POW2=pow2, STAGES=STAGES,
            CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, IN_PLACE=keys_in_pv_order,
            FENCE=EXP_UNDER_DP, num_warps=4,
            maxnreg=MAXNREG)
        return
    launch_kernel(_dq_kernel, (sq // BLOCK_M, b * hq),
        *descs, qrs, krs, kcs, lse2do, delta, ds_bound, dq,
        hq, groups, sq, sk, kcs.shape[2], qk_scale, tau,
        HALF_Q=HALF_Q, BLOCK_N=BLOCK_N, D=d, CAUSAL=causal, HEAD_GROUP=head_group(causal),
        POW2=pow2, QDO_REGS=QDO_IN_REGISTERS, STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, IN_PLACE=keys_in_pv_order, FENCE=EXP_UNDER_DP, num_warps=4,
        maxnreg=MAXNREG)


if gluon is not None:
    @gluon.jit
    def _consumer_tiles(t_a, t_b, c0, dq, q_reg, do_reg, k_smem, v_smem, kt_smem, ready, empty, queries, sq, lse_p,
                        delta, MASKED: gl.constexpr, SKIP: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        s_layout: gl.constexpr, pa_layout: gl.constexpr, IN_PLACE: gl.constexpr,
                        FENCE: gl.constexpr):
        """Key tiles t_a <= t < t_b into one warpgroup's dQ: the Triton launch's ``_dq_tiles`` with
        DS_HEAD and COL_SEQ, the same fp32 operations per element. SKIP: tiles no query of this
        warpgroup sees (the other one does): only their ring slots are released. Tile t sits at
        ring position c0 + t (c0: the tiles of a persistent program's earlier blocks, else 0)."""
        zero_s = gl.zeros([queries.shape[0], BLOCK_N], gl.float32, s_layout)
        cols: gl.constexpr = gl.SliceLayout(0, s_layout)
        for t in range(t_a, t_b):
            slot = (c0 + t) % STAGES
            mbarrier.wait(ready.index(slot), ((c0 + t) // STAGES) & 1)
            if not SKIP:
                s = warpgroup_mma(q_reg, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                dp = warpgroup_mma(do_reg, v_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
                p = gl.exp2(s * gl.expand_dims(sq, 1) - gl.expand_dims(lse_p, 1))  # P' = P · sdo / s_dS
                if MASKED:
                    keys = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=cols)
                    p = gl.where(gl.expand_dims(queries, 1) >= gl.expand_dims(keys, 0), p, 0.0)
                if FENCE:  # keeps ptxas from issuing dP's wait before P's exponentials (EXP_UNDER_DP)
                    cta_fence(t)
                dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, ))
                # IN_PLACE: K's channel-wise copy holds its keys in the order dS's codes are taken in
                ds8 = a_operand_codes(p * (dp - gl.expand_dims(delta, 1)), pa_layout, IN_PLACE)
                dq = warpgroup_mma(ds8, kt_smem.index(slot).permute((1, 0)), dq, is_async=True)
                dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ))
            mbarrier.arrive(empty.index(slot), count=1)
        return dq

    @gluon.jit
    def _row_factors(QRS, KRS, LSE2DO, DELTA, DS_BOUND, bh_q, bh_k, SQ, SK, q0, qk_scale, HALF_Q: gl.constexpr,
                     POW2: gl.constexpr, rows_s: gl.constexpr):
        """A warpgroup's queries q0 .. q0 + HALF_Q and their per-row factors, as the Triton launch forms
        them (bwd_dq_fp8_kernel with KV_HEAD and DS_HEAD, in its order): (queries, sq, the head's dS
        scale, LSE'^do − log2(1 / s_dS), D')."""
        queries = q0 + gl.arange(0, HALF_Q, layout=rows_s)
        stat = bh_q * SQ + queries
        sq = (gl.load(QRS + stat) * qk_scale) * gl.load(KRS + bh_k * SK)
        ds_scale = ds_head_scale(DS_BOUND, bh_q, POW2)  # (dense: bh_q = sequence · H + head)
        lse_p = gl.load(LSE2DO + stat) - gl.log2(gl.div_rn(1.0, ds_scale))
        delta = gl.load(DELTA + stat)
        return queries, sq, ds_scale, lse_p, delta

    @gluon.jit
    def _dq_rows(q_reg, do_reg, c0, k_smem, v_smem, kt_smem, ready, empty, KCS, DQ, bh_q, bh_k, SQ, NT_K, q0, t_hi,
                 queries, sq, ds_scale, lse_p, delta, tau, HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr,
                 D: gl.constexpr, CAUSAL: gl.constexpr, STAGES: gl.constexpr, IN_PLACE: gl.constexpr,
                 FENCE: gl.constexpr):
        """A warpgroup's dQ of queries q0 .. q0 + HALF_Q from their codes ``q_reg``, ``do_reg`` and
        :func:`_row_factors`: key tiles 0 <= t < t_hi (ring positions c0 + t), then the scales, into ``DQ``."""
        s_layout: gl.constexpr = mma_layout(BLOCK_N)
        o_layout: gl.constexpr = mma_layout(D)
        pa_layout: gl.constexpr = a_operand_layout(o_layout)
        dq = gl.zeros([HALF_Q, D], gl.float32, o_layout)
        if CAUSAL:  # key tiles before this warpgroup's diagonal, the diagonal (masked), the rest unseen
            t_diag = q0 // BLOCK_N
            N_DIAG: gl.constexpr = (HALF_Q + BLOCK_N - 1) // BLOCK_N  # tiles holding the diagonal (1 at 128 too)
            dq = _consumer_tiles(0, t_diag, c0, dq, q_reg, do_reg, k_smem, v_smem, kt_smem, ready, empty, queries, sq,
                                 lse_p, delta, False, False, BLOCK_N, STAGES, s_layout, pa_layout, IN_PLACE, FENCE)
            dq = _consumer_tiles(t_diag, t_diag + N_DIAG, c0, dq, q_reg, do_reg, k_smem, v_smem, kt_smem,
                                 ready, empty, queries, sq, lse_p, delta, True, False, BLOCK_N, STAGES, s_layout,
                                 pa_layout, IN_PLACE, FENCE)
            dq = _consumer_tiles(t_diag + N_DIAG, t_hi, c0, dq, q_reg, do_reg, k_smem, v_smem, kt_smem, ready,
                                 empty, queries, sq, lse_p, delta, False, True, BLOCK_N, STAGES, s_layout, pa_layout,
                                 IN_PLACE, FENCE)
        else:
            dq = _consumer_tiles(0, t_hi, c0, dq, q_reg, do_reg, k_smem, v_smem, kt_smem, ready, empty, queries, sq,
                                 lse_p, delta, False, False, BLOCK_N, STAGES, s_layout, pa_layout, IN_PLACE, FENCE)
        chan = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        dq = dq * ds_scale
        dq = dq * gl.expand_dims(gl.load(KCS + bh_k * NT_K * D + chan), 0)
        dq = dq * tau
        rows = gl.expand_dims(bh_q * SQ + q0 + gl.arange(0, HALF_Q, layout=gl.SliceLayout(1, o_layout)), 1)
        gl.store(DQ + rows.to(gl.int64) * D + gl.expand_dims(chan, 0), dq.to(DQ.dtype.element_ty))

    @gluon.jit
    def _consumer(q_smem, do_smem, k_smem, v_smem, kt_smem, q_bar, ready, empty, QRS, KRS, KCS, LSE2DO, DELTA,
                  DS_BOUND, DQ, bh_q, bh_k, SQ, SK, NT_K, m0, t_hi, qk_scale, tau, WG: gl.constexpr,
                  HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                  POW2: gl.constexpr, QDO_REGS: gl.constexpr, STAGES: gl.constexpr, IN_PLACE: gl.constexpr,
                  FENCE: gl.constexpr):
        """One warpgroup: queries m0 + WG·64 .. + 64 of the program; writes their dQ."""
        s_layout: gl.constexpr = mma_layout(BLOCK_N)
        qa_layout: gl.constexpr = a_operand_layout(s_layout)
        q0 = m0 + WG * HALF_Q
        queries, sq, ds_scale, lse_p, delta = _row_factors(QRS, KRS, LSE2DO, DELTA, DS_BOUND, bh_q, bh_k, SQ, SK, q0,
                                                           qk_scale, HALF_Q, POW2, gl.SliceLayout(1, s_layout))
        mbarrier.wait(q_bar, 0)
        if QDO_REGS:
            q_reg = q_smem.index(WG).load(qa_layout)
            do_reg = do_smem.index(WG).load(qa_layout)
        else:  # the MMAs read them where TMA put them (never overwritten)
            q_reg = q_smem.index(WG)
            do_reg = do_smem.index(WG)
        _dq_rows(q_reg, do_reg, 0, k_smem, v_smem, kt_smem, ready, empty, KCS, DQ, bh_q, bh_k, SQ, NT_K, q0, t_hi,
                 queries, sq, ds_scale, lse_p, delta, tau, HALF_Q, BLOCK_N, D, CAUSAL, STAGES, IN_PLACE, FENCE)

    @gluon.jit
    def _persistent_consumer(q_smem, do_smem, k_smem, v_smem, kt_smem, q_bar, q_free, ready, empty, SCHED, i0, i1,
                             N_BLK, H, G, QRS, KRS, KCS, LSE2DO, DELTA, DS_BOUND, DQ, SQ, SK, NT_K, qk_scale, tau,
                             WG: gl.constexpr, HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                             CAUSAL: gl.constexpr, POW2: gl.constexpr, STAGES: gl.constexpr,
                             IN_PLACE: gl.constexpr, FENCE: gl.constexpr):
        """One warpgroup of a persistent program over entries i0 <= j < i1 of its schedule: per block
        :func:`_consumer`'s work (Q's and dO's codes in registers, then the buffers released to the
        producer for the next block), the ring's positions running on across blocks."""
        s_layout: gl.constexpr = mma_layout(BLOCK_N)
        qa_layout: gl.constexpr = a_operand_layout(s_layout)
        c = 0
        for j in range(i0, i1):
            bh_q, bh_k, m0, t_hi = scheduled_block(SCHED, j, N_BLK, H, G, SK, 2 * HALF_Q, BLOCK_N, CAUSAL)
            q0 = m0 + WG * HALF_Q
            queries, sq, ds_scale, lse_p, delta = _row_factors(QRS, KRS, LSE2DO, DELTA, DS_BOUND, bh_q, bh_k, SQ, SK,
                                                               q0, qk_scale, HALF_Q, POW2, gl.SliceLayout(1, s_layout))
            q_reg, do_reg = persistent_query_side_codes(q_smem, do_smem, q_bar, q_free, j - i0, WG, qa_layout)
            _dq_rows(q_reg, do_reg, c, k_smem, v_smem, kt_smem, ready, empty, KCS, DQ, bh_q, bh_k, SQ, NT_K, q0, t_hi,
                     queries, sq, ds_scale, lse_p, delta, tau, HALF_Q, BLOCK_N, D, CAUSAL, STAGES, IN_PLACE, FENCE)
            c += t_hi

    @gluon.jit
    def _dq_kernel(
        q_desc, do_desc,  # row-wise codes of Q and dO: (B·Hq·Sq, D), boxes (HALF_Q, D)
        k_desc, v_desc,  # row-wise codes of K and V: (B·Hkv·Sk, D), boxes (BLOCK_N, D)
        kt_desc,  # K's channel-wise transposed codes: (B·Hkv·D, Sk_pad), boxes (D, BLOCK_N)
        QRS, KRS,  # (B, H, S) fp32 row scales, one value per head
        KCS,  # (B, Hkv, NT_K, D) fp32 channel scales, the sequence's in tile 0
        LSE2DO, DELTA,  # (B·Hq, Sq) fp32: LSE'^do and D'
        DS_BOUND,  # (B·Hq,) int32: the bits of each query head's fp32 dS bound
        DQ,  # (B, Hq, Sq, D) in the input dtype
        H, G, SQ, SK, NT_K, qk_scale, tau,
        HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr, HEAD_GROUP: gl.constexpr,
        POW2: gl.constexpr, QDO_REGS: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr, IN_PLACE: gl.constexpr, FENCE: gl.constexpr,
    ):
        bh_q, bh_k, m0, t_hi = query_block(H, G, SK, 2 * HALF_Q, BLOCK_N, CAUSAL, HEAD_GROUP)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        kt_smem = gl.allocate_shared_memory(kt_desc.dtype, [STAGES] + kt_desc.block_type.shape, kt_desc.layout)
        q_bar, ready, empty = ring_barriers(STAGES, 1)  # ready: the producer's expect alone

        gl.warp_specialize([
            (_consumer, (q_smem, do_smem, k_smem, v_smem, kt_smem, q_bar, ready, empty, QRS, KRS, KCS, LSE2DO, DELTA,
                         DS_BOUND, DQ, bh_q, bh_k, SQ, SK, NT_K, m0, t_hi, qk_scale, tau, 0, HALF_Q, BLOCK_N, D,
                         CAUSAL, POW2, QDO_REGS, STAGES, IN_PLACE, FENCE)),
            (_consumer, (q_smem, do_smem, k_smem, v_smem, kt_smem, q_bar, ready, empty, QRS, KRS, KCS, LSE2DO, DELTA,
                         DS_BOUND, DQ, bh_q, bh_k, SQ, SK, NT_K, m0, t_hi, qk_scale, tau, 1, HALF_Q, BLOCK_N, D,
                         CAUSAL, POW2, QDO_REGS, STAGES, IN_PLACE, FENCE)),
            (query_side_producer, (q_desc, do_desc, k_desc, v_desc, kt_desc, q_smem, do_smem, k_smem, v_smem,
                                   kt_smem, q_bar, ready, empty, bh_q * SQ + m0, bh_k * SK, bh_k * D, t_hi, HALF_Q,
                                   BLOCK_N, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


    @gluon.jit
    def _dq_persistent_kernel(
        q_desc, do_desc, k_desc, v_desc, kt_desc,  # as _dq_kernel's
        SCHED,  # int32: persistent_schedule.schedule's table
        QRS, KRS, KCS, LSE2DO, DELTA, DS_BOUND, DQ,  # as _dq_kernel's
        H, G, SQ, SK, NT_K, N_BLK, qk_scale, tau,
        HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr, POW2: gl.constexpr,
        STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, IN_PLACE: gl.constexpr,
        FENCE: gl.constexpr,
    ):
        """_dq_kernel as a persistent kernel (``PERSISTENT``): one program per SM over its schedule's
        blocks, the same bits; Q's and dO's codes held in registers (QDO_IN_REGISTERS)."""
        i0, i1 = program_entries(SCHED)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        kt_smem = gl.allocate_shared_memory(kt_desc.dtype, [STAGES] + kt_desc.block_type.shape, kt_desc.layout)
        q_bar, ready, empty = ring_barriers(STAGES, 1)
        q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_free, count=2)
        gl.warp_specialize([
            (_persistent_consumer, (q_smem, do_smem, k_smem, v_smem, kt_smem, q_bar, q_free, ready, empty, SCHED, i0,
                                    i1, N_BLK, H, G, QRS, KRS, KCS, LSE2DO, DELTA, DS_BOUND, DQ, SQ, SK, NT_K,
                                    qk_scale, tau, 0, HALF_Q, BLOCK_N, D, CAUSAL, POW2, STAGES, IN_PLACE, FENCE)),
            (_persistent_consumer, (q_smem, do_smem, k_smem, v_smem, kt_smem, q_bar, q_free, ready, empty, SCHED, i0,
                                    i1, N_BLK, H, G, QRS, KRS, KCS, LSE2DO, DELTA, DS_BOUND, DQ, SQ, SK, NT_K,
                                    qk_scale, tau, 1, HALF_Q, BLOCK_N, D, CAUSAL, POW2, STAGES, IN_PLACE, FENCE)),
            (persistent_query_side_producer, (q_desc, do_desc, k_desc, v_desc, kt_desc, q_smem, do_smem, k_smem,
                                              v_smem, kt_smem, q_bar, q_free, ready, empty, SCHED, i0, i1, N_BLK, H,
                                              G, SQ, SK, HALF_Q, BLOCK_N, D, CAUSAL, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


__all__ = ["BLOCK_M", "BLOCK_N", "EXP_UNDER_DP", "HEAD_DIMS", "LAYOUTS", "LAYOUT_CONSTANTS", "PERSISTENT",
           "QDO_IN_REGISTERS", "gluon_dq", "scope_reason", "unsupported_reason"]
