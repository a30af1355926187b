"""The fused dK/dV launch of the block-free recipes on Hopper, written in Gluon and warp-specialised.

It computes what ``bwd_dkdv_fp8_kernel`` (backward_fp8.py) computes for the block-free recipes
(``fp8_delta``, ``fp8_stale`` and their fast twins: one scale per (sequence, head) for K and V, Q's
and dO's per token or, fast, per (sequence, head) (``QDO_HEAD``), channel scales per sequence, P on
the fixed grid, dS one scale per query head), from the same FP8 copies,
statistics and scales, and writes the same dK and dV up to the order of the fp32 accumulation. Why
a second kernel (benchmarks/NOTES.md, "Backward"): the Triton launch runs 64 keys x 32 queries per
iteration on one warpgroup and reads all four MMAs' operands from shared memory, K and V included
(48 KB of shared-memory traffic against 256 clocks of FP8 MMA per iteration). Here, as in
FlashAttention-3's backward:

- a producer warp brings each query tile's four FP8 copies (Q and dO row-wise for Sᵀ and dPᵀ, Qᵀ and
  dOᵀ channel-wise for dK and dV) by TMA into a ``STAGES``-deep ring, with its LSE' and D' values;
- two consumer warpgroups own 64 keys each (128 per program) and share every 64-query tile; the
  MMAs read K's and V's codes (the A operand of Sᵀ = K Qᵀ and dP'ᵀ = V dOᵀ) from shared memory,
  which leaves the registers for 64-query tiles. Each warpgroup issues a tile's dV and dK products
  with the next tile's Sᵀ and dP'ᵀ and waits for the four at once (``PRODUCTS_UNDER_EXPS``, off:
  past causal calls' diagonal tiles the next Sᵀ and dP'ᵀ waited for alone, the next tile's Pᵀ formed
  while dV and dK run). ``LAYOUTS`` names the
  alternatives the kernel is built and tested in: each product waited for in turn; K and V in
  registers with 32-query tiles (half the shared-memory reads per product; the first default, 7%
  slower on the H200); in shared memory with 32-query tiles.

One program per (128 keys, batch · kv head) loops over the G query heads of its kv head (GQA) and
their visible query tiles, causal programs with the most tiles first, four kv heads at a time
(``gluon_hopper.DISPATCH``). Per query head the
accumulators are rescaled by the ratio of the previous head's channel factors to this head's, as
the Triton launch does (its COL_SEQ docstring), so the result is Σ_g c_g · (head g's products).

Scope (:func:`scope_reason`): the block-free recipes in E4M3, head dims 64 and 128 (both enabled
by ``backward.LAUNCH["gluon_dkdv"]``; at 64 the backward 3-12% faster than with the Triton launch's
64 x 64 tiles on the H100, benchmarks/NOTES.md "Backward"), dense batches (no packed sequences, no
window), key lengths a multiple of 128 and query lengths of ``BLOCK_Q`` (64), causal only with as
many queries as keys, no soft-cap or K-smoothing row constant (attention sinks are in LSE' already).
Elsewhere the Triton launch runs. On the H200 it made the fast backward 6-13% faster at d = 128 (its
first version, without GQA: 1.84 -> 1.38 ms at B = 2, H = 16, S = 8192, causal; benchmarks/NOTES.md,
"Backward").
"""
from __future__ import annotations

import torch

from ..config import FP8AttentionConfig
from ..masking import MaskSpec
from .gluon_hopper import descriptor, device_reason, gluon, head_group, recipe_reason, shape_reason
from .launch import launch as launch_kernel

if gluon is not None:
    from .gluon_hopper import (
        a_operand_codes, a_operand_layout, cta_fence, ds_head_scale, gl, grouped_program, mbarrier, mma_layout,
        ring_barriers, scale_from_amax, tma_load, warpgroup_mma, warpgroup_mma_wait,
    )

