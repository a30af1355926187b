"""The block-free recipes' forward on Hopper, written in Gluon and warp-specialised.

It computes what ``_fwd_kernel`` (forward.py) computes for the block-free recipes (``fp8_delta``,
``fp8_stale`` and their fast twins: K with one scale per (sequence, head), so K_HEAD, Q's per token
or per (sequence, head), a per-row factor either way; V with one channel scale
vector per (sequence, head), so V_SEQ), from the same FP8 copies and with the same fp32 operations
per score, in the same order: per 128-key tile T, with x = Qc Kcᵀ (the raw code products),

    m_T = max_j x_j,  m' = max(m, m_T),  r_T = max(m_T, m' − G/q2),  γ = 2^((r − r_T)·q2)
    p = 2^((x − r_T)·q2 + log2 448),  l = γ·l + Σ p,  acc = fp8(p) Vcᵀ + γ·acc

and at the end O = acc · sv / l, LSE = ln 2 · (r·q2 + log2 l − log2 448) (forward.py's module
docstring: G = REF_SLACK, q2 = Q's scale · K's scale · τ · log2 e). O may differ from the Triton
launch's only by the order of the row sums of p (on the H200 it was bit-identical in every timed
shape).

The one-FMA exponent (:mod:`.exponent`, ``FMA_EXPONENT``, on by default): each consumer warpgroup compares the bound
of its 64 rows with FMA_BOUND once, then runs its tiles in the FMA form or the exact one (both
loops compiled; 548 → 487 instructions per tile in the interior loop, offline for sm_90a), and
takes LSE from the same rounded r·q2 − log2 448 as l.

Why: the Triton launch runs the two products and the per-score work of a tile one after the other
in each warp (0.74 PFLOP/s at 8k causal; the products alone take ~2/3 of its time, the per-score
work alone about as much: benchmarks/NOTES.md, "What limits the kernels"). Here a producer warp
(``gluon_hopper.query_side_producer``) brings each key tile's K codes and Vᵀ codes by TMA into a
``STAGES``-deep ring, and two consumer warpgroups own 64 queries each (128 per program). Each
issues tile t's P·V and tile t+1's S together and waits for both at once (``MERGED_WAITS``), so the
tensor cores get both products of one warpgroup while the other works on its scores; ``PINGPONG``
(off) makes the two warpgroups take turns at issuing them.

With ``QUANTIZE_Q`` (on) each consumer warpgroup makes its 64 queries' codes itself from the input Q
(:func:`_rotated_q_codes`), as the quantization launch would have: y = xH by one 16-bit wgmma with
the Hadamard matrix (brought once by TMA), one scale per token (the row's amax) or per (sequence,
head) (the fast recipes, from the statistics launch), codes of y / scale by the same division and
conversion. That launch read Q and wrote its copy for this kernel alone (the backward quantizes Q
again); here Q is read once and the copy is never written.

One program per (128 queries, batch · query head); causal programs with the most key tiles first.
Scope (:func:`scope_reason`): the block-free recipes in E4M3, key tiles of 128 or 256 (``config.block_k``,
which sets the codes of P; :data:`BLOCK_NS`), head dims 64 and 128 (``HEAD_DIMS``), dense batches, query
lengths multiples of 128 and key lengths multiples of the key tile,
causal only with as many queries as keys, no soft-cap, sinks or K-smoothing row constant.
``forward.GLUON_FORWARD`` lists the head dims it runs at.
"""
from __future__ import annotations

import functools

import torch

from ..config import FP8AttentionConfig
from ..masking import MaskSpec
from .exponent import LOG2_PMAX, fma_bound
from .gluon_hopper import TensorDescriptor, descriptor, device_reason, gluon, head_group, recipe_reason, shape_reason
from .launch import launch as launch_kernel
from .quantize import cvt_mode, hadamard_operand

# (imported at the end: forward_persistent runs this module's consumer code)

if gluon is not None:
    from .gluon_hopper import (
        a_operand_codes, a_operand_layout, cta_fence, e4m3_codes, fence_async_shared, gl, lane_partials, lanes_to_rows,
        mbarrier, mma_layout, mul_rn, per_lane, query_block, query_side_producer, ring_barriers, row_amax_nan,
        row_reduce, scale_from_amax, thread_barrier, warpgroup_mma, warpgroup_mma_wait,
    )

# Head dims the kernel is built for; forward.GLUON_FORWARD lists those it runs at. At 64 (offline,
# sm_90a, Triton 3.6: the persistent kernel's interior loop 400 instructions a 128-key tile, no
# spills, 82 KB of shared memory) it is built and tested, and slower than the Triton forward there.
HEAD_DIMS = (64, 128)
HALF_Q, BLOCK_N, STAGES = 64, 128, 3  # queries per consumer warpgroup; keys per tile; ring depth
BLOCK_M = 2 * HALF_Q
# Key tiles the kernel is built for (``config.block_k``, which sets P's codes: each tile's scores are
# taken against the tile's own reference r_T). At 256 the ring holds STAGES_256 slots (three of K's
# and Vᵀ's 32 KB tiles, with Q's codes and the Hadamard matrix, pass the 227 KB of shared memory);
# offline (sm_90a, Triton 3.6) the persistent kernel's interior loop then issues 755 instructions a
# 256-key tile against 436 a 128-key one (the row reductions, O's rescale and the waits once per
# 256 keys), with no spills in it. On the H100 it ran 2-10% slower causal and level non-causal (the loop
# is not issue-bound; benchmarks/NOTES.md, "Forward"): the recipes keep 128.
BLOCK_NS = (128, 256)
STAGES_256 = 2
# Q's codes as the register A operand of S (True), or read by that MMA from shared memory, where
# TMA put them (False: 16 registers per thread fewer).
Q_IN_REGISTERS = False
# One wait per key tile for its P·V and the next tile's S together (True), or S waited for, then
# P·V (False). On the H200 (fast recipe, B·S = 16k, H = 16): the kernel 760 -> 725 us at 8k causal
# (716 with 3 ring slots), the forward 2-7% faster than with two waits (benchmarks/NOTES.md, "Forward").
MERGED_WAITS = True
# With MERGED_WAITS, FlashAttention-3's order within a warpgroup (:func:`_consumer_tiles_pv_under`):
# tile t + 1's S issued before tile t's P·V and waited for alone, so that tile t + 1's exponentials
# run while P·V does; the same bits. Offline (sm_90a, Triton 3.6, the persistent kernel) its interior
# loop issues 456 instructions a tile against 436, all 66 exponentials between the two waits (a CTA
# fence keeps ptxas from issuing the second wait early: gluon_hopper.cta_fence). Not yet timed on a
# GPU (benchmarks/NOTES.md, "Forward"): off until it is.
PV_UNDER_SCORES = False
# Ping-pong of the two consumer warpgroups (FlashAttention-3's warp-scheduler barriers; merged waits
# only): each waits for its turn before issuing a tile's products and hands the turn over after
# issuing them, so the tensor cores take one warpgroup's products whole, then the other's, and the
# two drift half a tile apart: one's exponentials under the other's products. Off: on the H200
# (fp8_delta) no faster at 8k causal, 2-4% slower at 16k non-causal, same bits; in the persistent
# kernel with TREE_REDUCTIONS (the pair that gained in the per-block kernel) 3.1-4.7% slower than the
# default at all four shapes, both recipes (H100; benchmarks/NOTES.md, "Forward").
PINGPONG = False
# O written with the strides of its buffer (forward.output_buffer: token-major where q is, so that an
# attention layer's transpose back needs no copy) instead of contiguous. In the 0.89B Llama's step at
# 8k it takes the transposing copy's ~0.7 ms per step off, the forward kernel's time within the
# run's noise (benchmarks/NOTES.md, "End to end").
TOKEN_MAJOR_OUT = True
# The layouts and schedules the kernel is built and tested in: name -> values of LAYOUT_CONSTANTS;
# the first is the default above.
LAYOUT_CONSTANTS = ("Q_IN_REGISTERS", "MERGED_WAITS", "STAGES", "PINGPONG", "PV_UNDER_SCORES")
LAYOUTS = {"q_shared_merged_s3": (False, True, 3, False, False), "q_shared_merged": (False, True, 2, False, False),
           "q_shared": (False, False, 2, False, False), "q_registers": (True, False, 2, False, False),
           "q_shared_merged_s3_pingpong": (False, True, 3, True, False),
           "q_shared_pv_under_s3": (False, True, 3, False, True)}
