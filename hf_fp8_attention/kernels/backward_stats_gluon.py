"""The matched block-free recipes' statistics launch on Hopper, written in Gluon and warp-specialised.

It computes what ``bwd_dq_fp8_kernel`` (backward_fp8.py) computes in its statistics launch (STATS
without GRADS, matched delta, ``ds_scales="head"``), from the same FP8 copies and scales: per query
row, over its visible keys, the online normaliser of S = (Q Kᵀ) · sq and the matched delta of
dP' = dO Vᵀ (:func:`.backward_fp8.fold_matched_stats`, key tile by key tile in the same order),

    LSE' = m + log2 l,   LSE'^do = LSE' − log2 s_dO,   D' = u / l,

written to ``LSE2``, ``LSE2DO`` and ``DELTA``, and each row's dS bound
(:func:`.backward_fp8.ds_row_bound`) folded into one value per (sequence, query head) by an atomic
max of its fp32 bits (order-free: deterministic). The layout is backward_dq_gluon.py's: a producer
warp brings each 64-key tile's K and V codes by TMA into a ``STAGES``-deep ring; two consumer
warpgroups own 64 queries each (128 per program), share every key tile and hold their Q and dO codes
in registers (the A operands of S and dP). Each warpgroup issues a key tile's S and dP' before it
folds the previous tile into its statistics (``PIPELINED``), two tiles per loop iteration so that
the products alternate between two sets of registers.

Scope (:func:`scope_reason`): ``fp8_delta`` and ``fp8_delta_fast`` (the matched delta: the stale
twins' statistics need D from the unquantized dO and O; Q's and dO's scales are per row here), E4M3,
head dim 128, dense batches, query lengths a multiple of 128 and key lengths of 64, causal only
with as many queries as keys, no soft-cap, sinks or K-smoothing row constant.
``backward.LAUNCH["gluon_dq_stats"]`` lists the head dims it runs at.
"""
from __future__ import annotations

import torch

from ..config import DeltaMode, FP8AttentionConfig
from ..masking import MaskSpec
from .gluon_hopper import descriptor, device_reason, gluon, head_group, recipe_reason, shape_reason
from .launch import launch as launch_kernel
from .persistent_schedule import launch_table

if gluon is not None:
    import triton.language as tl  # Gluon's maximum takes Triton's PropagateNan

    from .gluon_hopper import (
        a_operand_layout, gl, lane_partials, lanes_to_rows, mbarrier, mma_layout, per_lane, persistent_query_side_codes,
        persistent_query_side_producer, program_entries, query_block, query_side_producer, ring_barriers, row_reduce,
        scheduled_block, warpgroup_mma, warpgroup_mma_wait,
    )

HEAD_DIMS = (128, )
HALF_Q, BLOCK_N, STAGES = 64, 64, 3  # queries per consumer warpgroup; keys per tile; ring depth
BLOCK_M = 2 * HALF_Q
# Each key tile's S and dP' issued before the previous tile is folded, one wait per tile (True), or
# issued and waited for in turn (False). The launch is latency-bound (at 8k causal the in-turn form
# ran at a third to two fifths of the FP8 MMA rate, of the exponential unit's and of the issue
# rate); on the H200 the kernel took 768 instead of 819 us there (benchmarks/NOTES.md, "Backward").
PIPELINED = True
# The schedules the kernel is built and tested in: name -> values of LAYOUT_CONSTANTS; the first is
# the default above.
LAYOUT_CONSTANTS = ("PIPELINED", )
LAYOUTS = {"pipelined": (True, ), "in_turn": (False, )}
CONSUMER_REGS, PRODUCER_REGS, MAXNREG = 240, 24, 168  # as backward_dkdv_gluon.py
# The launch as a persistent kernel (one program per SM over a list of query blocks,
# persistent_schedule.py; the next block's codes and key tiles loaded while the current one
# finishes): the same bits.
PERSISTENT = False
# Each key tile's row maximum of S as a tree (gluon_hopper.row_reduce: 4 dependent steps for a row's
# 16 values in a thread instead of Triton 3.6's chain of 15) and the running l, u (sums of P and
# P·dP') and w (maximum of |P·dP'|) carried per lane, reduced across the row's 4 lanes once after the
# last tile (gluon_hopper.lane_partials): offline (sm_90a, Triton 3.6) 636 -> 588 instructions and 32
# -> 8 shuffles per two-tile pass, the longest FMNMX / FADD chain 22-24 / 17 -> 7-10 / 4. The maxima
# (w's too: RN(a·alpha) is monotonic in a) the same bits; l and u rounded in another order. Off: on
# the H100 (16k tokens, H = 16, CUDA graph) the backward took 0.981-1.016x of its time with it, no
# change beyond the run's noise (benchmarks/NOTES.md, "Backward").
TREE_REDUCTIONS = False