HEAD_DIMS = (64, 128)  # head dims the kernel is built for (no padding: the codes' width is the head dim)
BLOCK_Q, HALF_K, STAGES = 64, 64, 3  # queries per tile; keys per consumer warpgroup; ring depth
BLOCK_K = 2 * HALF_K
# K's and V's codes as the register A operand of Sᵀ and dP'ᵀ (True), or read by those MMAs from
# shared memory (False). Shared memory frees 32 registers per thread: it leaves 64-query tiles
# (BLOCK_Q = 64) spill-free and unserialised (offline, sm_90a), which in registers spill and make
# ptxas serialise every wgmma. On the H200 the kernel took 1342 instead of 1445 us with them at 8k
# causal, B = 2, H = 16 (benchmarks/NOTES.md, "Backward").
KV_IN_REGISTERS = False
# One wait per query tile for its dV and dK products and the next tile's Sᵀ and dP'ᵀ together (True),
# or Sᵀ, dP'ᵀ and the products waited for in turn (False): the Gluon forward's form (forward_gluon.py).
# On the H200 (G = 1): 1328 -> 1303 us at 8k causal, B = 2, H = 16, the backward 3% faster at 16k
# causal and 8k non-causal, unchanged at 8k causal (benchmarks/NOTES.md, "Backward"). Offline the
# loops spill nothing; Sᵀ and dP'ᵀ held across a head boundary spill there (GQA), once per head.
MERGED_WAITS = True
# With GQA (groups > 1) the merged form only if MERGED_GQA: there Sᵀ and dP'ᵀ held across each head
# boundary spill, and on the H200 the backward at 8k causal, 16 query / 8 kv heads took 3.46-3.53 ms
# merged against 3.34-3.35 ms waiting in turn (benchmarks/NOTES.md, "Backward").
MERGED_GQA = False
# A tile's dV and dK products run under the next tile's exponentials (True; any G): the next tile's
# Sᵀ and dP'ᵀ are issued ahead of them and waited for alone, its 448·Pᵀ formed while dV and dK run,
# then those waited for behind a CTA fence (gluon_hopper.cta_fence: without it ptxas issues their
# wait right after Sᵀ's and dP'ᵀ's) and dSᵀ formed. The merged waits leave this warpgroup's MMAs
# idle while it forms Pᵀ and dSᵀ. The same operations on the same values as
# the other schedules, so the same bits; each head's first Sᵀ, dP'ᵀ and last dV, dK unhidden.
# Causal calls, past each program's diagonal tiles (those run in turn): offline (sm_90a, Triton 3.6)
# that loop takes 315 / 331 instructions a tile (per-head / per-token Q and dO scales; 303 / 317
# merged), nothing spilled; non-causal loops spilled 19-37 values a tile at d = 128 in every form
# tried and keep the merged waits (benchmarks/NOTES.md, "Backward").
PRODUCTS_UNDER_EXPS = False
# The layouts and schedules the kernel is built and tested in: name -> values of LAYOUT_CONSTANTS;
# the first is the default above.
LAYOUT_CONSTANTS = ("KV_IN_REGISTERS", "BLOCK_Q", "MERGED_WAITS", "MERGED_GQA", "PRODUCTS_UNDER_EXPS")
LAYOUTS = {"kv_shared_q64_merged": (False, 64, True, False, False),
           "kv_shared_q64_merged_gqa": (False, 64, True, True, False),
           "kv_shared_q64_under_exps": (False, 64, True, False, True),
           "kv_shared_q64": (False, 64, False, False, False), "kv_registers_q32": (True, 32, False, False, False),
           "kv_shared_q32": (False, 32, False, False, False)}
# Pᵀ's and dSᵀ's codes handed to dV's and dK's products in the registers their accumulators put them in
# (gluon_hopper.a_operand_in_place; dO's and Q's channel-wise copies written with their queries in that
# order, ``quantize.Copies.col_pv``) instead of moved to the FP8 A operand's layout: offline (sm_90a,
# Triton 3.6) 352 -> 303 instructions per query tile.
A_IN_PLACE = True
# Registers per thread: 168 at launch, the consumers raised to 240 (their interior loops spill
# nothing offline, Triton 3.9, sm_90a), the producer warp lowered to 24.
CONSUMER_REGS, PRODUCER_REGS, MAXNREG = 240, 24, 168


def merged_mode(groups: int, causal: bool) -> int | bool:
    """The kernel's MERGED constexpr for ``groups`` query heads per kv head: 2 for the products under
    the next tile's exponentials (``PRODUCTS_UNDER_EXPS``, causal, any G), else the merged waits
    (``MERGED_WAITS``; with GQA only with ``MERGED_GQA``)."""
    if PRODUCTS_UNDER_EXPS and causal:
        return 2
    return MERGED_WAITS and (groups == 1 or MERGED_GQA)


def scope_reason(shape_q: tuple, shape_k: tuple, mask: MaskSpec, config: FP8AttentionConfig,
                 mod_meta: dict) -> str | None:
    """None when the call is in the kernel's scope (any device), else why not (one short phrase).
    ``shape_q`` (B, Hq, Sq, D), ``shape_k`` (B, Hkv, Sk, D): the inputs' shapes; ``mod_meta``: the
    logit modifiers' constexprs (``LogitMods.meta``)."""
    return (recipe_reason(shape_q, shape_k, mask, config, mod_meta)
            or shape_reason(shape_q, shape_k, mask, HEAD_DIMS, BLOCK_Q, BLOCK_K))


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, mask: MaskSpec, config: FP8AttentionConfig,
                       mod_meta: dict) -> str | None:
    """None when :func:`gluon_dkdv` runs this backward's dK/dV, else why not: :func:`scope_reason`,
    then the device (:func:`.gluon_hopper.device_reason`)."""
    return scope_reason(tuple(q.shape), tuple(k.shape), mask, config, mod_meta) or device_reason(q)


