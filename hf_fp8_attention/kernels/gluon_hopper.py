"""What the warp-specialised Gluon kernels for Hopper share (forward_gluon.py, backward_stats_gluon.py,
backward_dq_gluon.py, backward_dkdv_gluon.py): Gluon's imports, the recipe, shape and device checks
and the choice between a Gluon kernel and its Triton launch,
FP8 TMA descriptors, the scale rule of :func:`.quantize.scale_from_amax` in Gluon, the programs'
ring barriers, the consumers' register layouts, the causal programs' dispatch order, and the
query-side programs' (forward, dQ, statistics) grid mapping and producer warp, per block and in the
persistent kernels (a program over a schedule of blocks, :mod:`.persistent_schedule`).

The kernels run the block-free recipes (``fp8_delta``, ``fp8_stale`` and their fast twins: one
scale per (sequence, head) for K and V, per token or per (sequence, head) for Q and dO, channel
scales per sequence, P on the fixed grid, dS one scale per query head) on dense batches, and compute
what the Triton launches they replace compute, from the same FP8 copies, statistics and scales.
"""
from __future__ import annotations

import functools
import logging

import torch

from ..config import FP8AttentionConfig, FP8Format, Granularity
from ..masking import MaskSpec
from .operands import block_shared_fields
from .quantize import E4M3_CVT_ASM, interpreting

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.experimental.gluon import constexpr_function
except (ImportError, AttributeError):
    gluon = gl = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = constexpr_function = None
    fence_async_shared = None


logger = logging.getLogger(__name__)

# Causal programs are dispatched longest first across HEAD_GROUP rows of the grid (batch · head) at a
# time, not one row after the other. The kernels run one program per SM, and GPUs start programs in
# the order of their linear index (axis 0 fastest): with rows one after the other, the last row's
# longest programs start near the end and set the tail. A list-scheduling model over 132 SMs puts
# that tail at +24% of the ideal time at 8k tokens, B = 1 and 8 kv heads (the dK/dV launch), +12% with
# 16 heads and +6% at B = 2, against under +1.5% with rows taken four at a time; four at a time keeps
# the operands read concurrently to four rows' (L2), where all rows at once slowed the forward at
# 16k tokens (benchmarks/NOTES.md, "Backward"). 1 is the order of rows one after the other.
DISPATCH = {"head_group": 4}


def head_group(causal: bool) -> int:
    """The HEAD_GROUP constexpr of a launch: ``DISPATCH["head_group"]`` for causal programs (whose
    lengths differ); 1 otherwise, where every program is as long as the others."""
    return int(DISPATCH["head_group"]) if causal else 1


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def recipe_reason(shape_q: tuple, shape_k: tuple, mask: MaskSpec, config: FP8AttentionConfig,
                  mod_meta: dict) -> str | None:
    """None when the call is one the Gluon kernels are written for (recipe, formats, logit
    modifiers, dense batch, 32-bit TMA coordinates), else why not (one short phrase). ``shape_q``
    (B, Hq, Sq, D), ``shape_k`` (B, Hkv, Sk, D); ``mod_meta``: ``LogitMods.meta``'s constexprs."""
    # K and V per head (the kernels load no per-token K/V scales), and a block-free backward.
    per_tile = [] if config.kv_scales is Granularity.HEAD else [f"kv_scales={config.kv_scales.value!r}"]
    per_tile += block_shared_fields(config)
    if per_tile:
        return f"a recipe with {', '.join(per_tile)}"
    if any(f is not FP8Format.E4M3 for f in (config.q_format, config.k_format, config.v_format, config.do_format,
                                            config.ds_format)):
        return "a format other than E4M3"
    if mod_meta.get("SOFTCAP") or mod_meta.get("ROW_SHIFT"):
        return "soft-capping or a row constant"
    if mask.is_varlen or mask.window is not None:
        return "packed sequences or a sliding window"
    b, hq, sq, d = shape_q
    hkv, sk = shape_k[1], shape_k[2]
    if b * hq * max(sq, d) >= 2**31 or b * hkv * max(sk, d) >= 2**31:
        return "more rows than TMA's int32 coordinates address"
    return None