CONSUMER_REGS, PRODUCER_REGS, MAXNREG = 240, 24, 168  # as backward_dkdv_gluon.py
# Q's codes made by the kernel from the input Q (module docstring) where Q is rotated and 16-bit
# (:func:`q_quantization_reason`), instead of by a quantization launch before it. Causal calls only,
# unless QUANTIZE_Q_NONCAUSAL: on the H100 (2 x 8k and 1 x 16k tokens, H = 16, CUDA-graph time, two
# machines) the causal forward took 0.7-1.8% less GPU time with it, the non-causal one 0.1-1.5% more
# (benchmarks/NOTES.md, "Forward"); the kernel computes either, the same bits.
QUANTIZE_Q = True
QUANTIZE_Q_NONCAUSAL = False
# The kernel as a persistent one (forward_persistent.py: one program per SM running a list of query
# blocks, the next block's operands loaded while the current one finishes), the same bits. On the
# H200 (2 x 8k and 1 x 16k tokens, H = 16, CUDA-graph time) the forward took 2.1-2.5% less GPU time
# at 8k causal, 1.3-1.5% less at 8k and 16k non-causal, 0.4-0.5% less at 16k causal
# (benchmarks/NOTES.md, "Forward"). The persistent kernel takes Q's codes from shared memory only: with
# Q_IN_REGISTERS (a layout experiment) the per-block kernel runs.
PERSISTENT = True
# P's codes handed to P·V in the registers S's accumulator put them in (gluon_hopper.a_operand_in_place;
# Vᵀ's keys written in that order by the K/V launch, ``quantize.Copies.col_pv``) instead of moved to the
# FP8 A operand's layout (16 shuffles, 16 selects and 16 byte permutes per thread and key tile): offline
# (sm_90a, Triton 3.6) 483 -> 435 instructions per tile in the interior loop; the same products.
P_IN_PLACE = True
# Each key tile's row maximum as a tree (gluon_hopper.row_reduce: 5 dependent steps for a row's 32
# values in a thread instead of Triton 3.6's chain of 31) and l's row sums carried per lane, reduced
# across the row's 4 lanes once after the last tile (gluon_hopper.lane_partials): offline (sm_90a,
# Triton 3.6) 436 -> 430 instructions and 8 -> 4 shuffles per tile in the interior loop, the longest
# FMNMX / FADD chain 35 / 34 -> 9 / 6. The maximum the same bits; l (so O and LSE) rounded in another
# order. Off: on the H100 (16k tokens, H = 16, CUDA graph) the forward took 4.6-6.7% more time with
# it at all four shapes; the ping-pong of the warpgroups then gained 0-5.6% in the per-block kernel,
# still short of this default (benchmarks/NOTES.md, "Forward").
TREE_REDUCTIONS = False


def ring_stages(block_n: int) -> int:
    """The ring's depth for key tiles of ``block_n``: ``STAGES`` at 128, ``STAGES_256`` at 256."""
    return STAGES if block_n == BLOCK_N else min(STAGES, STAGES_256)


def merged_mode() -> int | bool:
    """The kernels' MERGED constexpr: 2 for the merged waits in FlashAttention-3's order
    (``PV_UNDER_SCORES``), else ``MERGED_WAITS``."""
    return 2 if MERGED_WAITS and PV_UNDER_SCORES else MERGED_WAITS


def _runs_persistent() -> bool:
    """Whether :func:`gluon_forward` launches the persistent kernel (``PERSISTENT``, in its layouts)."""
    return PERSISTENT and not Q_IN_REGISTERS


def q_quantization_reason(q: torch.Tensor, config: FP8AttentionConfig, causal: bool) -> str | None:
    """None when this kernel makes Q's codes itself from ``q (B, Hq, Sq, 128)`` (``QUANTIZE_Q``; a
    call in the kernel's scope), else why the quantization launch makes them (one short phrase)."""
    if not QUANTIZE_Q:
        return "QUANTIZE_Q off"
    if not (causal or QUANTIZE_Q_NONCAUSAL):
        return "not causal (QUANTIZE_Q_NONCAUSAL off)"
    if not config.hadamard:
        return "Q not rotated"
    if q.dtype not in (torch.bfloat16, torch.float16):
        return f"Q in {q.dtype} (the rotation's wgmma takes 16-bit inputs)"
    if q.stride(-1) != 1:
        return "Q's channels not contiguous"
    if cvt_mode() != 0:
        return "an fp8 conversion other than the PTX instruction's"
    if _runs_persistent() and forward_persistent.q_row_layout(q) is None:
        return "Q neither head-major nor token-major (the persistent kernel loads it by TMA)"
    return None


@functools.lru_cache(maxsize=None)
def _hadamard_descriptor(d: int, device: torch.device, dtype: torch.dtype) -> "TensorDescriptor":
    """TMA descriptor of the ``(d, d)`` ±1 Hadamard matrix in ``dtype`` (quantize.hadamard_operand,
    cached there, so the tensor outlives the descriptor), one box, in the default MMA layout."""
    h = hadamard_operand(d, device, dtype)
    layout = gl.NVMMASharedLayout.get_default_for([d, d], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)
    return TensorDescriptor(h, [d, d], [d, 1], [d, d], layout)