def scope_reason(shape_q: tuple, shape_k: tuple, mask: MaskSpec, config: FP8AttentionConfig,
                 mod_meta: dict) -> str | None:
    """None when the call is in the kernel's scope (any device), else why not (one short phrase).
    ``shape_q`` (B, Hq, Sq, D), ``shape_k`` (B, Hkv, Sk, D); ``mod_meta``: ``LogitMods.meta``."""
    reason = recipe_reason(shape_q, shape_k, mask, config, mod_meta)
    if reason is None and config.delta is not DeltaMode.MATCHED:
        reason = "the stale delta (its D comes from dO and O)"
    if reason is None and mod_meta.get("SINK"):
        reason = "attention sinks"
    return reason or shape_reason(shape_q, shape_k, mask, HEAD_DIMS, BLOCK_M, BLOCK_N)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, mask: MaskSpec, config: FP8AttentionConfig,
                       mod_meta: dict) -> str | None:
    """None when :func:`gluon_dq_stats` runs this backward's statistics, else why not:
    :func:`scope_reason`, then the device (:func:`.gluon_hopper.device_reason`)."""
    return scope_reason(tuple(q.shape), tuple(k.shape), mask, config, mod_meta) or device_reason(q)


def gluon_dq_stats(qr, qrs, kr, krs, vr, vrs, dor, dors, lse2, lse2do, delta, ds_bound, *, groups: int, qk_scale: float,
           causal: bool) -> None:
    """The statistics of a matched block-free backward (see the module docstring), after its
    quantization launches:

    - ``qr``, ``dor`` (B, Hq, Sq, 128) e4m3: row-wise codes of Q and dO; ``qrs``, ``dors`` (B, Hq, Sq)
      fp32: their scales (per token, or one per head repeated per token);
    - ``kr``, ``vr`` (B, Hkv, Sk, 128) e4m3 and ``krs``, ``vrs`` (B, Hkv, Sk) fp32: K's and V's;
    - ``lse2``, ``lse2do``, ``delta`` (B·Hq, Sq) fp32: filled; ``ds_bound`` (B·Hq,) int32, zeros on
      entry: each query head's dS bound, as fp32 bits.

    ``groups``: query heads per kv head; ``qk_scale``: softmax scale · log2 e (and the recipe's logit
    factor)."""
    b, hq, sq, d = qr.shape
    sk = kr.shape[2]
    descs = (descriptor(qr.view(-1, d), (HALF_Q, d)), descriptor(dor.view(-1, d), (HALF_Q, d)),
             descriptor(kr.view(-1, d), (BLOCK_N, d)), descriptor(vr.view(-1, d), (BLOCK_N, d)))
    if PERSISTENT:
        n_blk = sq // BLOCK_M
        table, n_prog = launch_table(n_blk, b * hq, sk, causal, head_group(causal), lse2.device)
        launch_kernel(_stats_persistent_kernel, (n_prog, ),
            *descs, table, qrs, krs, vrs, dors, lse2, lse2do, delta, ds_bound, hq, groups, sq, sk, n_blk, qk_scale,
            HALF_Q=HALF_Q, BLOCK_N=BLOCK_N, D=d, CAUSAL=causal, PIPELINED=PIPELINED, STAGES=STAGES,
            TREE=TREE_REDUCTIONS, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4,
            maxnreg=MAXNREG)
        return
    launch_kernel(_stats_kernel, (sq // BLOCK_M, b * hq),
        *descs, qrs, krs, vrs, dors, lse2, lse2do, delta, ds_bound,
        hq, groups, sq, sk, qk_scale,
        HALF_Q=HALF_Q, BLOCK_N=BLOCK_N, D=d, CAUSAL=causal, HEAD_GROUP=head_group(causal),
        PIPELINED=PIPELINED, STAGES=STAGES, TREE=TREE_REDUCTIONS, CONSUMER_REGS=CONSUMER_REGS,
        PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAXNREG)


if gluon is not None:
    @gluon.jit
    def _consumer_tiles(t_a, t_b, c0, m_i, l_i, u_i, w_i, q_reg, do_reg, k_smem, v_smem, ready, empty, queries, sq,
                        MASKED: gl.constexpr, SKIP: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                        s_layout: gl.constexpr, TREE: gl.constexpr):
        """Key tiles t_a <= t < t_b into one warpgroup's row statistics (the Triton launch's
        ``_dq_stats_tiles``), each tile's S and dP' issued and waited for in turn. SKIP: tiles no
        query of this warpgroup sees (the other one does): only their ring slots are released. Tile
        t sits at ring position c0 + t (c0: the tiles of a persistent program's earlier blocks, else 0)."""
        zero_s = gl.zeros([queries.shape[0], BLOCK_N], gl.float32, s_layout)
        for t in range(t_a, t_b):
            slot = (c0 + t) % STAGES
            mbarrier.wait(ready.index(slot), ((c0 + t) // STAGES) & 1)
            if not SKIP:
                s = warpgroup_mma(q_reg, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
                dp = warpgroup_mma(do_reg, v_smem.index(slot).permute((1, 0)), zero_s, use_acc=False,
                                   is_async=True)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
                m_i, l_i, u_i, w_i = _fold(s, dp, m_i, l_i, u_i, w_i, sq, queries, t, MASKED, True, BLOCK_N,
                                           s_layout, TREE)
            mbarrier.arrive(empty.index(slot), count=1)
        return m_i, l_i, u_i, w_i

    @gluon.jit
    def _fold(s, dp, m_i, l_i, u_i, w_i, sq, queries, t, MASKED: gl.constexpr, WAIT_DP: gl.constexpr,
              BLOCK_N: gl.constexpr, s_layout: gl.constexpr, TREE: gl.constexpr):
        """Key tile t's products (``s`` = Q·Kᵀ of the codes, unscaled, complete; ``dp`` = dO·Vᵀ,
        still in flight with WAIT_DP: waited for once S's exponentials are formed) into the row
        statistics m, l, u, w (:func:`.backward_fp8.fold_matched_stats` with BOUND, the same fp32
        operations per element; TREE: S's maximum as a tree and l, u, w per lane, as (HALF_Q, 4),
        gluon_hopper.row_reduce and lane_partials). MASKED: the causal diagonal's tile."""
        rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        if MASKED:
            # S rounded by itself, as the Triton launch does on masked tiles: the key that sets a
            # row's maximum then gets the exponent 0 exactly, so a query that sees one key has
            # l = 1 and D' = dP' exactly (its dS, and so its dQ, exactly 0).
            keys = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            vis = gl.expand_dims(queries, 1) >= gl.expand_dims(keys, 0)
            x = gl.where(vis, s * gl.expand_dims(sq, 1), float("-inf"))
            m_new = gl.maximum(m_i, row_reduce(x, "max", rows, TREE))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            e = gl.exp2(x - gl.expand_dims(m_safe, 1))
        else:
            # The row maximum of S = s · sq taken on s: rounding is monotonic and sq > 0, so
            # max_j RN(s_j sq) = RN(sq max_j s_j) bit for bit, and the exponent's FFMA (s · sq − m)
            # is the one product per element (offline SASS: 349 -> 319 instructions per tile).
            m_new = gl.maximum(m_i, row_reduce(s, "max", rows, TREE) * sq)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            e = gl.exp2(s * gl.expand_dims(sq, 1) - gl.expand_dims(m_safe, 1))
        alpha = gl.exp2(m_i - m_safe)
        if TREE:  # l, u and w per lane, reduced across the row's lanes once after the last tile (_stats_rows)
            alpha_lanes = per_lane(alpha, l_i)  # (l, u and w share the per-lane layout)
            l_i = l_i * alpha_lanes + lane_partials(e, "sum")
        else:
            l_i = l_i * alpha + gl.sum(e, 1)
        if WAIT_DP:
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp, ))
        edp = e * dp
        if MASKED:
            edp = gl.where(vis, edp, 0.0)
        if TREE:  # w's maxima the same bits: RN(a·alpha) is monotonic in a
            u_i = u_i * alpha_lanes + lane_partials(edp, "sum")
            w_i = gl.maximum(w_i * alpha_lanes, lane_partials(gl.abs(edp), "max_nan"),
                             propagate_nan=tl.PropagateNan.ALL)
        else:
            u_i = u_i * alpha + gl.sum(edp, 1)
            w_i = gl.maximum(w_i * alpha, row_reduce(gl.abs(edp), "max_nan", rows, False),
                             propagate_nan=tl.PropagateNan.ALL)
        return m_new, l_i, u_i, w_i

    @gluon.jit
    def _issue(t, c0, q_reg, do_reg, k_smem, v_smem, ready, zero_s, STAGES: gl.constexpr):
        """Key tile t's S and dP' MMAs (ring position c0 + t), issued once its slot is ready (not
        waited for)."""
        slot = (c0 + t) % STAGES
        mbarrier.wait(ready.index(slot), ((c0 + t) // STAGES) & 1)
        s = warpgroup_mma(q_reg, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_reg, v_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        return s, dp

    @gluon.jit
    def _pipelined_step(t, c0, s, dp, m_i, l_i, u_i, w_i, q_reg, do_reg, k_smem, v_smem, ready, empty, zero_s,
                        queries, sq, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                        TREE: gl.constexpr):
        """Tile t + 1's products issued, tile t's complete ones (``s``, ``dp``) folded under them, then
        one wait; tile t's slot released. Returns the statistics and tile t + 1's products."""
        s_next, dp_next = _issue(t + 1, c0, q_reg, do_reg, k_smem, v_smem, ready, zero_s, STAGES)
        m_i, l_i, u_i, w_i = _fold(s, dp, m_i, l_i, u_i, w_i, sq, queries, t, False, False, BLOCK_N, s_layout, TREE)
        s_next, dp_next = warpgroup_mma_wait(num_outstanding=0, deps=(s_next, dp_next))
        mbarrier.arrive(empty.index((c0 + t) % STAGES), count=1)
        return m_i, l_i, u_i, w_i, s_next, dp_next

    @gluon.jit
    def _pipelined_tiles(t_end, c0, m_i, l_i, u_i, w_i, q_reg, do_reg, k_smem, v_smem, ready, empty, queries, sq,
                         MASKED: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                         TREE: gl.constexpr):
        """Key tiles 0 <= t <= t_end into the row statistics, each tile's S and dP' issued before the
        previous tile is folded (one wait per tile), two tiles per loop iteration so that the
        products alternate between two register sets instead of being copied; the last tile (the
        causal diagonal: MASKED) is folded after the loop. Same operations per element as
        :func:`_consumer_tiles`."""
        zero_s = gl.zeros([queries.shape[0], BLOCK_N], gl.float32, s_layout)
        s, dp = _issue(0, c0, q_reg, do_reg, k_smem, v_smem, ready, zero_s, STAGES)
        s, dp = warpgroup_mma_wait(num_outstanding=0, deps=(s, dp))
        t0 = t_end % 2  # an odd count of tiles before the last: one step first
        if t0 == 1:
            m_i, l_i, u_i, w_i, s, dp = _pipelined_step(0, c0, s, dp, m_i, l_i, u_i, w_i, q_reg, do_reg, k_smem, v_smem,
                                                        ready, empty, zero_s, queries, sq, BLOCK_N, STAGES, s_layout,
                                                        TREE)
        for t in range(t0, t_end, 2):
            m_i, l_i, u_i, w_i, s1, dp1 = _pipelined_step(t, c0, s, dp, m_i, l_i, u_i, w_i, q_reg, do_reg, k_smem, v_smem,
                                                          ready, empty, zero_s, queries, sq, BLOCK_N, STAGES,
                                                          s_layout, TREE)
            m_i, l_i, u_i, w_i, s, dp = _pipelined_step(t + 1, c0, s1, dp1, m_i, l_i, u_i, w_i, q_reg, do_reg, k_smem,
                                                        v_smem, ready, empty, zero_s, queries, sq, BLOCK_N, STAGES,
                                                        s_layout, TREE)
        m_i, l_i, u_i, w_i = _fold(s, dp, m_i, l_i, u_i, w_i, sq, queries, t_end, MASKED, False, BLOCK_N, s_layout,
                                   TREE)
        mbarrier.arrive(empty.index((c0 + t_end) % STAGES), count=1)
        return m_i, l_i, u_i, w_i

    @gluon.jit
    def _consumer(q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty, QRS, KRS, VRS, DORS, LSE2, LSE2DO, DELTA,
                  DS_BOUND, bh_q, bh_k, SQ, SK, m0, t_hi, qk_scale, WG: gl.constexpr, HALF_Q: gl.constexpr,
                  BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr, PIPELINED: gl.constexpr,
                  STAGES: gl.constexpr, TREE: gl.constexpr):
        """One warpgroup: the statistics of queries m0 + WG·64 .. + 64 of the program."""
        s_layout: gl.constexpr = mma_layout(BLOCK_N)
        qa_layout: gl.constexpr = a_operand_layout(s_layout)
        q0 = m0 + WG * HALF_Q
        queries, sq, sdo = _row_factors(QRS, KRS, VRS, DORS, bh_q, bh_k, SQ, SK, q0, qk_scale, HALF_Q,
                                        gl.SliceLayout(1, s_layout))
        mbarrier.wait(q_bar, 0)
        q_reg = q_smem.index(WG).load(qa_layout)
        do_reg = do_smem.index(WG).load(qa_layout)
        _stats_rows(q_reg, do_reg, 0, k_smem, v_smem, ready, empty, LSE2, LSE2DO, DELTA, DS_BOUND, bh_q, SQ, q0, t_hi,
                    queries, sq, sdo, HALF_Q, BLOCK_N, CAUSAL, PIPELINED, STAGES, TREE)

    @gluon.jit
    def _row_factors(QRS, KRS, VRS, DORS, bh_q, bh_k, SQ, SK, q0, qk_scale, HALF_Q: gl.constexpr,
                     rows: gl.constexpr):
        """A warpgroup's queries q0 .. q0 + HALF_Q and their per-row factors (queries, sq, sdo), as the
        Triton launch forms them (bwd_dq_fp8_kernel with KV_HEAD, in its order)."""
        queries = q0 + gl.arange(0, HALF_Q, layout=rows)
        stat = bh_q * SQ + queries
        sq = (gl.load(QRS + stat) * qk_scale) * gl.load(KRS + bh_k * SK)
        sdo = gl.load(DORS + stat) * gl.load(VRS + bh_k * SK)
        return queries, sq, sdo

    @gluon.jit
    def _stats_rows(q_reg, do_reg, c0, k_smem, v_smem, ready, empty, LSE2, LSE2DO, DELTA, DS_BOUND, bh_q, SQ, q0, t_hi,
                    queries, sq, sdo, HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                    PIPELINED: gl.constexpr, STAGES: gl.constexpr, TREE: gl.constexpr):
        """A warpgroup's statistics of queries q0 .. q0 + HALF_Q from their codes ``q_reg``, ``do_reg``
        and :func:`_row_factors`: key tiles 0 <= t < t_hi (ring positions c0 + t), then LSE', D',
        LSE'^do and the dS bound, written."""
        s_layout: gl.constexpr = mma_layout(BLOCK_N)
        rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        stat = bh_q * SQ + queries
        m_i = gl.full([HALF_Q], float("-inf"), gl.float32, rows)
        if TREE:  # l, u and w per lane (_fold)
            l_i = lane_partials(gl.zeros([HALF_Q, BLOCK_N], gl.float32, s_layout), "sum")
            u_i = l_i
            w_i = l_i
        else:
            l_i = gl.zeros([HALF_Q], gl.float32, rows)
            u_i = gl.zeros([HALF_Q], gl.float32, rows)
            w_i = gl.zeros([HALF_Q], gl.float32, rows)
        if PIPELINED:  # up to the diagonal (causal, then the rest unseen) or every tile
            t_end = q0 // BLOCK_N if CAUSAL else t_hi - 1
            m_i, l_i, u_i, w_i = _pipelined_tiles(t_end, c0, m_i, l_i, u_i, w_i, q_reg, do_reg, k_smem, v_smem, ready,
                                                  empty, queries, sq, CAUSAL, BLOCK_N, STAGES, s_layout, TREE)
            if CAUSAL:
                m_i, l_i, u_i, w_i = _consumer_tiles(t_end + 1, t_hi, c0, m_i, l_i, u_i, w_i, q_reg, do_reg, k_smem,
                                                     v_smem, ready, empty, queries, sq, False, True, BLOCK_N,
                                                     STAGES, s_layout, TREE)
        elif CAUSAL:  # key tiles before this warpgroup's diagonal, the diagonal (masked), the rest unseen
            t_diag = q0 // BLOCK_N
            m_i, l_i, u_i, w_i = _consumer_tiles(0, t_diag, c0, m_i, l_i, u_i, w_i, q_reg, do_reg, k_smem, v_smem,
                                                 ready, empty, queries, sq, False, False, BLOCK_N, STAGES, s_layout,
                                                 TREE)
            m_i, l_i, u_i, w_i = _consumer_tiles(t_diag, t_diag + HALF_Q // BLOCK_N, c0, m_i, l_i, u_i, w_i, q_reg,
                                                 do_reg, k_smem, v_smem, ready, empty, queries, sq, True, False,
                                                 BLOCK_N, STAGES, s_layout, TREE)
            m_i, l_i, u_i, w_i = _consumer_tiles(t_diag + HALF_Q // BLOCK_N, t_hi, c0, m_i, l_i, u_i, w_i, q_reg,
                                                 do_reg, k_smem, v_smem, ready, empty, queries, sq, False, True,
                                                 BLOCK_N, STAGES, s_layout, TREE)
        else:
            m_i, l_i, u_i, w_i = _consumer_tiles(0, t_hi, c0, m_i, l_i, u_i, w_i, q_reg, do_reg, k_smem, v_smem, ready,
                                                 empty, queries, sq, False, False, BLOCK_N, STAGES, s_layout, TREE)
        if TREE:
            l_i = lanes_to_rows(l_i, "sum", rows)
            u_i = lanes_to_rows(u_i, "sum", rows)
            w_i = lanes_to_rows(w_i, "max_nan", rows)
        # The Triton launch's epilogue (MATCHED, DS_HEAD): LSE', D', LSE'^do, then the dS bound.
        empty_row = l_i == 0.0
        lse2 = gl.where(empty_row, float("-inf"), m_i + gl.log2(gl.where(empty_row, 1.0, l_i)))
        delta_do = gl.where(empty_row, 0.0, u_i / gl.where(empty_row, 1.0, l_i))
        lse2do = lse2 - gl.log2(sdo)
        m_safe = gl.where(m_i == float("-inf"), 0.0, m_i)
        bound = (w_i + gl.abs(delta_do)) * gl.exp2(gl.where(empty_row, 0.0, m_safe - lse2do))
        bound = gl.where(empty_row, 0.0, bound)
        bits = gl.where(bound != bound, 0x7FFFFFFF, bound.to(gl.int32, bitcast=True))  # NaN as the largest
        gl.atomic_max(DS_BOUND + bh_q, gl.max(bits, 0))
        gl.store(LSE2 + stat, lse2)
        gl.store(LSE2DO + stat, lse2do)
        gl.store(DELTA + stat, delta_do)


    @gluon.jit
    def _persistent_consumer(q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty, SCHED, i0, i1, N_BLK, H, G,
                             QRS, KRS, VRS, DORS, LSE2, LSE2DO, DELTA, DS_BOUND, SQ, SK, qk_scale, WG: gl.constexpr,
                             HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                             PIPELINED: gl.constexpr, STAGES: gl.constexpr, TREE: gl.constexpr):
        """One warpgroup of a persistent program over entries i0 <= j < i1 of its schedule: per block
        :func:`_consumer`'s work (Q's and dO's codes in registers, then the buffers released to the
        producer for the next block), the ring's positions running on across blocks."""
        s_layout: gl.constexpr = mma_layout(BLOCK_N)
        qa_layout: gl.constexpr = a_operand_layout(s_layout)
        c = 0
        for j in range(i0, i1):
            bh_q, bh_k, m0, t_hi = scheduled_block(SCHED, j, N_BLK, H, G, SK, 2 * HALF_Q, BLOCK_N, CAUSAL)
            q0 = m0 + WG * HALF_Q
            queries, sq, sdo = _row_factors(QRS, KRS, VRS, DORS, bh_q, bh_k, SQ, SK, q0, qk_scale, HALF_Q,
                                            gl.SliceLayout(1, s_layout))
            q_reg, do_reg = persistent_query_side_codes(q_smem, do_smem, q_bar, q_free, j - i0, WG, qa_layout)
            _stats_rows(q_reg, do_reg, c, k_smem, v_smem, ready, empty, LSE2, LSE2DO, DELTA, DS_BOUND, bh_q, SQ, q0,
                        t_hi, queries, sq, sdo, HALF_Q, BLOCK_N, CAUSAL, PIPELINED, STAGES, TREE)
            c += t_hi

    @gluon.jit
    def _stats_kernel(
        q_desc, do_desc,  # row-wise codes of Q and dO: (B·Hq·Sq, D), boxes (HALF_Q, D)
        k_desc, v_desc,  # row-wise codes of K and V: (B·Hkv·Sk, D), boxes (BLOCK_N, D)
        QRS, KRS, VRS, DORS,  # (B, H, S) fp32 row scales, one value per head
        LSE2, LSE2DO, DELTA,  # (B·Hq, Sq) fp32, written
        DS_BOUND,  # (B·Hq,) int32: each query head's fp32 dS bound, as bits (atomic max)
        H, G, SQ, SK, qk_scale,
        HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr, HEAD_GROUP: gl.constexpr,
        PIPELINED: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        TREE: gl.constexpr,
    ):
        bh_q, bh_k, m0, t_hi = query_block(H, G, SK, 2 * HALF_Q, BLOCK_N, CAUSAL, HEAD_GROUP)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bar, ready, empty = ring_barriers(STAGES, 1)  # ready: the producer's expect alone

        gl.warp_specialize([
            (_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty, QRS, KRS, VRS, DORS, LSE2, LSE2DO,
                         DELTA, DS_BOUND, bh_q, bh_k, SQ, SK, m0, t_hi, qk_scale, 0, HALF_Q, BLOCK_N, D, CAUSAL,
                         PIPELINED, STAGES, TREE)),
            (_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, ready, empty, QRS, KRS, VRS, DORS, LSE2, LSE2DO,
                         DELTA, DS_BOUND, bh_q, bh_k, SQ, SK, m0, t_hi, qk_scale, 1, HALF_Q, BLOCK_N, D, CAUSAL,
                         PIPELINED, STAGES, TREE)),
            (query_side_producer, (q_desc, do_desc, k_desc, v_desc, None, q_smem, do_smem, k_smem, v_smem, None,
                                   q_bar, ready, empty, bh_q * SQ + m0, bh_k * SK, 0, t_hi, HALF_Q, BLOCK_N,
                                   STAGES)),  # no transposed K: the statistics form no dQ
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


    @gluon.jit
    def _stats_persistent_kernel(
        q_desc, do_desc, k_desc, v_desc,  # as _stats_kernel's
        SCHED,  # int32: persistent_schedule.schedule's table
        QRS, KRS, VRS, DORS, LSE2, LSE2DO, DELTA, DS_BOUND,  # as _stats_kernel's
        H, G, SQ, SK, N_BLK, qk_scale,
        HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
        PIPELINED: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
        TREE: gl.constexpr,
    ):
        """_stats_kernel as a persistent kernel (``PERSISTENT``): one program per SM over its schedule's
        blocks, the same bits."""
        i0, i1 = program_entries(SCHED)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bar, ready, empty = ring_barriers(STAGES, 1)
        q_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_free, count=2)
        gl.warp_specialize([
            (_persistent_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty, SCHED, i0, i1, N_BLK,
                                    H, G, QRS, KRS, VRS, DORS, LSE2, LSE2DO, DELTA, DS_BOUND, SQ, SK, qk_scale, 0,
                                    HALF_Q, BLOCK_N, D, CAUSAL, PIPELINED, STAGES, TREE)),
            (_persistent_consumer, (q_smem, do_smem, k_smem, v_smem, q_bar, q_free, ready, empty, SCHED, i0, i1, N_BLK,
                                    H, G, QRS, KRS, VRS, DORS, LSE2, LSE2DO, DELTA, DS_BOUND, SQ, SK, qk_scale, 1,
                                    HALF_Q, BLOCK_N, D, CAUSAL, PIPELINED, STAGES, TREE)),
            (persistent_query_side_producer, (q_desc, do_desc, k_desc, v_desc, None, q_smem, do_smem, k_smem, v_smem,
                                              None, q_bar, q_free, ready, empty, SCHED, i0, i1, N_BLK, H, G, SQ, SK,
                                              HALF_Q, BLOCK_N, D, CAUSAL, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


__all__ = ["BLOCK_M", "BLOCK_N", "HEAD_DIMS", "LAYOUTS", "LAYOUT_CONSTANTS", "PERSISTENT", "PIPELINED",
           "gluon_dq_stats", "scope_reason", "unsupported_reason"]