def shape_reason(shape_q: tuple, shape_k: tuple, mask: MaskSpec, head_dims: tuple, q_multiple: int,
                 k_multiple: int) -> str | None:
    """None when a kernel built for ``head_dims``, whole tiles of ``q_multiple`` queries and
    ``k_multiple`` keys, and a causal mask only on square problems takes these shapes, else why not."""
    sq, d, sk = shape_q[2], shape_q[3], shape_k[2]
    if d not in head_dims:
        return f"head dim {d} (built for {', '.join(map(str, head_dims))})"
    if sq == 0 or sk == 0 or sq % q_multiple or sk % k_multiple:
        return f"sequence lengths {sq} / {sk} (need multiples of {q_multiple} / {k_multiple})"
    if mask.causal and sq != sk:
        return "causal with fewer queries than keys"
    return None


def device_reason(q: torch.Tensor) -> str | None:
    """None on a Hopper GPU with Gluon (not the interpreter), else why not."""
    if gluon is None:
        return "Triton without Gluon"
    if interpreting() or not q.is_cuda:
        return "not on a CUDA device"
    if _capability(q.device.index) != (9, 0):
        return "not a Hopper (sm_90) GPU"
    return None


def gluon_runs(module, head_dims: tuple, q: torch.Tensor, k: torch.Tensor, mask: MaskSpec,
               config: FP8AttentionConfig, mod_meta: dict, caller: str) -> bool:
    """Whether ``module``'s Gluon kernel (forward_gluon, backward_stats_gluon, backward_dq_gluon or
    backward_dkdv_gluon) does this call's work: enabled at ``head_dims`` and, by its
    ``unsupported_reason``, in scope here. It computes what the Triton launch it replaces computes,
    so elsewhere that launch runs, and the reason is logged once per ``caller`` (debug level:
    nothing is lost)."""
    if q.shape[-1] not in head_dims:
        return False
    reason = module.unsupported_reason(q, k, mask, config, mod_meta)
    if reason is not None:
        _note_triton_launch(caller, reason)
    return reason is None