def gluon_dkdv(qr, qrs, qct, qcs, kr, krs, vr, vrs, dor, dors, doct, docs, lse2, delta, ds_bound, dk, dv, *,
               groups: int, qk_scale: float, tau: float, causal: bool, pow2: bool, qdo_head: bool,
               queries_in_pv_order: bool = False) -> None:
    """Fill ``dk`` and ``dv`` (B, Hkv, Sk, 128), in the inputs' dtype, from the backward's FP8 copies
    (backward.py's ``_launch_fp8``, which runs the statistics launch first):

    - ``qr``, ``dor`` (B, Hq, Sq, 128) e4m3: row-wise codes of Q and dO; ``qrs``, ``dors`` (B, Hq, Sq)
      fp32: their scales, one per token, or with ``qdo_head`` one per head (repeated per token);
    - ``qct``, ``doct`` (B, Hq, 128, Sq_pad) e4m3: channel-wise transposed codes; ``qcs``, ``docs``
      (B, Hq, n_tiles, 128) fp32: their channel scales (the sequence's, in tile 0);
    - ``kr``, ``vr`` (B, Hkv, Sk, 128) e4m3 and ``krs``, ``vrs`` (B, Hkv, Sk) fp32: K's and V's;
    - ``lse2``, ``delta`` (B·Hq, Sq) fp32: LSE' and D'; ``ds_bound`` (B·Hq,) int32: the bits of each
      query head's fp32 dS bound.

    ``groups``: query heads per kv head; ``qk_scale``: softmax scale · log2 e (and the recipe's logit
    factor); ``tau``: the softmax scale (dK's factor); ``qdo_head``: Q's and dO's row scales are one
    per (sequence, head) (``qdo_scales="head"``), read once per head instead of per query tile;
    ``queries_in_pv_order``: ``qct``'s and ``doct``'s queries in the order of
    ``quantize.pv_token_order`` (``Copies.col_pv``), Pᵀ's and dSᵀ's codes then handed to their
    products in place."""
    b, hq, sq, d = qr.shape
    hkv, sk = kr.shape[1], kr.shape[2]
    descs = (descriptor(qr.view(-1, d), (BLOCK_Q, d)), descriptor(dor.view(-1, d), (BLOCK_Q, d)),
             descriptor(qct.view(-1, qct.shape[-1]), (d, BLOCK_Q)),
             descriptor(doct.view(-1, doct.shape[-1]), (d, BLOCK_Q)),
             descriptor(kr.view(-1, d), (HALF_K, d)), descriptor(vr.view(-1, d), (HALF_K, d)))
    launch_kernel(_dkdv_kernel, (sk // BLOCK_K, b * hkv),
        *descs, qrs, krs, vrs, dors, qcs, docs, lse2, delta, ds_bound, dk, dv,
        hq, groups, sq, sk, qcs.shape[2], qk_scale, tau,
        BLOCK_Q=BLOCK_Q, HALF_K=HALF_K, D=d, CAUSAL=causal, HEAD_GROUP=head_group(causal), POW2=pow2,
        QDO_HEAD=qdo_head, KV_REGS=KV_IN_REGISTERS,
        MERGED=merged_mode(groups, causal),
        STAGES=STAGES, CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, IN_PLACE=queries_in_pv_order,
        num_warps=4, maxnreg=MAXNREG)


if gluon is not None:
    @gluon.jit
    def _channel_factor(SCALES, DS_BOUND, bh_q, head, NT_Q, present, WITH_DS: gl.constexpr, D: gl.constexpr,
                        POW2: gl.constexpr, layout: gl.constexpr):
        """(D,) in ``layout``: query head ``bh_q``'s channel factors, the sequence's channel scales
        ``SCALES`` (B·Hq, NT_Q, D) (Q's for dK, dO's for dV), times dS's scale with WITH_DS (``head``:
        the head's index sequence · H + head in ``DS_BOUND``); ones where ``present`` is false
        (nothing is read then)."""
        chan = gl.arange(0, D, layout=layout)
        c = gl.load(SCALES + bh_q * NT_Q * D + chan, mask=present & (chan < D), other=1.0)
        if WITH_DS:
            bound = gl.load(DS_BOUND + head, mask=present, other=0)
            c = c * gl.where(present, scale_from_amax(bound.to(gl.float32, bitcast=True), POW2), 1.0)
        return c

    @gluon.jit
    def _producer(q_desc, do_desc, qt_desc, dot_desc, k_desc, v_desc, q_smem, do_smem, qt_smem, dot_smem, k_smem,
                  v_smem, lse_smem, dl_smem, sf_smem, dsf_smem, kv_bar, ready, empty, LSE2, DELTA, QRS, DORS,
                  DS_BOUND, sk, sv, seq, h0, H, bh_q0, G, SQ, row_k0, n0, t_lo, t_hi, BLOCK_Q: gl.constexpr,
                  HALF_K: gl.constexpr, D: gl.constexpr, POW2: gl.constexpr, STAGES: gl.constexpr,
                  QDO_HEAD: gl.constexpr):
        """One warp: the program's K and V tiles (two 64-key halves each) once, then per query head g
        and query tile t its four FP8 copies (TMA), its LSE' and D' and, unless QDO_HEAD, its per-query
        factors of Sᵀ and dSᵀ (:func:`_consumer`'s ``s_mul`` and ``ds_mul`` with Q's and dO's row
        scales; plain loads, shared stores) into ring slot i % STAGES, i counting the tiles over all
        heads."""
        mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
        for w in gl.static_range(2):
            tma_load(k_desc, [row_k0 + n0 + w * HALF_K, 0], kv_bar, k_smem.index(w))
            tma_load(v_desc, [row_k0 + n0 + w * HALF_K, 0], kv_bar, v_smem.index(w))
        vec: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        offs = gl.arange(0, BLOCK_Q, layout=vec)
        nbytes: gl.constexpr = (q_desc.block_type.nbytes + do_desc.block_type.nbytes + qt_desc.block_type.nbytes
                                + dot_desc.block_type.nbytes)
        n_t = t_hi - t_lo
        for g in range(G):
            row_q0 = (bh_q0 + g) * SQ
            row_t0 = (bh_q0 + g) * D
            ds_inv = gl.div_rn(1.0, ds_head_scale(DS_BOUND, seq * H + h0 + g, POW2))  # read without QDO_HEAD
            for t in range(t_lo, t_hi):
                i = g * n_t + t - t_lo
                slot = i % STAGES
                mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # the first round does not wait
                bar = ready.index(slot)
                mbarrier.expect(bar, nbytes)
                q0 = t * BLOCK_Q
                tma_load(q_desc, [row_q0 + q0, 0], bar, q_smem.index(slot))
                tma_load(do_desc, [row_q0 + q0, 0], bar, do_smem.index(slot))
                tma_load(qt_desc, [row_t0, q0], bar, qt_smem.index(slot))
                tma_load(dot_desc, [row_t0, q0], bar, dot_smem.index(slot))
                lse_smem.index(slot).store(gl.load(LSE2 + row_q0 + q0 + offs))
                dl_smem.index(slot).store(gl.load(DELTA + row_q0 + q0 + offs))
                if not QDO_HEAD:  # the Triton launch's per-query factors, in its order
                    sf_smem.index(slot).store(gl.load(QRS + row_q0 + q0 + offs) * sk)
                    dsf_smem.index(slot).store(((gl.load(DORS + row_q0 + q0 + offs) * sv) * (1.0 / 448.0)) * ds_inv)
                mbarrier.arrive(bar, count=1)  # the slot's second arrival (expect is the first)

    @gluon.jit
    def _pt_tile(st, t, lse_slot, sf_slot, keys, s_mul, MASKED: gl.constexpr, QDO_HEAD: gl.constexpr,
                 BLOCK_Q: gl.constexpr, s_layout: gl.constexpr):
        """448 · Pᵀ of query tile t from its Sᵀ (keys x queries) and the slot's LSE': the Triton
        launch's one-exponential form (``_dkdv_tiles`` with P_FIXED), the same fp32 operations.
        Sᵀ's factor: ``s_mul`` (QDO_HEAD), else one per query from the slot's ``sf_slot``."""
        cols: gl.constexpr = gl.SliceLayout(0, s_layout)
        lse2 = lse_slot.load(cols) - 8.807354922057604  # log2 448: Pᵀ comes out as 448·Pᵀ
        if QDO_HEAD:
            pt = gl.exp2(st * s_mul - gl.expand_dims(lse2, 0))
        else:
            pt = gl.exp2(st * gl.expand_dims(sf_slot.load(cols), 0) - gl.expand_dims(lse2, 0))
        if MASKED:
            pos_q = t * BLOCK_Q + gl.arange(0, BLOCK_Q, layout=cols)
            vis = gl.expand_dims(pos_q, 0) >= gl.expand_dims(keys, 1)
            pt = gl.where(vis, pt, 0.0)
        return pt

    @gluon.jit
    def _dst_values(pt, dpt, dl_slot, dsf_slot, ds_mul, QDO_HEAD: gl.constexpr, s_layout: gl.constexpr):
        """dSᵀ before its codes, (448 · Pᵀ)(dP'ᵀ − D') times its factor (fp32, in Sᵀ's layout): the
        factor ``ds_mul`` (QDO_HEAD), else one per query from the slot's ``dsf_slot``."""
        cols: gl.constexpr = gl.SliceLayout(0, s_layout)
        delta = dl_slot.load(cols)
        if QDO_HEAD:
            dst = pt * (dpt - gl.expand_dims(delta, 0)) * ds_mul
        else:
            dst = pt * (dpt - gl.expand_dims(delta, 0)) * gl.expand_dims(dsf_slot.load(cols), 0)
        return dst

    @gluon.jit
    def _dst_codes(pt, dpt, dl_slot, dsf_slot, ds_mul, QDO_HEAD: gl.constexpr, s_layout: gl.constexpr,
                   pa_layout: gl.constexpr, IN_PLACE: gl.constexpr):
        """dSᵀ's FP8 codes (:func:`_dst_values`) in the A-operand layout of the dK product (IN_PLACE:
        Q's channel-wise copy holds its queries in the order they are taken in)."""
        return a_operand_codes(_dst_values(pt, dpt, dl_slot, dsf_slot, ds_mul, QDO_HEAD, s_layout), pa_layout,
                               IN_PLACE)

    @gluon.jit
    def _consumer_tiles(t_a, t_b, i0, dk, dv, k_reg, v_reg, q_smem, do_smem, qt_smem, dot_smem, lse_smem, dl_smem,
                        sf_smem, dsf_smem, ready, empty, keys, s_mul, ds_mul, MASKED: gl.constexpr,
                        QDO_HEAD: gl.constexpr, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr,
                        pa_layout: gl.constexpr, IN_PLACE: gl.constexpr):
        """Query tiles t_a <= t < t_b of one query head (ring index i0 + t − t_a) into one
        warpgroup's dK and dV: the Triton launch's one-exponential form (``_dkdv_tiles`` with
        COMPUTE_DK, COMPUTE_DV and P_FIXED), the same fp32 operations per element."""
        zero_s = gl.zeros([keys.shape[0], BLOCK_Q], gl.float32, s_layout)
        for t in range(t_a, t_b):
            i = i0 + t - t_a
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            st = warpgroup_mma(k_reg, q_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v_reg, do_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            st = warpgroup_mma_wait(num_outstanding=1, deps=(st, ))
            pt = _pt_tile(st, t, lse_smem.index(slot), sf_smem.index(slot), keys, s_mul, MASKED, QDO_HEAD, BLOCK_Q,
                          s_layout)
            p8 = a_operand_codes(pt, pa_layout, IN_PLACE)  # IN_PLACE: dO's copy in that order
            dv = warpgroup_mma(p8, dot_smem.index(slot).permute((1, 0)), dv, is_async=True)
            dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt, ))
            ds8 = _dst_codes(pt, dpt, dl_smem.index(slot), dsf_smem.index(slot), ds_mul, QDO_HEAD, s_layout,
                             pa_layout, IN_PLACE)
            dk = warpgroup_mma(ds8, qt_smem.index(slot).permute((1, 0)), dk, is_async=True)
            dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
            mbarrier.arrive(empty.index(slot), count=1)
        return dk, dv

    @gluon.jit
    def _consumer_tiles_merged(t_a, t_b, i0, i_last, dk, dv, st, dpt, k_reg, v_reg, q_smem, do_smem, qt_smem, dot_smem,
                               lse_smem, dl_smem, sf_smem, dsf_smem, ready, empty, keys, s_mul, ds_mul,
                               MASKED: gl.constexpr, QDO_HEAD: gl.constexpr, BLOCK_Q: gl.constexpr,
                               STAGES: gl.constexpr, s_layout: gl.constexpr, pa_layout: gl.constexpr,
                               IN_PLACE: gl.constexpr):
        """:func:`_consumer_tiles` with one wait per tile: ``st``, ``dpt`` are tile t_a's Sᵀ and dP'ᵀ,
        complete; tile t's dV and dK products and the next ring tile's Sᵀ and dP'ᵀ (ring index i + 1,
        whichever head it belongs to; the last tile, ``i_last``, repeats its own, which it discards:
        no branch around the MMAs) are issued together and waited for together. Returns (dk, dv, st,
        dpt) with the next tile's products complete."""
        zero_s = gl.zeros([keys.shape[0], BLOCK_Q], gl.float32, s_layout)
        for t in range(t_a, t_b):
            i = i0 + t - t_a
            slot = i % STAGES
            pt = _pt_tile(st, t, lse_smem.index(slot), sf_smem.index(slot), keys, s_mul, MASKED, QDO_HEAD, BLOCK_Q,
                          s_layout)
            p8 = a_operand_codes(pt, pa_layout, IN_PLACE)  # IN_PLACE: dO's copy in that order
            dv = warpgroup_mma(p8, dot_smem.index(slot).permute((1, 0)), dv, is_async=True)
            ds8 = _dst_codes(pt, dpt, dl_smem.index(slot), dsf_smem.index(slot), ds_mul, QDO_HEAD, s_layout,
                             pa_layout, IN_PLACE)
            dk = warpgroup_mma(ds8, qt_smem.index(slot).permute((1, 0)), dk, is_async=True)
            j = gl.minimum(i + 1, i_last)
            mbarrier.wait(ready.index(j % STAGES), (j // STAGES) & 1)  # done already where j == i
            st = warpgroup_mma(k_reg, q_smem.index(j % STAGES).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v_reg, do_smem.index(j % STAGES).permute((1, 0)), zero_s, use_acc=False,
                                is_async=True)
            dv, dk, st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk, st, dpt))
            mbarrier.arrive(empty.index(slot), count=1)
        return dk, dv, st, dpt

    @gluon.jit
    def _under_exps_step(t, i, dk, dv, pt, dst, k_reg, v_reg, q_smem, do_smem, qt_smem, dot_smem, lse_smem, dl_smem,
                         sf_smem, dsf_smem, ready, empty, keys, s_mul, ds_mul, QDO_HEAD: gl.constexpr,
                         BLOCK_Q: gl.constexpr, STAGES: gl.constexpr, s_layout: gl.constexpr, pa_layout: gl.constexpr,
                         IN_PLACE: gl.constexpr):
        """One step of :func:`_consumer_tiles_under_exps`: tile t's (ring index i) codes from its fp32
        ``pt``, ``dst``; tile t + 1's Sᵀ and dP'ᵀ issued, then tile t's dV and dK; Sᵀ and dP'ᵀ waited
        for alone and tile t + 1's Pᵀ (unmasked) formed while dV and dK run; those waited for, slot i
        released and tile t + 1's dSᵀ formed. Returns (dk, dv) and tile t + 1's (pt, dst)."""
        zero_s = gl.zeros([keys.shape[0], BLOCK_Q], gl.float32, s_layout)
        slot = i % STAGES
        nxt = (i + 1) % STAGES
        p8 = a_operand_codes(pt, pa_layout, IN_PLACE)  # IN_PLACE: dO's copy in that order
        ds8 = a_operand_codes(dst, pa_layout, IN_PLACE)
        mbarrier.wait(ready.index(nxt), ((i + 1) // STAGES) & 1)
        st = warpgroup_mma(k_reg, q_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_reg, do_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dv = warpgroup_mma(p8, dot_smem.index(slot).permute((1, 0)), dv, is_async=True)
        dk = warpgroup_mma(ds8, qt_smem.index(slot).permute((1, 0)), dk, is_async=True)
        st, dpt = warpgroup_mma_wait(num_outstanding=2, deps=(st, dpt))  # groups complete in issue order
        pt = _pt_tile(st, t + 1, lse_smem.index(nxt), sf_smem.index(nxt), keys, s_mul, False, QDO_HEAD, BLOCK_Q,
                      s_layout)
        cta_fence(nxt)  # keeps dV's and dK's wait behind the exponentials (one fence: on a scalar)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(empty.index(slot), count=1)
        dst = _dst_values(pt, dpt, dl_smem.index(nxt), dsf_smem.index(nxt), ds_mul, QDO_HEAD, s_layout)
        return dk, dv, pt, dst

    @gluon.jit
    def _consumer_tiles_under_exps(t_a, t_b, i0, dk, dv, k_reg, v_reg, q_smem, do_smem, qt_smem, dot_smem, lse_smem,
                                   dl_smem, sf_smem, dsf_smem, ready, empty, keys, s_mul, ds_mul,
                                   QDO_HEAD: gl.constexpr, BLOCK_Q: gl.constexpr, STAGES: gl.constexpr,
                                   s_layout: gl.constexpr, pa_layout: gl.constexpr, IN_PLACE: gl.constexpr):
        """Query tiles t_a <= t < t_b (at least one, none masked) of one query head (ring index i0 + t
        − t_a) into one warpgroup's dK and dV with each tile's products under the next tile's
        exponentials (``PRODUCTS_UNDER_EXPS``): the same operations on the same values as
        :func:`_consumer_tiles`, so the same bits. Nothing is in flight on entry or return."""
        zero_s = gl.zeros([keys.shape[0], BLOCK_Q], gl.float32, s_layout)
        slot = i0 % STAGES
        mbarrier.wait(ready.index(slot), (i0 // STAGES) & 1)
        st = warpgroup_mma(k_reg, q_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_reg, do_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
        pt = _pt_tile(st, t_a, lse_smem.index(slot), sf_smem.index(slot), keys, s_mul, False, QDO_HEAD, BLOCK_Q,
                      s_layout)
        dst = _dst_values(pt, dpt, dl_smem.index(slot), dsf_smem.index(slot), ds_mul, QDO_HEAD, s_layout)
        for t in range(t_a, t_b - 1):
            dk, dv, pt, dst = _under_exps_step(t, i0 + t - t_a, dk, dv, pt, dst, k_reg, v_reg, q_smem, do_smem,
                                               qt_smem, dot_smem, lse_smem, dl_smem, sf_smem, dsf_smem, ready, empty,
                                               keys, s_mul, ds_mul, QDO_HEAD, BLOCK_Q, STAGES, s_layout, pa_layout,
                                               IN_PLACE)
        slot = (i0 + t_b - 1 - t_a) % STAGES  # the last tile's products
        p8 = a_operand_codes(pt, pa_layout, IN_PLACE)
        ds8 = a_operand_codes(dst, pa_layout, IN_PLACE)
        dv = warpgroup_mma(p8, dot_smem.index(slot).permute((1, 0)), dv, is_async=True)
        dk = warpgroup_mma(ds8, qt_smem.index(slot).permute((1, 0)), dk, is_async=True)
        dv, dk = warpgroup_mma_wait(num_outstanding=0, deps=(dv, dk))
        mbarrier.arrive(empty.index(slot), count=1)
        return dk, dv

    @gluon.jit
    def _consumer(q_smem, do_smem, qt_smem, dot_smem, k_smem, v_smem, lse_smem, dl_smem, sf_smem, dsf_smem, kv_bar,
                  ready, empty, QRS, DORS, QCS, DOCS, DS_BOUND, DK, DV, sk, sv, seq, h0, bh_q0, H, G, SQ, NT_Q, row_k0,
                  n0, t_lo, t_m, t_hi, tau, WG: gl.constexpr, BLOCK_Q: gl.constexpr, HALF_K: gl.constexpr,
                  D: gl.constexpr, CAUSAL: gl.constexpr, POW2: gl.constexpr, QDO_HEAD: gl.constexpr,
                  KV_REGS: gl.constexpr, MERGED: gl.constexpr, STAGES: gl.constexpr, IN_PLACE: gl.constexpr):
        """One warpgroup: keys n0 + WG·64 .. + 64 of the program, over the G query heads; writes
        their dK and dV."""
        s_layout: gl.constexpr = mma_layout(BLOCK_Q)
        o_layout: gl.constexpr = mma_layout(D)
        ka_layout: gl.constexpr = a_operand_layout(s_layout)
        pa_layout: gl.constexpr = a_operand_layout(o_layout)
        keys = n0 + WG * HALF_K + gl.arange(0, HALF_K, layout=gl.SliceLayout(1, s_layout))
        vec: gl.constexpr = gl.SliceLayout(0, o_layout)
        mbarrier.wait(kv_bar, 0)
        if KV_REGS:
            k_reg = k_smem.index(WG).load(ka_layout)
            v_reg = v_smem.index(WG).load(ka_layout)
        else:  # the MMAs read them where TMA put them (never overwritten)
            k_reg = k_smem.index(WG)
            v_reg = v_smem.index(WG)
        dk = gl.zeros([HALF_K, D], gl.float32, o_layout)
        dv = gl.zeros([HALF_K, D], gl.float32, o_layout)
        n_t = t_hi - t_lo
        if MERGED == 1:  # the first ring tile's products, for the merged loops
            zero_s = gl.zeros([HALF_K, BLOCK_Q], gl.float32, s_layout)
            mbarrier.wait(ready.index(0), 0)
            st = warpgroup_mma(k_reg, q_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            dpt = warpgroup_mma(v_reg, do_smem.index(0).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            st, dpt = warpgroup_mma_wait(num_outstanding=0, deps=(st, dpt))
        for g in range(G):
            bh_q = bh_q0 + g
            # The Triton launch's per-head factors (bwd_dkdv_fp8_kernel, QDO_HEAD and DS_HEAD), in its order;
            # without QDO_HEAD the producer forms them per query, with Q's and dO's row scales.
            s_mul = 1.0
            ds_mul = 1.0
            if QDO_HEAD:
                s_mul = gl.load(QRS + bh_q * SQ) * sk
                ds_scale = ds_head_scale(DS_BOUND, seq * H + h0 + g, POW2)
                ds_mul = ((gl.load(DORS + bh_q * SQ) * sv) * (1.0 / 448.0)) * gl.div_rn(1.0, ds_scale)
            # Rescale by the previous head's channel factors over this head's (1 before the first head),
            # one accumulator at a time: four D-channel vectors live beside dK and dV made the
            # consumers spill.
            head = seq * H + h0 + g
            ratio = gl.div_rn(_channel_factor(QCS, DS_BOUND, bh_q - 1, head - 1, NT_Q, g > 0, True, D, POW2, vec),
                              _channel_factor(QCS, DS_BOUND, bh_q, head, NT_Q, True, True, D, POW2, vec))
            dk = dk * gl.expand_dims(ratio, 0)
            ratio = gl.div_rn(_channel_factor(DOCS, DS_BOUND, bh_q - 1, head - 1, NT_Q, g > 0, False, D, POW2, vec),
                              _channel_factor(DOCS, DS_BOUND, bh_q, head, NT_Q, True, False, D, POW2, vec))
            dv = dv * gl.expand_dims(ratio, 0)
            i0 = g * n_t
            if MERGED == 2:  # (causal) the diagonal tiles in turn, then the rest under the exponentials
                dk, dv = _consumer_tiles(t_lo, t_m, i0, dk, dv, k_reg, v_reg, q_smem, do_smem, qt_smem, dot_smem,
                                         lse_smem, dl_smem, sf_smem, dsf_smem, ready, empty, keys, s_mul, ds_mul,
                                         True, QDO_HEAD, BLOCK_Q, STAGES, s_layout, pa_layout, IN_PLACE)
                if t_hi > t_m:
                    dk, dv = _consumer_tiles_under_exps(
                        t_m, t_hi, i0 + t_m - t_lo, dk, dv, k_reg, v_reg, q_smem, do_smem, qt_smem, dot_smem,
                        lse_smem, dl_smem, sf_smem, dsf_smem, ready, empty, keys, s_mul, ds_mul, QDO_HEAD, BLOCK_Q,
                        STAGES, s_layout, pa_layout, IN_PLACE)
            elif MERGED:
                if CAUSAL:  # as below
                    dk, dv, st, dpt = _consumer_tiles_merged(
                        t_lo, t_m, i0, G * n_t - 1, dk, dv, st, dpt, k_reg, v_reg, q_smem, do_smem, qt_smem, dot_smem,
                        lse_smem, dl_smem, sf_smem, dsf_smem, ready, empty, keys, s_mul, ds_mul, True, QDO_HEAD,
                        BLOCK_Q, STAGES, s_layout, pa_layout, IN_PLACE)
                dk, dv, st, dpt = _consumer_tiles_merged(
                    t_m, t_hi, i0 + t_m - t_lo, G * n_t - 1, dk, dv, st, dpt, k_reg, v_reg, q_smem, do_smem, qt_smem,
                    dot_smem, lse_smem, dl_smem, sf_smem, dsf_smem, ready, empty, keys, s_mul, ds_mul, False,
                    QDO_HEAD, BLOCK_Q, STAGES, s_layout, pa_layout, IN_PLACE)
            elif CAUSAL:  # the program's diagonal tiles, masked; then every later query tile sees every key
                dk, dv = _consumer_tiles(t_lo, t_m, i0, dk, dv, k_reg, v_reg, q_smem, do_smem, qt_smem, dot_smem,
                                         lse_smem, dl_smem, sf_smem, dsf_smem, ready, empty, keys, s_mul, ds_mul,
                                         True, QDO_HEAD, BLOCK_Q, STAGES, s_layout, pa_layout, IN_PLACE)
            if not MERGED:
                dk, dv = _consumer_tiles(t_m, t_hi, i0 + t_m - t_lo, dk, dv, k_reg, v_reg, q_smem, do_smem, qt_smem,
                                         dot_smem, lse_smem, dl_smem, sf_smem, dsf_smem, ready, empty, keys, s_mul,
                                         ds_mul, False, QDO_HEAD, BLOCK_Q, STAGES, s_layout, pa_layout, IN_PLACE)
        last = seq * H + h0 + G - 1
        dk = (dk * gl.expand_dims(_channel_factor(QCS, DS_BOUND, bh_q0 + G - 1, last, NT_Q, True, True, D, POW2, vec),
                                  0)) * tau
        dv = (dv * gl.expand_dims(_channel_factor(DOCS, DS_BOUND, bh_q0 + G - 1, last, NT_Q, True, False, D, POW2,
                                                  vec), 0)) * (1.0 / 448.0)
        rows = gl.expand_dims(row_k0 + n0 + WG * HALF_K + gl.arange(0, HALF_K, layout=gl.SliceLayout(1, o_layout)), 1)
        off = rows.to(gl.int64) * D + gl.expand_dims(gl.arange(0, D, layout=vec), 0)
        gl.store(DK + off, dk.to(DK.dtype.element_ty))
        gl.store(DV + off, dv.to(DV.dtype.element_ty))

    @gluon.jit
    def _dkdv_kernel(
        q_desc, do_desc,  # row-wise codes of Q and dO: (B·Hq·Sq, D), boxes (BLOCK_Q, D)
        qt_desc, dot_desc,  # channel-wise transposed codes: (B·Hq·D, Sq_pad), boxes (D, BLOCK_Q)
        k_desc, v_desc,  # row-wise codes of K and V: (B·Hkv·Sk, D), boxes (HALF_K, D)
        QRS, KRS, VRS, DORS,  # (B, H, S) fp32 row scales (K's and V's one per head; Q's and dO's with QDO_HEAD)
        QCS, DOCS,  # (B, Hq, NT_Q, D) fp32 channel scales, the sequence's in tile 0
        LSE2, DELTA,  # (B·Hq, Sq) fp32: LSE' and D'
        DS_BOUND,  # (B·Hq,) int32: the bits of each query head's fp32 dS bound
        DK, DV,  # (B, Hkv, Sk, D) in the input dtype
        H, G, SQ, SK, NT_Q, qk_scale, tau,
        BLOCK_Q: gl.constexpr, HALF_K: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr, HEAD_GROUP: gl.constexpr,
        POW2: gl.constexpr, QDO_HEAD: gl.constexpr, KV_REGS: gl.constexpr, MERGED: gl.constexpr, STAGES: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
        IN_PLACE: gl.constexpr,
    ):
        BLOCK_K: gl.constexpr = 2 * HALF_K
        if CAUSAL:  # longest key blocks first, HEAD_GROUP rows at a time
            pid, bh_k = grouped_program(HEAD_GROUP)
        else:
            pid = gl.num_programs(0) - 1 - gl.program_id(0)
            bh_k = gl.program_id(1)
        hkv = H // G
        seq = bh_k // hkv
        h0 = (bh_k % hkv) * G  # the kv head's first query head
        bh_q0 = seq * H + h0
        n0 = pid * BLOCK_K
        row_k0 = bh_k * SK
        t_hi = SQ // BLOCK_Q
        if CAUSAL:
            t_lo = n0 // BLOCK_Q
            t_m = gl.minimum((n0 + BLOCK_K) // BLOCK_Q, t_hi)
        else:
            t_lo = 0
            t_m = 0
        sk = gl.load(KRS + bh_k * SK) * qk_scale
        sv = gl.load(VRS + bh_k * SK)

        vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        qt_smem = gl.allocate_shared_memory(qt_desc.dtype, [STAGES] + qt_desc.block_type.shape, qt_desc.layout)
        dot_smem = gl.allocate_shared_memory(dot_desc.dtype, [STAGES] + dot_desc.block_type.shape, dot_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_Q], vec_layout)
        dl_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_Q], vec_layout)
        # Sᵀ's and dSᵀ's per-query factors per ring slot (one slot, never written, with QDO_HEAD)
        RS_SLOTS: gl.constexpr = 1 if QDO_HEAD else STAGES
        sf_smem = gl.allocate_shared_memory(gl.float32, [RS_SLOTS, BLOCK_Q], vec_layout)
        dsf_smem = gl.allocate_shared_memory(gl.float32, [RS_SLOTS, BLOCK_Q], vec_layout)
        # ready: the producer's expect and its stores of LSE' and D'
        kv_bar, ready, empty = ring_barriers(STAGES, 2)

        gl.warp_specialize([
            (_consumer, (q_smem, do_smem, qt_smem, dot_smem, k_smem, v_smem, lse_smem, dl_smem, sf_smem, dsf_smem,
                         kv_bar, ready, empty, QRS, DORS, QCS, DOCS, DS_BOUND, DK, DV, sk, sv, seq, h0, bh_q0, H, G,
                         SQ, NT_Q, row_k0, n0, t_lo, t_m, t_hi, tau, 0, BLOCK_Q, HALF_K, D, CAUSAL, POW2, QDO_HEAD,
                         KV_REGS, MERGED, STAGES, IN_PLACE)),
            (_consumer, (q_smem, do_smem, qt_smem, dot_smem, k_smem, v_smem, lse_smem, dl_smem, sf_smem, dsf_smem,
                         kv_bar, ready, empty, QRS, DORS, QCS, DOCS, DS_BOUND, DK, DV, sk, sv, seq, h0, bh_q0, H, G,
                         SQ, NT_Q, row_k0, n0, t_lo, t_m, t_hi, tau, 1, BLOCK_Q, HALF_K, D, CAUSAL, POW2, QDO_HEAD,
                         KV_REGS, MERGED, STAGES, IN_PLACE)),
            (_producer, (q_desc, do_desc, qt_desc, dot_desc, k_desc, v_desc, q_smem, do_smem, qt_smem, dot_smem,
                         k_smem, v_smem, lse_smem, dl_smem, sf_smem, dsf_smem, kv_bar, ready, empty, LSE2, DELTA,
                         QRS, DORS, DS_BOUND, sk, sv, seq, h0, H, bh_q0, G, SQ, row_k0, n0, t_lo, t_hi, BLOCK_Q,
                         HALF_K, D, POW2, STAGES, QDO_HEAD)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


__all__ = ["BLOCK_K", "BLOCK_Q", "HEAD_DIMS", "KV_IN_REGISTERS", "LAYOUTS", "LAYOUT_CONSTANTS", "MERGED_GQA",
           "MERGED_WAITS", "PRODUCTS_UNDER_EXPS", "gluon_dkdv", "merged_mode", "scope_reason", "unsupported_reason"]