def scope_reason(shape_q: tuple, shape_k: tuple, mask: MaskSpec, config: FP8AttentionConfig,
                 mod_meta: dict) -> str | None:
    """None when the call is in the kernel's scope (any device), else why not (one short phrase).
    ``shape_q`` (B, Hq, Sq, D), ``shape_k`` (B, Hkv, Sk, D); ``mod_meta``: ``LogitMods.meta``."""
    reason = recipe_reason(shape_q, shape_k, mask, config, mod_meta)
    if reason is None and mod_meta.get("SINK"):
        reason = "attention sinks"
    if reason is None and config.block_k not in BLOCK_NS:
        reason = f"key tiles of {config.block_k} (built for {' and '.join(map(str, BLOCK_NS))})"
    return reason or shape_reason(shape_q, shape_k, mask, HEAD_DIMS, BLOCK_M, config.block_k)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, mask: MaskSpec, config: FP8AttentionConfig,
                       mod_meta: dict) -> str | None:
    """None when :func:`gluon_forward` runs this forward, else why not: :func:`scope_reason`, then
    the device (:func:`.gluon_hopper.device_reason`)."""
    return scope_reason(tuple(q.shape), tuple(k.shape), mask, config, mod_meta) or device_reason(q)


def gluon_forward(q_codes, q_scales, k_codes, k_scales, vt_codes, v_scales, out, lse, *, groups: int,
                  qk_scale: float, slack: float, causal: bool, q: torch.Tensor | None = None,
                  q_head_amax: torch.Tensor | None = None, pow2: bool = False, block_n: int = BLOCK_N) -> None:
    """Fill ``out`` (B, Hq, Sq, 128) (contiguous; with ``TOKEN_MAJOR_OUT`` any strides whose channels
    are contiguous) and ``lse`` (B, Hq, Sq) fp32 from the forward's FP8 copies (forward.py's
    ``triton_forward``):

    - ``q_codes`` (B, Hq, Sq, 128) e4m3 and ``q_scales`` (B, Hq, Sq) fp32: Q's rotated codes and
      scales (per token, or one per head repeated per token);
    - ``k_codes`` (B, Hkv, Sk, 128) e4m3 and ``k_scales`` (B, Hkv, Sk) fp32: K's, one per head;
    - ``vt_codes`` (B, Hkv, 128, Sk_pad) e4m3: V's channel-wise transposed codes, ``v_scales``
      (B, Hkv, n_tiles, 128) fp32 their channel scales (the sequence's, in tile 0).

    ``groups``: query heads per kv head; ``qk_scale``: softmax scale · log2 e (and the recipe's logit
    factor); ``slack``: forward.REF_SLACK.

    ``q`` (B, Hq, Sq, 128) bf16 / fp16, channels contiguous (:func:`q_quantization_reason`): the kernel
    makes Q's codes itself, ``q_codes`` and ``q_scales`` are not read (None); ``q_head_amax`` (B, Hq)
    fp32, the rotated Q's amax per (sequence, head) (the statistics launch's ``row_amax``), gives one
    scale per head, None one per token; ``pow2``: the recipe's power-of-two scales; ``block_n``: keys
    per tile, ``config.block_k`` (:data:`BLOCK_NS`)."""
    if block_n not in BLOCK_NS:
        raise ValueError(f"gluon_forward: key tiles of {block_n} (built for {' and '.join(map(str, BLOCK_NS))})")
    if PINGPONG and merged_mode() == 2:
        raise ValueError("gluon_forward: PINGPONG takes turns in the merged loop only, not with PV_UNDER_SCORES")
    b, hq, sq, d = (q_codes if q is None else q).shape
    sk = k_codes.shape[2]
    if out.stride(-1) != 1 or not (TOKEN_MAJOR_OUT or out.is_contiguous()):
        need = "contiguous in its channels" if TOKEN_MAJOR_OUT else "contiguous"
        raise ValueError(f"gluon_forward: O's buffer must be {need}, got strides {tuple(out.stride())}")
    if q is None:
        q_desc, h_desc, q_in = descriptor(q_codes.view(-1, d), (HALF_Q, d)), None, (q_scales, 0, 0, 0)
    else:
        if q.stride(-1) != 1:
            raise ValueError(f"gluon_forward: Q's channels must be contiguous, got strides {tuple(q.stride())}")
        q_desc, h_desc, q_in = None, _hadamard_descriptor(d, q.device, q.dtype), (q, *q.stride()[:3])
    descs = (q_desc, descriptor(k_codes.view(-1, d), (block_n, d)),
             descriptor(vt_codes.view(-1, vt_codes.shape[-1]), (d, block_n)))
    if _runs_persistent():
        forward_persistent.launch(descs, h_desc, q, q_head_amax, q_scales, k_scales, v_scales, out, lse, b=b, hq=hq,
                                  sq=sq, sk=sk, groups=groups, qk_scale=qk_scale, slack=slack, causal=causal,
                                  pow2=pow2, block_n=block_n)
        return
    q_amax = k_scales if q_head_amax is None else q_head_amax  # read only with one scale per head
    launch_kernel(_fwd_kernel, (sq // BLOCK_M, b * hq),
        *descs, h_desc, *q_in, q_amax, k_scales if q_scales is None else q_scales, k_scales, v_scales, out,
        *out.stride()[:3], lse, hq, groups, sq, sk, v_scales.shape[2],
        qk_scale, slack, Q_IN=q is not None, Q_HEAD=q_head_amax is not None, POW2=pow2,
        OUT_STRIDED=TOKEN_MAJOR_OUT, HALF_Q=HALF_Q, BLOCK_N=block_n, D=d, CAUSAL=causal,
        HEAD_GROUP=head_group(causal), Q_REGS=Q_IN_REGISTERS, MERGED=merged_mode(), PINGPONG=PINGPONG,
        STAGES=ring_stages(block_n),
        LOG2_PMAX=LOG2_PMAX, FMA_BOUND=fma_bound(), P_IN_PLACE=P_IN_PLACE, TREE=TREE_REDUCTIONS,
        CONSUMER_REGS=CONSUMER_REGS, PRODUCER_REGS=PRODUCER_REGS, num_warps=4, maxnreg=MAXNREG)


if gluon is not None:
    @gluon.jit
    def _rotated_q_codes(Q, q_row0, Q_SS, q0, h_smem, q_bar, codes_smem, QAMAX, sh, HALF_Q: gl.constexpr,
                         D: gl.constexpr, Q_HEAD: gl.constexpr, POW2: gl.constexpr, rows_s: gl.constexpr):
        """Queries q0 .. q0 + HALF_Q of one (batch, head) (``Q + q_row0``, a token every Q_SS): their
        codes into ``codes_smem`` (HALF_Q, D), ready for QKᵀ's wgmma, and their scales returned
        (HALF_Q,) in ``rows_s``, formed as the quantization launch forms its rotated row-wise copy
        (quantize._quantize_tile): y = xH in fp32 by a wgmma of the 16-bit inputs with the ±1
        matrix ``h_smem`` (in shared memory once ``q_bar`` completes), one scale per token from the
        row's amax or, Q_HEAD, the (sequence, head)'s from ``QAMAX[sh]``, then the codes of y / scale.
        The codes go to shared memory, not registers: as QKᵀ's register A operand they made each key
        tile's loop 22 instructions longer (487 -> 509, offline for sm_90a)."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        tokens = q0 + gl.arange(0, HALF_Q, layout=gl.SliceLayout(1, ld))
        chan = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        x = gl.load(Q + q_row0 + gl.expand_dims(tokens.to(gl.int64) * Q_SS, 1) + gl.expand_dims(chan, 0))
        rot: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        xa = gl.convert_layout(x, gl.DotOperandLayout(operand_index=0, parent=rot, k_width=2))
        mbarrier.wait(q_bar, 0)
        y = warpgroup_mma(xa, h_smem.permute((1, 0)), gl.zeros([HALF_Q, D], gl.float32, rot), use_acc=False,
                          is_async=True)
        y = warpgroup_mma_wait(num_outstanding=0, deps=(y, ))
        return _store_q_codes(y, codes_smem, QAMAX, sh, HALF_Q, Q_HEAD, POW2, rows_s)

    @gluon.jit
    def _store_q_codes(y, codes_smem, QAMAX, sh, HALF_Q: gl.constexpr, Q_HEAD: gl.constexpr, POW2: gl.constexpr,
                       rows_s: gl.constexpr):
        """The rotated Q ``y`` (HALF_Q, D) fp32 (a 16-bit wgmma's accumulator) into its codes in
        ``codes_smem``, ready for QKᵀ's wgmma: one scale per token from the row's amax or, Q_HEAD, the
        (sequence, head)'s from ``QAMAX[sh]``; the scales returned (HALF_Q,) in ``rows_s``."""
        if Q_HEAD:
            scale = gl.full([HALF_Q], 1.0, gl.float32, gl.SliceLayout(1, y.type.layout)) * scale_from_amax(
                gl.load(QAMAX + sh), POW2)
        else:
            scale = scale_from_amax(row_amax_nan(y), POW2)
        codes_smem.store(e4m3_codes(y, gl.expand_dims(scale, 1)))
        # Every thread's codes visible to the async proxy, then all four warps' stored, before the
        # warpgroup's wgmma reads them.
        fence_async_shared()
        thread_barrier()
        return gl.convert_layout(scale, rows_s)

    @gluon.jit
    def _tile_scores(x, t, l_i, m_i, r_i, queries, q2, slack_x, MASKED: gl.constexpr, BLOCK_N: gl.constexpr,
                     LOG2_PMAX: gl.constexpr, s_layout: gl.constexpr, pa_layout: gl.constexpr,
                     FMA_EXP: gl.constexpr, P_IN_PLACE: gl.constexpr, TREE: gl.constexpr, CODES: gl.constexpr):
        """Key tile t's scores ``x`` into (p, O's rescale factor γ per row, l, m, r): :func:`_softmax_tile`
        but for O's rescale (:func:`_rescale`), which the caller applies; p as P's codes in P·V's A
        operand (CODES) or in fp32 in S's layout (:func:`_consumer_tiles_pv_under` makes the codes)."""
        if MASKED:
            keys = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            x = gl.where(gl.expand_dims(queries, 1) >= gl.expand_dims(keys, 0), x, float("-inf"))
        m_t = row_reduce(x, "max", gl.SliceLayout(1, s_layout), TREE)
        m_new = gl.maximum(m_i, m_t)
        r_t = gl.maximum(m_t, m_new - slack_x)
        if MASKED:  # rows with no visible key so far keep every exponent finite
            r_ref = gl.where(r_t == float("-inf"), 0.0, r_t)
        else:
            r_ref = r_t
        if FMA_EXP:
            p = gl.exp2(x * gl.expand_dims(q2, 1) - gl.expand_dims(r_ref * q2 - LOG2_PMAX, 1))
        else:
            p = gl.exp2((x - gl.expand_dims(r_ref, 1)) * gl.expand_dims(q2, 1) + LOG2_PMAX)
        gamma = gl.exp2((r_i - r_ref) * q2)
        if TREE:  # l per lane, reduced across the row's lanes once after the last tile (_attend_rows)
            l_i = l_i * per_lane(gamma, l_i) + lane_partials(p, "sum")
        else:
            l_i = l_i * gamma + gl.sum(p, 1)
        if CODES:
            p = a_operand_codes(p, pa_layout, P_IN_PLACE)  # p <= 448: no clamp
        return p, gamma, l_i, m_new, r_t

    @gluon.jit
    def _rescale(acc, gamma):
        """O's accumulator ``acc`` with each row scaled by ``gamma`` (S's row layout): gamma's rows in
        O's accumulator are the same registers (both MMA layouts hold a row in one quad of lanes,
        whatever their N; at D = 128 the layouts are the same)."""
        gamma_o = gl.convert_layout(gamma, gl.SliceLayout(1, acc.type.layout), assert_trivial=True)
        return acc * gl.expand_dims(gamma_o, 1)

    @gluon.jit
    def _softmax_tile(x, t, acc, l_i, m_i, r_i, queries, q2, slack_x, MASKED: gl.constexpr, BLOCK_N: gl.constexpr,
                      LOG2_PMAX: gl.constexpr, s_layout: gl.constexpr, pa_layout: gl.constexpr,
                      FMA_EXP: gl.constexpr, P_IN_PLACE: gl.constexpr, TREE: gl.constexpr):
        """Key tile t's scores ``x`` into (P's codes as the A operand of P·V, acc rescaled, l, m, r):
        forward.py's ``_visit_tiles`` with K_HEAD and V_SEQ, the same fp32 operations per score, or,
        FMA_EXP, each exponent as one FMA from the log2 units (module docstring)."""
        p8, gamma, l_i, m_i, r_i = _tile_scores(x, t, l_i, m_i, r_i, queries, q2, slack_x, MASKED, BLOCK_N, LOG2_PMAX,
                                                s_layout, pa_layout, FMA_EXP, P_IN_PLACE, TREE, True)
        return p8, _rescale(acc, gamma), l_i, m_i, r_i

    @gluon.jit
    def _consumer_tiles(t_a, t_b, c0, acc, l_i, m_i, r_i, q_op, k_smem, vt_smem, ready, empty, queries, q2, slack_x,
                        MASKED: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, LOG2_PMAX: gl.constexpr,
                        s_layout: gl.constexpr, pa_layout: gl.constexpr, FMA_EXP: gl.constexpr,
                        P_IN_PLACE: gl.constexpr, TREE: gl.constexpr):
        """Key tiles t_a <= t < t_b into one warpgroup's running (acc, l, m, r), each tile's S waited
        for, then its P·V; tile t sits at position c0 + t of the ring's sequence of tiles (c0: the
        tiles of the program's earlier query blocks, 0 but in the persistent kernel)."""
        zero_s = gl.zeros([queries.shape[0], BLOCK_N], gl.float32, s_layout)
        for t in range(t_a, t_b):
            slot = (c0 + t) % STAGES
            mbarrier.wait(ready.index(slot), ((c0 + t) // STAGES) & 1)
            x = warpgroup_mma(q_op, k_smem.index(slot).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            x = warpgroup_mma_wait(num_outstanding=0, deps=(x, ))
            p8, acc, l_i, m_i, r_i = _softmax_tile(x, t, acc, l_i, m_i, r_i, queries, q2, slack_x, MASKED, BLOCK_N,
                                                   LOG2_PMAX, s_layout, pa_layout, FMA_EXP, P_IN_PLACE, TREE)
            acc = warpgroup_mma(p8, vt_smem.index(slot).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index(slot), count=1)
        return acc, l_i, m_i, r_i

    @gluon.jit
    def _take_turn(turn, i, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """Before a warpgroup's i-th issue of products: wait until the other one has issued its
        (i - 1)-th (warpgroup 1: until warpgroup 0 has issued its i-th)."""
        if PINGPONG:
            mbarrier.wait(turn.index(WG), i & 1)

    @gluon.jit
    def _pass_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
        """After a warpgroup's issue of products: the other warpgroup's turn."""
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG), count=1)

    @gluon.jit
    def _consumer_tiles_merged(t_hi, c0, acc, l_i, m_i, r_i, q_op, k_smem, vt_smem, ready, empty, turn, turn0, queries,
                               q2, slack_x, MASK_LAST: gl.constexpr, BLOCK_N: gl.constexpr,
                               STAGES: gl.constexpr, LOG2_PMAX: gl.constexpr, s_layout: gl.constexpr,
                               pa_layout: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr,
                               FMA_EXP: gl.constexpr, P_IN_PLACE: gl.constexpr, TREE: gl.constexpr):
        """Key tiles 0 <= t < t_hi (MASK_LAST: the last one masked) with one wait per tile: tile t's
        P·V and tile t+1's S are issued together and waited for together, so the tensor cores get
        both products of a warpgroup at once while the other warpgroup works on its scores.
        PINGPONG: the warpgroups' t_hi + 1 issues alternate (``turn``: one mbarrier per warpgroup;
        ``turn0``: this warpgroup's issues before these tiles, the persistent kernel's earlier blocks').
        Tile t sits at position c0 + t of the ring's sequence (:func:`_consumer_tiles`)."""
        zero_s = gl.zeros([queries.shape[0], BLOCK_N], gl.float32, s_layout)
        mbarrier.wait(ready.index(c0 % STAGES), (c0 // STAGES) & 1)
        _take_turn(turn, turn0, WG, PINGPONG)
        x = warpgroup_mma(q_op, k_smem.index(c0 % STAGES).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        _pass_turn(turn, WG, PINGPONG)
        x = warpgroup_mma_wait(num_outstanding=0, deps=(x, ))
        for t in range(0, t_hi - 1):
            p8, acc, l_i, m_i, r_i = _softmax_tile(x, t, acc, l_i, m_i, r_i, queries, q2, slack_x, False, BLOCK_N,
                                                   LOG2_PMAX, s_layout, pa_layout, FMA_EXP, P_IN_PLACE, TREE)
            _take_turn(turn, turn0 + t + 1, WG, PINGPONG)
            acc = warpgroup_mma(p8, vt_smem.index((c0 + t) % STAGES).permute((1, 0)), acc, is_async=True)
            nxt = (c0 + t + 1) % STAGES
            mbarrier.wait(ready.index(nxt), ((c0 + t + 1) // STAGES) & 1)
            x_next = warpgroup_mma(q_op, k_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True)
            _pass_turn(turn, WG, PINGPONG)
            acc, x = warpgroup_mma_wait(num_outstanding=0, deps=(acc, x_next))
            mbarrier.arrive(empty.index((c0 + t) % STAGES), count=1)
        last = t_hi - 1
        p8, acc, l_i, m_i, r_i = _softmax_tile(x, last, acc, l_i, m_i, r_i, queries, q2, slack_x, MASK_LAST, BLOCK_N,
                                               LOG2_PMAX, s_layout, pa_layout, FMA_EXP, P_IN_PLACE, TREE)
        _take_turn(turn, turn0 + t_hi, WG, PINGPONG)
        acc = warpgroup_mma(p8, vt_smem.index((c0 + last) % STAGES).permute((1, 0)), acc, is_async=True)
        _pass_turn(turn, WG, PINGPONG)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((c0 + last) % STAGES), count=1)
        return acc, l_i, m_i, r_i

    @gluon.jit
    def _pv_under_step(t, c0, acc, p, l_i, m_i, r_i, q_op, k_smem, vt_smem, ready, empty, queries, q2, slack_x,
                       MASKED: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, LOG2_PMAX: gl.constexpr,
                       s_layout: gl.constexpr, pa_layout: gl.constexpr, FMA_EXP: gl.constexpr,
                       P_IN_PLACE: gl.constexpr, TREE: gl.constexpr):
        """One step of :func:`_consumer_tiles_pv_under`: tile t's codes from its p (fp32), tile t + 1's S
        issued, then tile t's P·V, S waited for alone, tile t + 1's scores worked on while P·V runs,
        then P·V waited for, slot t released and O rescaled for tile t + 1; returns tile t + 1's p.
        p crosses the loop in fp32, in the registers S's accumulator gave it: carried as FP8 codes the
        loop moved them byte by byte (208 more instructions a tile offline)."""
        zero_s = gl.zeros([queries.shape[0], BLOCK_N], gl.float32, s_layout)
        p8 = a_operand_codes(p, pa_layout, P_IN_PLACE)  # p <= 448: no clamp
        nxt = (c0 + t + 1) % STAGES
        mbarrier.wait(ready.index(nxt), ((c0 + t + 1) // STAGES) & 1)
        x = warpgroup_mma(q_op, k_smem.index(nxt).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma(p8, vt_smem.index((c0 + t) % STAGES).permute((1, 0)), acc, is_async=True)
        x = warpgroup_mma_wait(num_outstanding=1, deps=(x, ))  # wgmma groups complete in issue order
        p, gamma, l_i, m_i, r_i = _tile_scores(x, t + 1, l_i, m_i, r_i, queries, q2, slack_x, MASKED, BLOCK_N,
                                               LOG2_PMAX, s_layout, pa_layout, FMA_EXP, P_IN_PLACE, TREE, False)
        # Without a fence ptxas issues the P·V's wait right after S's, before the exponentials (one
        # fence: on a scalar).
        cta_fence(nxt)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((c0 + t) % STAGES), count=1)
        return _rescale(acc, gamma), p, l_i, m_i, r_i

    @gluon.jit
    def _consumer_tiles_pv_under(t_hi, c0, acc, l_i, m_i, r_i, q_op, k_smem, vt_smem, ready, empty, queries, q2,
                                 slack_x, MASK_LAST: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                 LOG2_PMAX: gl.constexpr, s_layout: gl.constexpr, pa_layout: gl.constexpr,
                                 FMA_EXP: gl.constexpr, P_IN_PLACE: gl.constexpr, TREE: gl.constexpr):
        """Key tiles 0 <= t < t_hi (MASK_LAST: the last one masked) in FlashAttention-3's order within
        a warpgroup (``PV_UNDER_SCORES``): tile t + 1's S issued before tile t's P·V and waited for
        alone, so that tile t + 1's exponentials run under tile t's P·V; O's rescale for tile t + 1
        waits for that P·V. The same operations on the same values as :func:`_consumer_tiles_merged`,
        so the same bits. Tile t sits at position c0 + t of the ring's sequence."""
        zero_s = gl.zeros([queries.shape[0], BLOCK_N], gl.float32, s_layout)
        mbarrier.wait(ready.index(c0 % STAGES), (c0 // STAGES) & 1)
        x = warpgroup_mma(q_op, k_smem.index(c0 % STAGES).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        x = warpgroup_mma_wait(num_outstanding=0, deps=(x, ))
        if MASK_LAST and t_hi == 1:  # tile 0 is the last one
            p, gamma, l_i, m_i, r_i = _tile_scores(x, 0, l_i, m_i, r_i, queries, q2, slack_x, True, BLOCK_N, LOG2_PMAX,
                                                   s_layout, pa_layout, FMA_EXP, P_IN_PLACE, TREE, False)
        else:
            p, gamma, l_i, m_i, r_i = _tile_scores(x, 0, l_i, m_i, r_i, queries, q2, slack_x, False, BLOCK_N, LOG2_PMAX,
                                                   s_layout, pa_layout, FMA_EXP, P_IN_PLACE, TREE, False)
        acc = _rescale(acc, gamma)
        for t in range(0, t_hi - 2):
            acc, p, l_i, m_i, r_i = _pv_under_step(t, c0, acc, p, l_i, m_i, r_i, q_op, k_smem, vt_smem, ready, empty,
                                                   queries, q2, slack_x, False, BLOCK_N, STAGES, LOG2_PMAX, s_layout,
                                                   pa_layout, FMA_EXP, P_IN_PLACE, TREE)
        if t_hi > 1:  # the last tile's scores, masked where MASK_LAST
            acc, p, l_i, m_i, r_i = _pv_under_step(t_hi - 2, c0, acc, p, l_i, m_i, r_i, q_op, k_smem, vt_smem, ready,
                                                   empty, queries, q2, slack_x, MASK_LAST, BLOCK_N, STAGES, LOG2_PMAX,
                                                   s_layout, pa_layout, FMA_EXP, P_IN_PLACE, TREE)
        last = t_hi - 1
        p8 = a_operand_codes(p, pa_layout, P_IN_PLACE)
        acc = warpgroup_mma(p8, vt_smem.index((c0 + last) % STAGES).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index((c0 + last) % STAGES), count=1)
        return acc, l_i, m_i, r_i

    @gluon.jit
    def _consumer_loop(t_hi, c0, acc, l_i, m_i, r_i, q_op, k_smem, vt_smem, ready, empty, turn, turn0, queries, q2,
                       slack_x, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, MERGED: gl.constexpr,
                       PINGPONG: gl.constexpr, STAGES: gl.constexpr, LOG2_PMAX: gl.constexpr, s_layout: gl.constexpr,
                       pa_layout: gl.constexpr, WG: gl.constexpr, FMA_EXP: gl.constexpr, P_IN_PLACE: gl.constexpr,
                       TREE: gl.constexpr):
        """Key tiles 0 <= t < t_hi (at ring positions c0 + t) into one warpgroup's running (acc, l, m,
        r), in the schedule MERGED picks (:func:`merged_mode`; causal: the last tile, the program's
        diagonal one, masked)."""
        if MERGED == 2:
            acc, l_i, m_i, r_i = _consumer_tiles_pv_under(t_hi, c0, acc, l_i, m_i, r_i, q_op, k_smem, vt_smem, ready,
                                                          empty, queries, q2, slack_x, CAUSAL, BLOCK_N, STAGES,
                                                          LOG2_PMAX, s_layout, pa_layout, FMA_EXP, P_IN_PLACE, TREE)
        elif MERGED:
            acc, l_i, m_i, r_i = _consumer_tiles_merged(t_hi, c0, acc, l_i, m_i, r_i, q_op, k_smem, vt_smem, ready,
                                                        empty, turn, turn0, queries, q2, slack_x, CAUSAL, BLOCK_N,
                                                        STAGES, LOG2_PMAX, s_layout, pa_layout, WG, PINGPONG,
                                                        FMA_EXP, P_IN_PLACE, TREE)
        elif CAUSAL:
            acc, l_i, m_i, r_i = _consumer_tiles(0, t_hi - 1, c0, acc, l_i, m_i, r_i, q_op, k_smem, vt_smem, ready,
                                                 empty, queries, q2, slack_x, False, BLOCK_N, STAGES, LOG2_PMAX,
                                                 s_layout, pa_layout, FMA_EXP, P_IN_PLACE, TREE)
            acc, l_i, m_i, r_i = _consumer_tiles(t_hi - 1, t_hi, c0, acc, l_i, m_i, r_i, q_op, k_smem, vt_smem, ready,
                                                 empty, queries, q2, slack_x, True, BLOCK_N, STAGES, LOG2_PMAX,
                                                 s_layout, pa_layout, FMA_EXP, P_IN_PLACE, TREE)
        else:
            acc, l_i, m_i, r_i = _consumer_tiles(0, t_hi, c0, acc, l_i, m_i, r_i, q_op, k_smem, vt_smem, ready, empty,
                                                 queries, q2, slack_x, False, BLOCK_N, STAGES, LOG2_PMAX, s_layout,
                                                 pa_layout, FMA_EXP, P_IN_PLACE, TREE)
        return acc, l_i, m_i, r_i

    @gluon.jit
    def _consumer(q_smem, h_smem, k_smem, vt_smem, q_bar, ready, empty, turn, Q, q_row0, Q_SS, QAMAX, QS, KS, VS, OUT,
                  out_row0, OUT_SS, LSE, bh_q, bh_k, SQ, SK, NT_K, m0, t_hi, qk_scale, slack, Q_IN: gl.constexpr,
                  Q_HEAD: gl.constexpr, POW2: gl.constexpr, OUT_STRIDED: gl.constexpr, WG: gl.constexpr,
                  HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                  Q_REGS: gl.constexpr, MERGED: gl.constexpr, PINGPONG: gl.constexpr, STAGES: gl.constexpr,
                  LOG2_PMAX: gl.constexpr, FMA_BOUND: gl.constexpr, P_IN_PLACE: gl.constexpr, TREE: gl.constexpr):
        """One warpgroup: queries m0 + WG·64 .. + 64 of the program; writes their O and LSE. Q_IN: it
        makes their codes from the input Q into its half of ``q_smem`` (:func:`_rotated_q_codes`), else
        they come there by TMA (``h_smem`` unused)."""
        s_layout: gl.constexpr = mma_layout(BLOCK_N)
        qa_layout: gl.constexpr = a_operand_layout(s_layout)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        q0 = m0 + WG * HALF_Q
        queries = q0 + gl.arange(0, HALF_Q, layout=rows_s)
        # forward.py's row factor: Q's scale · qk_scale, then K's one scale of the (sequence, head).
        if Q_IN:
            q_scale = _rotated_q_codes(Q, q_row0, Q_SS, q0, h_smem, q_bar, q_smem.index(WG), QAMAX, bh_q, HALF_Q, D,
                                       Q_HEAD, POW2, rows_s)
            q2 = (q_scale * qk_scale) * gl.load(KS + bh_k * SK)
            q_op = q_smem.index(WG)
        else:
            q2 = (gl.load(QS + bh_q * SQ + queries) * qk_scale) * gl.load(KS + bh_k * SK)
            mbarrier.wait(q_bar, 0)
            if Q_REGS:
                q_op = q_smem.index(WG).load(qa_layout)
            else:  # the MMA reads Q where TMA put it (never overwritten)
                q_op = q_smem.index(WG)
        if MERGED and PINGPONG and WG == 1:  # warpgroup 0 issues first
            mbarrier.arrive(turn.index(0), count=1)
        _attend_rows(q_op, q2, q0, 0, t_hi, k_smem, vt_smem, ready, empty, turn, 0, VS, OUT, out_row0, OUT_SS, LSE,
                     bh_q, bh_k, SQ, NT_K, slack, OUT_STRIDED, WG, HALF_Q, BLOCK_N, D, CAUSAL, MERGED, PINGPONG, STAGES,
                     LOG2_PMAX, FMA_BOUND, P_IN_PLACE, TREE)

    @gluon.jit
    def _attend_rows(q_op, q2, q0, c0, t_hi, k_smem, vt_smem, ready, empty, turn, turn0, VS, OUT, out_row0, OUT_SS,
                     LSE, bh_q, bh_k, SQ, NT_K, slack, OUT_STRIDED: gl.constexpr, WG: gl.constexpr,
                     HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
                     MERGED: gl.constexpr, PINGPONG: gl.constexpr, STAGES: gl.constexpr, LOG2_PMAX: gl.constexpr,
                     FMA_BOUND: gl.constexpr, P_IN_PLACE: gl.constexpr, TREE: gl.constexpr):
        """A warpgroup's 64 queries q0 .. q0 + 64 of (batch · query head) ``bh_q``, their codes ``q_op``
        (shared memory or registers) and row factors ``q2`` (HALF_Q,) set: key tiles 0 <= t < t_hi (at
        ring positions c0 + t) into their O (scaled by the sequence's channel scales of V) and LSE,
        written to ``OUT`` and ``LSE``; ``turn``, ``turn0``: the ping-pong's (:func:`_consumer_tiles_merged`)."""
        s_layout: gl.constexpr = mma_layout(BLOCK_N)
        o_layout: gl.constexpr = mma_layout(D)
        pa_layout: gl.constexpr = a_operand_layout(o_layout)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        queries = q0 + gl.arange(0, HALF_Q, layout=rows_s)
        slack_x = slack / q2
        acc = gl.zeros([HALF_Q, D], gl.float32, o_layout)
        if TREE:  # l's partial sums per lane (_softmax_tile)
            l_i = lane_partials(gl.zeros([HALF_Q, BLOCK_N], gl.float32, s_layout), "sum")
        else:
            l_i = gl.zeros([HALF_Q], gl.float32, rows_s)
        m_i = gl.full([HALF_Q], float("-inf"), gl.float32, rows_s)
        r_i = gl.full([HALF_Q], float("-inf"), gl.float32, rows_s)
        fma = False  # FMA_BOUND 0: the exact form, and the FMA loop is not compiled
        if FMA_BOUND > 0.0:
            # |x| <= D·448² (a sum of D products of codes), and r is an x or m − slack/q2, so every
            # row's |r·q2 − log2 448| stays under this warpgroup's bound; below FMA_BOUND the one-FMA
            # exponent's rounding of it moves p by under 2^-24·FMA_BOUND·ln 2 relative. One decision
            # for the warpgroup (its MMAs are warpgroup-wide); huge factors take the exact form (NaN
            # propagates through either).
            fma = gl.max(q2, 0) * (D * 448.0 * 448.0) + slack + LOG2_PMAX < FMA_BOUND  # exponent.fma_row_bound
        if fma:
            acc, l_i, m_i, r_i = _consumer_loop(t_hi, c0, acc, l_i, m_i, r_i, q_op, k_smem, vt_smem, ready, empty,
                                                turn, turn0, queries, q2, slack_x, BLOCK_N, CAUSAL, MERGED, PINGPONG,
                                                STAGES, LOG2_PMAX, s_layout, pa_layout, WG, True, P_IN_PLACE, TREE)
        else:
            acc, l_i, m_i, r_i = _consumer_loop(t_hi, c0, acc, l_i, m_i, r_i, q_op, k_smem, vt_smem, ready, empty,
                                                turn, turn0, queries, q2, slack_x, BLOCK_N, CAUSAL, MERGED, PINGPONG,
                                                STAGES, LOG2_PMAX, s_layout, pa_layout, WG, False, P_IN_PLACE, TREE)
        if TREE:
            l_i = lanes_to_rows(l_i, "sum", rows_s)
        chan = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        acc = acc * gl.expand_dims(gl.load(VS + bh_k * NT_K * D + chan), 0)  # the sequence's channel scales, once
        empty_row = l_i == 0.0  # no visible key: O = 0, LSE = -inf (NaN rows keep NaN)
        l_o = gl.convert_layout(gl.where(empty_row, 1.0, l_i), gl.SliceLayout(1, o_layout))
        out = acc / gl.expand_dims(l_o, 1)
        if FMA_BOUND > 0.0:  # the FMA form's l counts p relative to its rounded r·q2 − log2 448
            log2_l = gl.log2(gl.where(empty_row, 1.0, l_i))
            # The exact form's r·q2 rounded by itself, as the switch-off kernel computes it (its
            # product sits in another block than the add); contracted here, the exact fallback's LSE
            # differed from it.
            exact = mul_rn(r_i, q2) + log2_l - LOG2_PMAX
            lse2 = gl.where(fma, (r_i * q2 - LOG2_PMAX) + log2_l, exact)
            lse = gl.where(empty_row, float("-inf"), lse2 * 0.6931471805599453)
        else:
            lse = gl.where(empty_row, float("-inf"),
                           (r_i * q2 + gl.log2(gl.where(empty_row, 1.0, l_i)) - LOG2_PMAX) * 0.6931471805599453)
        if OUT_STRIDED:  # out_row0: the (batch, head)'s first row; OUT_SS: the stride of a token
            tokens = gl.expand_dims(q0 + gl.arange(0, HALF_Q, layout=gl.SliceLayout(1, o_layout)), 1)
            gl.store(OUT + out_row0 + tokens.to(gl.int64) * OUT_SS + gl.expand_dims(chan, 0),
                     out.to(OUT.dtype.element_ty))
        else:
            rows = gl.expand_dims(bh_q * SQ + q0 + gl.arange(0, HALF_Q, layout=gl.SliceLayout(1, o_layout)), 1)
            gl.store(OUT + rows.to(gl.int64) * D + gl.expand_dims(chan, 0), out.to(OUT.dtype.element_ty))
        gl.store(LSE + bh_q * SQ + queries, lse)

    @gluon.jit
    def _fwd_kernel(
        q_desc,  # Q's codes: (B·Hq·Sq, D), boxes (HALF_Q, D); None with Q_IN
        k_desc,  # K's codes: (B·Hkv·Sk, D), boxes (BLOCK_N, D)
        vt_desc,  # V's channel-wise transposed codes: (B·Hkv·D, Sk_pad), boxes (D, BLOCK_N)
        h_desc,  # Q_IN: the (D, D) 16-bit ±1 Hadamard matrix, one box; else None
        Q, Q_SB, Q_SH, Q_SS,  # Q_IN: the input Q (B, Hq, Sq, D) and its strides (D's 1); else unused
        QAMAX,  # Q_HEAD: (B, Hq) fp32, the rotated Q's amax per (sequence, head)
        QS, KS,  # (B, H, S) fp32 row scales, one value per head (QS unused with Q_IN)
        VS,  # (B, Hkv, NT_K, D) fp32 channel scales, the sequence's in tile 0
        OUT,  # (B, Hq, Sq, D) in the input dtype: contiguous, or (OUT_STRIDED) with these strides, D's 1
        OUT_SB, OUT_SH, OUT_SS,
        LSE,  # (B, Hq, Sq) fp32
        H, G, SQ, SK, NT_K, qk_scale, slack,
        Q_IN: gl.constexpr, Q_HEAD: gl.constexpr, POW2: gl.constexpr,
        OUT_STRIDED: gl.constexpr, HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, CAUSAL: gl.constexpr,
        HEAD_GROUP: gl.constexpr,
        Q_REGS: gl.constexpr, MERGED: gl.constexpr, PINGPONG: gl.constexpr, STAGES: gl.constexpr,
        LOG2_PMAX: gl.constexpr,
        FMA_BOUND: gl.constexpr,
        P_IN_PLACE: gl.constexpr,
        TREE: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        PRODUCER_REGS: gl.constexpr,
    ):
        bh_q, bh_k, m0, t_hi = query_block(H, G, SK, 2 * HALF_Q, BLOCK_N, CAUSAL, HEAD_GROUP)
        if OUT_STRIDED:
            out_row0 = (bh_q // H).to(gl.int64) * OUT_SB + (bh_q % H).to(gl.int64) * OUT_SH
        else:  # unused
            out_row0 = 0

        if Q_IN:  # the Hadamard matrix, and Q's codes as each consumer warpgroup writes them
            h_smem = gl.allocate_shared_memory(h_desc.dtype, h_desc.block_type.shape, h_desc.layout)
            q_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, HALF_Q, D],
                                               gl.NVMMASharedLayout.get_default_for([HALF_Q, D], gl.float8e4nv))
            q_row0 = (bh_q // H).to(gl.int64) * Q_SB + (bh_q % H).to(gl.int64) * Q_SH
        else:
            q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
            h_smem = q_smem  # unused: a placeholder of the same kind
            q_row0 = 0
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        vt_smem = gl.allocate_shared_memory(vt_desc.dtype, [STAGES] + vt_desc.block_type.shape, vt_desc.layout)
        q_bar, ready, empty = ring_barriers(STAGES, 1)
        if PINGPONG and MERGED:  # one turn barrier per consumer warpgroup (only the merged loop takes turns)
            turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            for w in gl.static_range(2):
                mbarrier.init(turn.index(w), count=1)
        else:  # unused: a placeholder of the same kind (a partition's arguments cannot be None)
            turn = ready

        gl.warp_specialize([
            (_consumer, (q_smem, h_smem, k_smem, vt_smem, q_bar, ready, empty, turn, Q, q_row0, Q_SS, QAMAX, QS, KS,
                         VS, OUT, out_row0, OUT_SS, LSE, bh_q, bh_k, SQ, SK, NT_K, m0, t_hi, qk_scale, slack, Q_IN,
                         Q_HEAD, POW2, OUT_STRIDED, 0, HALF_Q, BLOCK_N, D, CAUSAL, Q_REGS, MERGED, PINGPONG, STAGES,
                         LOG2_PMAX, FMA_BOUND, P_IN_PLACE, TREE)),
            (_consumer, (q_smem, h_smem, k_smem, vt_smem, q_bar, ready, empty, turn, Q, q_row0, Q_SS, QAMAX, QS, KS,
                         VS, OUT, out_row0, OUT_SS, LSE, bh_q, bh_k, SQ, SK, NT_K, m0, t_hi, qk_scale, slack, Q_IN,
                         Q_HEAD, POW2, OUT_STRIDED, 1, HALF_Q, BLOCK_N, D, CAUSAL, Q_REGS, MERGED, PINGPONG, STAGES,
                         LOG2_PMAX, FMA_BOUND, P_IN_PLACE, TREE)),
            (query_side_producer, (q_desc, None, k_desc, None, vt_desc, q_smem, None, k_smem, None, vt_smem, q_bar,
                                   ready, empty, bh_q * SQ + m0, bh_k * SK, bh_k * D, t_hi, HALF_Q, BLOCK_N, STAGES,
                                   h_desc, h_smem)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


from . import forward_persistent  # noqa: E402

__all__ = ["BLOCK_M", "BLOCK_N", "BLOCK_NS", "HEAD_DIMS", "LAYOUTS", "LAYOUT_CONSTANTS", "MERGED_WAITS", "PERSISTENT",
           "PINGPONG", "PV_UNDER_SCORES", "QUANTIZE_Q", "QUANTIZE_Q_NONCAUSAL", "Q_IN_REGISTERS", "STAGES",
           "STAGES_256", "gluon_forward", "merged_mode", "q_quantization_reason", "ring_stages", "scope_reason",
           "unsupported_reason"]