@functools.lru_cache(maxsize=None)
def _note_triton_launch(caller: str, reason: str) -> None:
    logger.debug("%s: the Triton launch, not the Gluon kernel: %s", caller, reason)


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, int]):
    """The default MMA shared layout of an FP8 box (cached: built on every call otherwise)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.float8e4nv)


def descriptor(codes_2d: torch.Tensor, block: tuple[int, int]) -> "TensorDescriptor":
    """TMA descriptor of a 2-D view of FP8 codes, ``block``-shaped boxes in the default MMA layout."""
    return TensorDescriptor(codes_2d, list(codes_2d.shape), list(codes_2d.stride()), list(block), _smem_layout(block))


if gluon is not None:
    import triton.language as tl  # Gluon's maximum takes Triton's PropagateNan
    # The TMA load was renamed between Triton 3.6 (async_copy_global_to_shared) and 3.7 (async_load).
    tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    # The barrier of a CTA's (or, in a warp-specialised partition, the partition's) threads: renamed
    # between Triton 3.6 (thread_barrier) and 3.9 (barrier).
    thread_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
    E4M3_CVT = gl.constexpr(E4M3_CVT_ASM)  # quantize.fp8_cast's instruction, readable from Gluon code

    @constexpr_function
    def mma_layout(n):
        """The register layout of a warpgroup's (64, ``n``) wgmma accumulator: its 4 warps along the
        rows, m64nNk32 instructions (FP8 operands)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, n, 32])

    @constexpr_function
    def a_operand_layout(parent):
        """The register layout of an FP8 wgmma A operand whose product accumulates in ``parent``."""
        return gl.DotOperandLayout(operand_index=0, parent=parent, k_width=4)

    @gluon.jit
    def a_operand_in_place(x8, a_layout: gl.constexpr):
        """FP8 codes ``x8`` (64, N) in a wgmma accumulator's layout (:func:`mma_layout`; N a multiple
        of 16) as the A operand of a product in ``a_layout`` (:func:`a_operand_layout`), no code
        leaving its thread: the column 4q + 2i + b of each aligned 16 takes the accumulator's column
        8i + 2q + b (q: a thread's place in its quad), so the product's other operand must hold its
        contracted tokens in that order (``quantize.pv_token_order``, ``Copies.col_pv``). The plain
        layout change moves the codes through 16 shuffles, 16 selects and 16 byte permutes per
        thread and (64, 128) tile."""
        rows: gl.constexpr = x8.shape[0]
        cols: gl.constexpr = x8.shape[1]
        x8 = gl.reshape(x8, [rows, cols // 16, 2, 4, 2])  # column 16·g + 8i + 2q + b
        x8 = gl.reshape(gl.permute(x8, (0, 1, 3, 2, 4)), [rows, cols])  # -> 16·g + 4q + 2i + b
        return gl.convert_layout(x8, a_layout)

    @gluon.jit
    def cta_fence(x):
        """``x`` unchanged, behind a CTA-scope fence (``fence.acq_rel.cta``: a MEMBAR.ALL.CTA per element
        a thread holds of ``x``, one for a scalar). ptxas issues a wgmma wait placed after the fence no
        earlier than the fence, where without it the wait goes right after the previous one, before
        the work between them (benchmarks/experiments/wgmma_wait_probe.py)."""
        return gl.inline_asm_elementwise("fence.acq_rel.cta;\n\tmov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype,
                                         is_pure=False, pack=1)

    @gluon.jit
    def a_operand_codes(x, a_layout: gl.constexpr, IN_PLACE: gl.constexpr):
        """E4M3 codes of ``x`` (64, N) fp32 in a wgmma accumulator's layout (cvt.rn.satfinite, as
        quantize.cast_saturating) as the A operand of a product in ``a_layout``: in place
        (IN_PLACE, :func:`a_operand_in_place`: the other operand holds its contracted tokens in
        that order) or moved to the layout."""
        x8 = x.to(gl.float8e4nv)
        if IN_PLACE:
            return a_operand_in_place(x8, a_layout)
        else:
            return gl.convert_layout(x8, a_layout)

    @gluon.jit
    def scale_from_amax(amax, POW2: gl.constexpr):
        """quantize.scale_from_amax for E4M3 (FMAX 448) in Gluon: amax / 448 floored at 2^-126
        (NaN kept), pow2: rounded up through the bits; 1 where amax == 0."""
        scale = gl.div_rn(amax, 448.0)
        scale = gl.where(scale < 1.1754943508222875e-38, 1.1754943508222875e-38, scale)
        if POW2:
            bits = scale.to(gl.int32, bitcast=True)
            expo = bits & 0x7F800000
            up = gl.where((bits & 0x007FFFFF) != 0, expo + 0x00800000, expo)
            scale = gl.where(scale < float("inf"), up.to(gl.float32, bitcast=True), scale)
        return gl.where(amax == 0.0, 1.0, scale)

    @gluon.jit
    def divide_by_scale(x, scale):
        """quantize.divide_by_scale in Gluon (its GPU form, bit for bit): ``x / scale`` as IEEE division
        for ``x`` fp32 and its block scales ``scale`` broadcast to it (normal, +inf or NaN), quotients
        below 2^-64 a zero of x's sign."""
        x, scale = gl.broadcast(x, scale)
        bits = scale.to(gl.int32, bitcast=True)
        expo = (bits >> 23) & 0xFF
        finite = expo < 255
        m = ((bits & 0x007FFFFF) | 0x3F800000).to(gl.float32, bitcast=True)  # scale's mantissa, [1, 2)
        pre = gl.where(finite, ((254 - expo) << 23).to(gl.float32, bitcast=True), float("nan"))
        y = gl.div_rn(gl.full(m.shape, 1.0, gl.float32, m.type.layout), m)
        neg_m = -m
        other = gl.where(scale != scale, float("nan"), 0.0)
        xs = x * pre
        q = xs * y
        q = gl.fma(gl.fma(q, neg_m, xs), y, q)
        q = gl.fma(gl.fma(q, neg_m, xs), y, q)
        return gl.where(gl.abs(xs) >= 5.421010862427522e-20, q, x * other)  # 2^-64, quantize._DIV_TINY

    @gluon.jit
    def e4m3_codes(x, scale):
        """quantize.to_fp8 for E4M3 on the GPU (CVT 0) in Gluon: the codes of ``x / scale`` (IEEE
        division, :func:`divide_by_scale`), clamped to ±448 with NaN kept, rounded once to nearest
        even by ``cvt.rn.satfinite.e4m3x2.f32``."""
        y = divide_by_scale(x, scale)
        y = gl.where(y > 448.0, 448.0, gl.where(y < -448.0, -448.0, y))  # NaN fails both: kept
        return gl.inline_asm_elementwise(E4M3_CVT, "=r,r,r,r,r", [y], dtype=gl.uint8, is_pure=True,
                                         pack=4).to(gl.float8e4nv, bitcast=True)

    @gluon.jit
    def row_amax_nan(x):
        """max over each row of |x (R, C)|, NaN where the row holds one (as quantize.abs_max)."""
        amax = gl.max(gl.abs(x), 1)
        return gl.where(gl.sum((x != x).to(gl.int32), 1) > 0, float("nan"), amax)

    @gluon.jit
    def _max_nan_combine(a, b):
        return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @gluon.jit
    def _reduce_columns(x, KIND: gl.constexpr):
        """``x (R, C)`` reduced over its columns: KIND "max" (``gl.max``'s: NaN ignored), "max_nan"
        (NaN kept, as quantize.max_nan) or "sum"."""
        if KIND == "max":
            return gl.max(x, 1)
        elif KIND == "max_nan":
            return gl.reduce(x, 1, _max_nan_combine)
        else:
            gl.static_assert(KIND == "sum", "row_reduce: KIND is max, max_nan or sum")
            return gl.sum(x, 1)

    @gluon.jit
    def _fold_halves(x, KIND: gl.constexpr):
        """``x (R, C)`` into (R, C / 2): columns c and c + C / 2 reduced (KIND, :func:`_reduce_columns`)."""
        return _reduce_columns(gl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), KIND)

    @gluon.jit
    def _thread_tree(x, KIND: gl.constexpr):
        """An MMA accumulator ``x (R, C)`` (C a power of two, 8 to 256) folded into (R, 8) as a tree
        (:func:`_fold_halves`): mma_layout's column bit 0 is a register, bits 1-2 lanes and 3 and up
        registers, so each level combines two registers of a thread and the reshapes move no data."""
        if x.shape[1] >= 256:
            x = _fold_halves(x, KIND)
        if x.shape[1] >= 128:
            x = _fold_halves(x, KIND)
        if x.shape[1] >= 64:
            x = _fold_halves(x, KIND)
        if x.shape[1] >= 32:
            x = _fold_halves(x, KIND)
        if x.shape[1] >= 16:
            x = _fold_halves(x, KIND)
        return x

    @gluon.jit
    def row_reduce(x, KIND: gl.constexpr, rows: gl.constexpr, TREE: gl.constexpr):
        """Each row of an MMA accumulator ``x (R, C)`` (C a power of two, at most 256) reduced (KIND:
        "max", "max_nan" or "sum", :func:`_reduce_columns`), returned (R,) in ``rows`` (its
        SliceLayout(1, ·)). TREE: the values a thread holds as a tree (:func:`_thread_tree`), then
        the last two in the thread and two shuffles across the row's 4 lanes, so a row's 32 values in
        a thread (C = 128) take 5 dependent steps instead of a chain of 31 (Triton 3.6's ``gl.reduce``;
        offline SASS: the same instruction count). The maxima are the same bits (their order does not
        matter); a sum is rounded in another order."""
        if TREE:
            return gl.convert_layout(_reduce_columns(_thread_tree(x, KIND), KIND), rows, assert_trivial=True)
        else:
            return _reduce_columns(x, KIND)

    @gluon.jit
    def lane_partials(x, KIND: gl.constexpr):
        """Each row of an MMA accumulator ``x (R, C)`` (C a power of two, 8 to 256) reduced within
        each of the row's 4 lanes only: (R, 4), one value a lane, no shuffle (:func:`_thread_tree`,
        then the thread's last two). For running row statistics read only at the end (a sum, a
        maximum): carried per lane and reduced across lanes once (:func:`lanes_to_rows`)."""
        y = _thread_tree(x, KIND)
        return _reduce_columns(gl.reshape(y, [y.shape[0], 4, 2]).permute(0, 2, 1), KIND)

    @gluon.jit
    def lanes_to_rows(part, KIND: gl.constexpr, rows: gl.constexpr):
        """Per-lane partials ``part (R, 4)`` (:func:`lane_partials`) reduced across the lanes: (R,)
        in ``rows`` (the accumulator's row layout)."""
        return gl.convert_layout(_reduce_columns(part, KIND), rows, assert_trivial=True)

    @gluon.jit
    def per_lane(v, part):
        """A row vector ``v (R,)`` in the accumulator's row layout as (R, 1) in the layout of per-lane
        partials ``part (R, 4)``, to scale them (the same registers: each lane holds its rows')."""
        return gl.expand_dims(gl.convert_layout(v, gl.SliceLayout(1, part.type.layout), assert_trivial=True), 1)

    @gluon.jit
    def mul_rn(a, b):
        """``a · b`` (fp32) rounded by itself (PTX ``mul.rn``, never contracted into an FMA), as
        quantize.mul_rounded in Triton kernels."""
        return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def ds_head_scale(DS_BOUND, head, POW2: gl.constexpr):
        """dS's one scale of query head ``head`` (sequence · H + head index) from its fp32 bound's
        bits, as backward_fp8.ds_head_scale."""
        return scale_from_amax(gl.load(DS_BOUND + head).to(gl.float32, bitcast=True), POW2)

    @gluon.jit
    def ring_barriers(STAGES: gl.constexpr, READY_ARRIVALS: gl.constexpr):
        """(once, ready, empty), initialised mbarriers of a warp-specialised program: ``once`` for the
        tiles its producer loads once, and per ring slot ``ready`` (READY_ARRIVALS arrivals: the
        producer's expect of the TMA bytes, plus one where it also stores into the slot itself) and
        ``empty`` (both consumer warpgroups release the slot)."""
        once = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(once, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=READY_ARRIVALS)
            mbarrier.init(empty.index(i), count=2)
        return once, ready, empty

    @gluon.jit
    def grouped_program(HEAD_GROUP: gl.constexpr):
        """(rank, row) of this program in a grid (blocks, rows), visited in launch order (axis 0
        fastest) as: rows in groups of HEAD_GROUP (the last group smaller where HEAD_GROUP does not
        divide the rows), and within a group rank 0 of each of its rows, then rank 1, ... A bijection
        onto (rank, row); with HEAD_GROUP 1 it is (program_id(0), program_id(1))."""
        n_blk = gl.num_programs(0)
        lin = gl.program_id(1) * n_blk + gl.program_id(0)
        first = (lin // (HEAD_GROUP * n_blk)) * HEAD_GROUP
        size = gl.minimum(gl.num_programs(1) - first, HEAD_GROUP)
        within = lin - first * n_blk
        return within // size, first + within % size

    @gluon.jit
    def query_block(H, G, SK, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                    HEAD_GROUP: gl.constexpr):
        """(bh_q, bh_k, m0, t_hi) of a program over BLOCK_M queries of one (batch, query head), grid
        (query blocks, B·H): its query head's and kv head's row-block indices, its first query and
        the end of its BLOCK_N-key tiles (causal: up to its diagonal; programs with the most key
        tiles first, HEAD_GROUP rows at a time: :func:`grouped_program`)."""
        n_blk = gl.num_programs(0)
        if CAUSAL:
            rank, bh_q = grouped_program(HEAD_GROUP)
            pid = n_blk - 1 - rank
        else:
            pid = gl.program_id(0)
            bh_q = gl.program_id(1)
        return block_fields(bh_q, pid, H, G, SK, BLOCK_M, BLOCK_N, CAUSAL)

    @gluon.jit
    def block_fields(bh_q, blk, H, G, SK, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """(bh_q, bh_k, m0, t_hi) of query block ``blk`` of row ``bh_q`` (batch · query head): its kv
        head's row, its first query and the end of its BLOCK_N-key tiles (causal: up to its diagonal);
        for a per-block program (:func:`query_block`) and a persistent one's entry
        (:func:`scheduled_block`) alike."""
        bh_k = (bh_q // H) * (H // G) + (bh_q % H) // G
        m0 = blk * BLOCK_M
        # causal: through the key tile holding the block's last query (BLOCK_N may exceed BLOCK_M)
        t_hi = (m0 + BLOCK_M + BLOCK_N - 1) // BLOCK_N if CAUSAL else SK // BLOCK_N
        return bh_q, bh_k, m0, t_hi

    @gluon.jit
    def query_side_producer(q_desc, do_desc, k_desc, v_desc, kt_desc, q_smem, do_smem, k_smem, v_smem, kt_smem, q_bar,
                            ready, empty, row_q0, row_k0, row_t0, t_hi, HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr,
                            STAGES: gl.constexpr, h_desc=None, h_smem=None):
        """The producer warp of a program over 2·HALF_Q queries (the forward, dQ and statistics
        kernels): its Q tiles unless ``q_desc`` is None, dO's unless ``do_desc`` is None (two halves
        each), and the whole matrix of ``h_desc`` (the forward's Hadamard matrix, where it quantizes Q
        itself) unless it is None, once; then per key tile t its K codes, V's unless ``v_desc`` is
        None, and the transposed channel-wise codes of ``kt_desc`` (Kᵀ, or Vᵀ in the forward) unless it
        is None, by TMA into ring slot t % STAGES."""
        q_bytes: gl.constexpr = ((0 if q_desc is None else 2 * q_desc.block_type.nbytes)
                                 + (0 if do_desc is None else 2 * do_desc.block_type.nbytes)
                                 + (0 if h_desc is None else h_desc.block_type.nbytes))
        mbarrier.expect(q_bar, q_bytes)
        for w in gl.static_range(2):
            if q_desc is not None:
                tma_load(q_desc, [row_q0 + w * HALF_Q, 0], q_bar, q_smem.index(w))
            if do_desc is not None:
                tma_load(do_desc, [row_q0 + w * HALF_Q, 0], q_bar, do_smem.index(w))
        if h_desc is not None:
            tma_load(h_desc, [0, 0], q_bar, h_smem)
        ring_tiles(k_desc, v_desc, kt_desc, k_smem, v_smem, kt_smem, ready, empty, 0, row_k0, row_t0, t_hi, BLOCK_N,
                   STAGES)

    @gluon.jit
    def ring_tiles(k_desc, v_desc, kt_desc, k_smem, v_smem, kt_smem, ready, empty, c0, row_k0, row_t0, t_hi,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
        """A producer's key tiles 0 <= t < t_hi of one block: K's codes (rows row_k0 + t·BLOCK_N), V's
        unless ``v_desc`` is None and the transposed channel-wise codes of ``kt_desc`` (rows row_t0,
        columns t·BLOCK_N) unless it is None, by TMA into ring slot (c0 + t) % STAGES once the
        consumers released it (c0: the ring's tiles before this block, 0 but in a persistent kernel)."""
        tile_bytes: gl.constexpr = (k_desc.block_type.nbytes + (0 if v_desc is None else v_desc.block_type.nbytes)
                                    + (0 if kt_desc is None else kt_desc.block_type.nbytes))
        for t in range(0, t_hi):
            slot = (c0 + t) % STAGES
            mbarrier.wait(empty.index(slot), (((c0 + t) // STAGES) & 1) ^ 1)  # the first round does not wait
            bar = ready.index(slot)
            mbarrier.expect(bar, tile_bytes)
            tma_load(k_desc, [row_k0 + t * BLOCK_N, 0], bar, k_smem.index(slot))
            if v_desc is not None:
                tma_load(v_desc, [row_k0 + t * BLOCK_N, 0], bar, v_smem.index(slot))
            if kt_desc is not None:
                tma_load(kt_desc, [row_t0, t * BLOCK_N], bar, kt_smem.index(slot))

    @gluon.jit
    def scheduled_block(SCHED, j, N_BLK, H, G, SK, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        CAUSAL: gl.constexpr):
        """(bh_q, bh_k, m0, t_hi) of the query block in entry j of a persistent kernel's schedule
        (persistent_schedule.schedule: row · N_BLK + block), as :func:`query_block` gives them to the
        per-block program of that block."""
        item = gl.load(SCHED + j)
        return block_fields(item // N_BLK, item % N_BLK, H, G, SK, BLOCK_M, BLOCK_N, CAUSAL)

    @gluon.jit
    def program_entries(SCHED):
        """(i0, i1): this persistent program's entries i0 <= j < i1 of its schedule's table."""
        pid = gl.program_id(0)
        return gl.load(SCHED + pid), gl.load(SCHED + pid + 1)

    @gluon.jit
    def persistent_query_side_codes(q_smem, do_smem, q_bar, q_free, n, WG: gl.constexpr, layout: gl.constexpr):
        """The consumers' side of :func:`persistent_query_side_producer`: warpgroup WG's Q and dO
        codes of the program's ``n``-th block, loaded into registers (``layout``) once they have
        arrived, then their buffers released to the producer for the next block."""
        mbarrier.wait(q_bar, n & 1)
        q_reg = q_smem.index(WG).load(layout)
        do_reg = do_smem.index(WG).load(layout)
        thread_barrier()  # every thread's loads done before the producer may overwrite the buffers
        mbarrier.arrive(q_free, count=1)
        return q_reg, do_reg

    @gluon.jit
    def persistent_query_side_producer(q_desc, do_desc, k_desc, v_desc, kt_desc, q_smem, do_smem, k_smem, v_smem,
                                       kt_smem, q_bar, q_free, ready, empty, SCHED, i0, i1, N_BLK, H, G, SQ, SK,
                                       HALF_Q: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                                       CAUSAL: gl.constexpr, STAGES: gl.constexpr):
        """:func:`query_side_producer` of a persistent program (the dQ and statistics kernels) over
        entries i0 <= j < i1 of its schedule: per block its Q and dO codes (two halves each) into the
        one buffer of each once both consumer warpgroups released it (``q_free``: they hold them in
        registers), then its key tiles into the ring, which runs on across blocks."""
        q_bytes: gl.constexpr = 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes
        c = 0
        for j in range(i0, i1):
            bh_q, bh_k, m0, t_hi = scheduled_block(SCHED, j, N_BLK, H, G, SK, 2 * HALF_Q, BLOCK_N, CAUSAL)
            n = j - i0
            mbarrier.wait(q_free, (n & 1) ^ 1)  # the first block does not wait
            mbarrier.expect(q_bar, q_bytes)
            for w in gl.static_range(2):
                tma_load(q_desc, [bh_q * SQ + m0 + w * HALF_Q, 0], q_bar, q_smem.index(w))
                tma_load(do_desc, [bh_q * SQ + m0 + w * HALF_Q, 0], q_bar, do_smem.index(w))
            ring_tiles(k_desc, v_desc, kt_desc, k_smem, v_smem, kt_smem, ready, empty, c, bh_k * SK, bh_k * D, t_hi,
                       BLOCK_N, STAGES)
            c += t_hi
