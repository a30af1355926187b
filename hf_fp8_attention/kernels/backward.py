"""Triton FP8 attention backward with Delta-Matching (docs/design.md §1-§2).

Two kernels, no atomics (deterministic by construction):

1. ``bwd_dq_inreg_kernel`` — one program per (query tile of ``block_q`` rows, batch·query head).
   Matched delta: a first loop over the visible key tiles forms S and dP (B1, B2) and the
   backward's own online normaliser

       m = max_j S_ij,  l = Σ_j exp(S_ij − m),  u = Σ_j exp(S_ij − m) · dP_ij
       LSE'_i = m + log l,   D_i = u / l   (= Σ_j P_ij dP_ij with P = exp(S − LSE'))

   Stale delta: LSE' = the forward's LSE and D_i = Σ_d dO_id O_id (fp32, unquantized inputs).
   A second loop recomputes S and dP bit-identically, forms P = exp(S − LSE') and
   dS = P ∘ (dP − D) in fp32, and accumulates dQ = τ dS K (B4: dS quantized per row within each
   key tile, K per channel within each key tile). It writes LSE' and D for kernel 2.
2. ``bwd_dkdv_inreg_kernel`` — one program per (key tile of ``block_k`` keys, batch·kv head); it loops
   over the G query heads of its kv head (GQA without repeating k/v) and their visible query tiles,
   recomputes S, dP, P, dS exactly as kernel 1 (same LSE', same D) and accumulates
   dV = Pᵀ dO (B3: P per column and dO per channel within each query tile) and
   dK = τ dSᵀ Q (B5: dS per column and Q per channel within each query tile).

Quantization (FP8 mode) happens in registers on tiles loaded from the bf16/fp16/fp32 inputs:
Q, K, V, dO per token for B1/B2 (identical to the forward's F1, so the logits are the forward's);
the channel-wise copies per tile as listed above. Scales are folded into the fp32 accumulators
after each FP8 ``tl.dot`` (a scale is constant along each matmul's contraction), and τ·log2(e)
into the logits so the kernels use ``exp2``. Hybrid mode (``config.backward == "bf16"``) runs the
same schedule with bf16 operands.

Tile sizes are the quantization blocks (``config.block_q`` / ``config.block_k``) and tiles start at
each sequence's start, as in :mod:`hf_fp8_attention.reference`, which defines the numerics.

The default FP8 path (:mod:`.backward_fp8`) runs this schedule on operands quantized once up
front, and by default gives each kernel's two jobs a launch of their own (LSE'/D, then dQ; dK, then
dV: see ``LAUNCH``). It forms the same dS with one operation per element fewer: dO's row scale is
folded into LSE' and D there (see that module's docstring).

With ``ds_scales="head"`` (``fp8_delta``, ``fp8_delta_fast`` and their stale twins) dS takes one
scale per (sequence, query head) in both dQ and dK, from a bound the statistics launch forms and
folds per head (the stale delta then runs that launch too); a recipe whose backward no block binds
(``operands.backward_block_free``) takes its tiles from ``LAUNCH["block_free"]``
(``LAUNCH["block_free_d64"]`` overriding it up to head dim 64) instead of the recipe's blocks.
``config.dq_in_stats`` forms the statistics and dQ in one launch (``LAUNCH["dq_sweep"]``:
dQ = A − D'·B from the forward's LSE, see the config's docstring), so LSE'/D and dQ no longer take
two.

On Hopper the block-free recipes' (``fp8_delta``, ``fp8_delta_fast``, their stale twins) statistics,
dQ and fused dK/dV launches run as warp-specialised Gluon kernels
(:mod:`.backward_dq_gluon`, :mod:`.backward_dkdv_gluon`: a TMA producer warp and two consumer
warpgroups that hold their tile's FP8 operands in registers) where the call is in their scope
(``LAUNCH["gluon_dq"]`` / ``LAUNCH["gluon_dkdv"]``: head dims; dense batches, no soft-cap). They
compute what the Triton launches compute, from the same FP8 copies and statistics.

Logit soft-capping and attention sinks (:mod:`.logit_mods`) run in both paths: the cap (and
K-smoothing's row constant, added back where the FP8 operands are smoothed) wherever S is formed,
the tanh's slope on dS, the sink in the statistics pass's normaliser; the sinks' gradient is
formed afterwards from the per-row LSE' and D the kernels wrote.
"""
from __future__ import annotations

import logging

import torch
from triton.runtime.errors import OutOfResources

from ..config import BackwardPrecision, DeltaMode, FP8AttentionConfig, FP8Format, Granularity, PScaling
from ..masking import MaskSpec, varlen_max_lengths
from ..reference import check_dq_in_stats, stale_lse
from . import backward_dkdv_gluon, backward_dq_gluon, backward_stats_gluon
from .gluon_hopper import gluon_runs
from .backward_fp8 import bwd_dkdv_fp8_kernel, bwd_dq_fp8_kernel
from .backward_inreg import bwd_dkdv_inreg_kernel, bwd_dq_inreg_kernel
from .constants import LOG2E, tl_fp8
from .launch import launch as launch_kernel
from .logit_mods import LogitMods, logit_mods, sink_entries, sink_grad
from .operands import (
    backward_block_free, backward_kv_copies, backward_q_copies, copies_for, logit_factor, stats_for, stats_then_copies,
    tile_recipe,
)
from .quantize import COMPILE_OPTIONS, interpreting, padded_head_dim, pv_order_fits, quantize_operands, scratch_empty
from .tiles import cdiv, check_compiled_blocks

logger = logging.getLogger(__name__)

# Launch parameters per kernel; a module-level table so benchmarks can try others.
# ``prequant``: FP8 mode quantizes Q, K, V, dO once before the attention kernels
# (backward_fp8.py) instead of re-quantizing them in registers inside every program's loop.
# The pre-quantized path runs as four launches by default:
#   ``dq_stats`` (matched delta only: LSE' and D), ``dq``, ``dk``, ``dv``.
# ``split_dq_stats`` False folds LSE'/D into the dQ launch (its first loop); ``split_dkdv`` False
# forms dK and dV in one launch (``dkdv``). Split, Sᵀ is computed once more, but each program holds
# one fp32 accumulator and fewer shared-memory buffers: on an H200 (benchmarks/backward_bench.py --schedules,
# S=8192, causal, d=128) the matched backward takes 3.56 ms split vs 4.88 ms fused, with
# bit-identical gradients (benchmarks/results/h200_v8_backward_bench.log, benchmarks/NOTES.md).
# ``free_tile``: per launch, the tile side that is not a quantization block (the dQ kernel's query
# rows, the dK/dV kernel's key rows; every scale there is per token or per block of the other
# side), so it can be smaller than the recipe's blocks to save registers. None: the block.
# ``inreg``: the in-register kernels (hybrid bf16 backward, or FP8 with prequant off); their bf16
# tiles leave no shared memory for multi-stage pipelining.
# ``block_free``: (query tile, key tile) per launch for recipes whose backward scales no block binds
# (:func:`.operands.backward_block_free`: sequence-wide channel scales, P on the fixed grid, dS per
# head), where both sides of every tile are free (None: the free_tile/block rule above), and their
# own dK/dV split. Chosen by benchmarks/backward_tiles.py on the H200 (fp8_delta_fast, S = 8192,
# causal, d = 128: 4.88 -> 4.55 ms, benchmarks/NOTES.md "Backward"): with every accumulator
# in place, dK and dV in one launch of 64 keys x 32 queries beat the split pair, which they do not
# for the block-bound recipes.
LAUNCH = {
    "prequant": True,
    "split_dq_stats": True,
    "split_dkdv": True,
    "dq_stats": {"num_warps": 4, "num_stages": 3},
    "dq": {"num_warps": 4, "num_stages": 3},
    "dq_sweep": {"num_warps": 4, "num_stages": 3},
    "dk": {"num_warps": 4, "num_stages": 3},
    "dv": {"num_warps": 4, "num_stages": 3},
    "dkdv": {"num_warps": 4, "num_stages": 3},
    "free_tile": {"dq": 64, "dq_stats": 64, "dq_sweep": 64, "dkdv": 64, "dk": 64, "dv": 64},
    "block_free": {"dq_stats": (64, 64), "dq": (64, 64), "dq_sweep": (64, 64), "dkdv": (32, 64), "dk": (64, 64),
                   "dv": (128, 64), "split_dkdv": False},
    # Up to head dim 64 the fused dK/dV launch has the registers for 64 x 64 tiles: 12-15% faster
    # there, 12% slower at 128 (backward_tiles.py, benchmarks/NOTES.md "Backward").
    "block_free_d64": {"dkdv": (64, 64)},
    # The block-free recipes' dQ and fused dK/dV launches on Hopper: the warp-specialised Gluon kernels
    # (backward_dq_gluon.py, backward_dkdv_gluon.py) wherever they apply, at these head dims;
    # elsewhere the Triton launches. At head dim 64 the Gluon dK/dV kernel takes 3-12% off the backward
    # against the Triton launch's 64 x 64 tiles, the same gradients (H100, 2 x 8k and 1 x 16k tokens,
    # H = 16; benchmarks/NOTES.md, "Backward").
    "gluon_dq": (128,),
    "gluon_dkdv": (64, 128),
    # The matched fast recipe's statistics launch in Gluon (backward_stats_gluon.py), each key tile's
    # products issued under the previous tile's statistics: 768 against the Triton launch's 843 us
    # at 8k causal, B = 2, H = 16 on the H200 (benchmarks/NOTES.md, "Backward").
    "gluon_dq_stats": (128,),
    "inreg": {"dq": {"num_warps": 4, "num_stages": 1}, "dkdv": {"num_warps": 8, "num_stages": 1}},
    # The FP8 backward in this many chunks (batch rows; kv heads when B = 1), each quantizing only
    # its own slice of Q, K, V and dO: the seven transient FP8 copies shrink by this factor while the
    # gradients are written in place (:func:`_chunked_backward`). Every scale is per (sequence,
    # head), so the gradients are the same bits. 1: one pass over the whole batch. Two chunks took
    # one fwd+bwd's peak at 16k tokens, H = 16, d = 128 from 427 to 375 MiB over the inputs (cuDNN:
    # 387) for a backward 1.5-10% slower, median ~3% (H100; benchmarks/NOTES.md, "Backward").
    "backward_chunks": 2,
    # ... but only for calls with at least this many query elements (B·Hq·Sq·D; 2^24 is 8k tokens
    # at H = 16, d = 128, 16 MiB of Q's codes): below it the copies are small and the extra launches'
    # host time is a larger share of the call.
    "backward_chunk_min_elements": 1 << 24,
    # ... and, on a CUDA device, only where one pass would set a new peak of allocated memory
    # (:func:`_one_pass_stays_under_peak`): chunks lower the peak only there and cost time everywhere.
    # Inside a model's training step the activations saved for the backward have set a higher peak
    # before any attention backward runs (a 0.89B Llama at 8k: the same 19.08 GiB with and without
    # chunks), so its layers run one pass; a lone fwd+bwd still runs in chunks. False: chunk by size
    # alone.
    "backward_chunks_below_peak": True,
}
# Head dim 256: the launch shapes of the keys above but the three switches (those stay in LAUNCH).
# Per 64 rows of a warpgroup, a 256-channel fp32 accumulator is 128 registers per thread, as many as
# the S and dP tiles of 128 keys together. Whole-width, the dQ, dK and dV launches spilled 1.7-3.1 KB
# per thread on 64-row tiles with 4 warps (1 stage; 3 stages exceed shared memory) and needed 257 KB
# of shared memory on 128-row tiles with 8 warps and 2 stages; 8 warps on 64 rows compute the same S
# twice (a chained dot puts every warp along the rows).
# ``channel_block`` splits their output channels over grid axis 2: each program forms 128 of
# dQ's (dK's, dV's) channels and recomputes S and dP over all 256, so dQ and dK cost 5/3 of their
# matmuls, dV 3/2; spills then fall to about the 128-channel kernels' (offline counts). ``inreg``'s
# ``block_q`` / ``block_k`` are the hybrid (bf16) kernels' tiles, which no quantization block binds;
# the in-register FP8 kernels do not run at 256. Resources offline for sm_90a:
# benchmarks/results/cpu_kernel_resources.txt, benchmarks/NOTES.md ("Head dim 256").
LAUNCH_D256 = {
    "dq_stats": {"num_warps": 4, "num_stages": 2},
    "dq": {"num_warps": 8, "num_stages": 2},
    "dq_sweep": {"num_warps": 8, "num_stages": 1},
    "dk": {"num_warps": 8, "num_stages": 2},
    "dv": {"num_warps": 8, "num_stages": 2},
    "dkdv": {"num_warps": 8, "num_stages": 1},
    "free_tile": {"dq": 128, "dq_stats": 64, "dq_sweep": 64, "dkdv": 128, "dk": 128, "dv": 128},
    "channel_block": {"dq": 128, "dq_stats": None, "dq_sweep": 128, "dkdv": 128, "dk": 128, "dv": 128},
    "inreg": {"dq": {"num_warps": 4, "num_stages": 1, "block_q": 32, "block_k": 64},
              "dkdv": {"num_warps": 8, "num_stages": 1, "block_q": 32, "block_k": 64}},
}
# Pipelined stages of the pre-quantized kernels hold four FP8 operand tiles of block x DP bytes
# each: 64 KB per stage at 128-token blocks and DP = 128, so 256-token blocks (128 KB) get a single
# stage (at DP = 256 the table above says how many).
_MAX_PIPELINED_BLOCK = 128
# The Triton dQ and dK/dV launches take dS's and Pᵀ's codes to their token-contracted products in the
# accumulator's order (backward_fp8._a_operand), K's, Q's and dO's channel-wise copies written to match
# (quantize.Copies.col_pv), on dense batches whose contracted length is a multiple of 16: the Gluon
# launches' A_IN_PLACE (4-6% off their time on the H100) for the shapes the Triton ones run (head dims
# other than 128, packed batches excluded). On the H100 at head dim 64 (16k tokens, H = 16, CUDA
# graph) the backward took 0.908-0.966x of its time, the same bits (benchmarks/NOTES.md, "Backward").
A_IN_PLACE_TRITON = True


def launch_table(dp: int) -> dict:
    """The launch shapes for padded head dim ``dp``: ``LAUNCH`` up to 128, else ``LAUNCH_D256``."""
    return LAUNCH_D256 if dp > 128 else LAUNCH


def _prequant_launch(kernel: str, block_q: int, block_k: int, dp: int) -> dict:
    """``launch_table(dp)[kernel]`` with ``num_stages`` cut to 1 when the recipe's blocks exceed 128 tokens."""
    launch = dict(launch_table(dp)[kernel])
    if max(block_q, block_k) > _MAX_PIPELINED_BLOCK:
        launch["num_stages"] = 1
    return launch


# --------------------------------------------------------------------------------------------
# launcher
# --------------------------------------------------------------------------------------------


def _gradient_alloc(mask: MaskSpec):
    """How gradients are allocated: zeroed for a packed batch (tokens outside every sequence get zero
    gradients, no launch writes them), else uninitialised (every element is written)."""
    return torch.zeros if mask.is_varlen else torch.empty


def _check_limits(q, config: FP8AttentionConfig) -> None:
    """The kernels' own limits (the call itself is validated once, by ``functional.fp8_attention``):
    CUDA tensors (or the interpreter) and recipe blocks a GPU compile can run. The grid limit is
    checked in :func:`_launch`."""
    if q.device.type != "cuda" and not interpreting():
        raise ValueError(f"triton_backward: the Triton kernels need CUDA tensors, got {q.device} "
                         "(the PyTorch emulation in reference.py runs anywhere)")
    check_compiled_blocks(config.block_q, config.block_k, "triton_backward", interpreting())
    if config.backward is BackwardPrecision.FP8 and not LAUNCH["prequant"]:
        if not tile_recipe(config):
            raise ValueError("triton_backward: the in-register FP8 kernels (LAUNCH['prequant'] = False) run only the "
                             "per-tile recipe without transforms (fp8_delta_tile / fp8_stale_tile)")
        if padded_head_dim(q.shape[-1]) > 128:
            raise ValueError(f"triton_backward: the in-register FP8 kernels (LAUNCH['prequant'] = False) run head "
                             f"dims up to 128, got {q.shape[-1]}: their whole-width fp32 tiles exceed a block's "
                             "registers and shared memory; keep LAUNCH['prequant'] = True")


def _launch(q, k, v, out, lse, dout, scale, mask, config, debug, softcap, sinks, kv_stats=None, q_stats=None,
            grads=None, sink_entries_only=False, kv_copies=None):
    """``(dq, dk, dv, ds_row_sums, p_abs_dp_row_sums, dsinks)``: dsinks None without sinks; the row
    sums ``(B·Hq, Sq)`` are filled only with ``debug`` (with sinks, the sink's entry included).
    ``kv_stats`` / ``q_stats``: K's and V's / Q's sequence statistics from the forward (see
    :func:`triton_backward`). ``grads``: contiguous ``(dq, dk, dv)`` to write the gradients into
    (zeroed for a varlen batch), instead of allocating them. ``sink_entries_only``: the last item is
    the sinks' per-row entries ``(B, Hq, Sq)`` instead of their sum dsinks. ``kv_copies``: see
    :func:`triton_backward`."""
    check_dq_in_stats(config, softcap, sinks)
    mods = _mods(q, k, scale, mask, config, softcap, sinks)
    lse = stale_lse(lse, q, k, scale, mask, config, softcap, sinks)
    _check_limits(q, config)
    b, hq, sq_total, d = q.shape
    hkv, sk_total = k.shape[1], k.shape[2]
    g = hq // hkv
    fp8 = config.backward is BackwardPrecision.FP8
    matched = config.delta is DeltaMode.MATCHED
    bq, bk = config.block_q, config.block_k
    dev = q.device

    if mask.is_varlen:
        cu_q, cu_k = mask.cu_seqlens_q, mask.cu_seqlens_k  # int32, contiguous (MaskSpec)
        n_seq = cu_q.numel() - 1
        max_q, max_k = varlen_max_lengths(mask)  # (0, 0) without sequences
    else:
        cu_q = cu_k = lse  # dummies, never read (the kernels load them only when VARLEN)
        n_seq, max_q, max_k = b, sq_total, sk_total
    alloc = _gradient_alloc(mask)
    if n_seq * hq > 65535:  # grid axis 1 holds (sequence, head) pairs
        raise ValueError(f"triton_backward: sequences x heads = {n_seq * hq} exceeds the grid limit 65535")
    prequant = fp8 and LAUNCH["prequant"]

    def q_grad():
        return grads[0] if grads is not None else alloc(q.shape, dtype=q.dtype, device=dev)

    def kv_grads():
        if grads is not None:
            return grads[1], grads[2]
        return alloc(k.shape, dtype=k.dtype, device=dev), alloc(v.shape, dtype=v.dtype, device=dev)

    if prequant:
        # LSE', LSE'^do and D' of every row of every sequence are written by the dQ kernel's
        # statistics pass before any launch reads them; rows outside all sequences are never read.
        # Under the interpreter (the CPU tests) they start as NaN, so a row read before it is
        # written shows.
        scratch = scratch_empty()
        lse2 = scratch((b * hq, sq_total), dtype=torch.float32, device=dev)
        delta = scratch((b * hq, sq_total), dtype=torch.float32, device=dev)
        lse2do = scratch((b * hq, sq_total), dtype=torch.float32, device=dev)
    else:
        lse2 = torch.full((b * hq, sq_total), float("-inf"), dtype=torch.float32, device=dev)
        delta = torch.zeros((b * hq, sq_total), dtype=torch.float32, device=dev)
    dbg_ds = torch.zeros((b * hq, sq_total), dtype=torch.float32, device=dev) if debug else delta
    dbg_pabs = torch.zeros((b * hq, sq_total), dtype=torch.float32, device=dev) if debug else delta
    no_sinks = None
    if mods.sinks2 is not None:  # dsinks, or its per-row entries
        no_sinks = (torch.zeros(b, hq, sq_total, dtype=torch.float32, device=dev) if sink_entries_only
                    else torch.zeros_like(mods.sinks2))
    if n_seq == 0 or max_q == 0:
        return (q_grad().zero_(), *(t.zero_() for t in kv_grads()), dbg_ds, dbg_pabs, no_sinks)
    o = out if out is not None else q  # O is read only by the stale kernel
    window = mask.window_arg
    if prequant:
        dq, dk, dv = _launch_fp8(q, k, v, o, lse, dout, q_grad, kv_grads, lse2, lse2do, delta, dbg_ds, dbg_pabs,
                                 cu_q, cu_k, n_seq, max_q, max_k, scale, mask, config, debug, mods, kv_stats, q_stats,
                                 kv_copies)
        # 2^(σ₂ − LSE'^do)·D' = P_sink·D (dO's row scale cancels)
        sink = _sink_grad(mods, lse2do, delta, dbg_ds, mask, b, sq_total, debug, sink_entries_only)
        return (dq, dk, dv, dbg_ds, dbg_pabs, *sink)
    dq, (dk, dv) = q_grad(), kv_grads()
    dp = padded_head_dim(d)
    inreg = launch_table(dp)["inreg"]
    launch_dq, launch_dkdv = dict(inreg["dq"]), dict(inreg["dkdv"])
    # FP8 tiles are the quantization blocks; hybrid tiles only order the fp32 sums (blocks in LAUNCH_D256).
    bq_dq, bk_dq = (bq, bk) if fp8 else (launch_dq.pop("block_q", bq), launch_dq.pop("block_k", bk))
    bq_kv, bk_kv = (bq, bk) if fp8 else (launch_dkdv.pop("block_q", bq), launch_dkdv.pop("block_k", bk))
    common = dict(
        HEAD_D=d, BLOCK_D=dp,
        FP8=fp8, CAUSAL=bool(mask.causal), HAS_WINDOW=mask.window is not None, VARLEN=mask.is_varlen,
        POW2=bool(config.pow2_scales), QKV_DTYPE=tl_fp8(FP8Format.E4M3),
        DO_DTYPE=tl_fp8(config.do_format), DS_DTYPE=tl_fp8(config.ds_format),
        DO_MAX=config.do_format.max, DS_MAX=config.ds_format.max,
        INTERPRET=interpreting(),
    )
    qk_scale = float(scale) * LOG2E
    dims = (hq, g, sq_total, sq_total, sk_total)  # SQ/SK: dense lengths (varlen reads cu_seqlens)
    _, sinks2, softcap2 = mods.args(lse)
    mod_meta = mods.meta()
    del mod_meta["ROW_SHIFT"]  # these kernels' operands are never smoothed
    launch_kernel(
        bwd_dq_inreg_kernel, (cdiv(max_q, bq_dq), n_seq * hq),
        q, k, v, dout, o, lse, dq, lse2, delta, dbg_ds, dbg_pabs, cu_q, cu_k, sinks2,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *o.stride(), *dq.stride(), *lse.stride(),
        *dims, window, qk_scale, float(scale), softcap2,
        MATCHED=matched, DEBUG=debug, **common, **mod_meta, BLOCK_Q=bq_dq, BLOCK_K=bk_dq, **launch_dq,
        **COMPILE_OPTIONS,
    )
    del mod_meta["SINK"]
    launch_kernel(
        bwd_dkdv_inreg_kernel, (cdiv(max_k, bk_kv), n_seq * hkv),
        q, k, v, dout, lse2, delta, dk, dv, cu_q, cu_k,
        *q.stride(), *k.stride(), *v.stride(), *dout.stride(), *dk.stride(), *dv.stride(),
        *dims, window, qk_scale, float(scale), softcap2,
        **common, **mod_meta, BLOCK_Q=bq_kv, BLOCK_K=bk_kv, **launch_dkdv, **COMPILE_OPTIONS,
    )
    sink = _sink_grad(mods, lse2, delta, dbg_ds, mask, b, sq_total, debug, sink_entries_only)
    return (dq, dk, dv, dbg_ds, dbg_pabs, *sink)


def _sink_grad(mods: LogitMods, lse2, delta, dbg_ds, mask, b, sq_total, debug, entries_only=False) -> tuple:
    """``(dsinks,)`` from the statistics (see :func:`.logit_mods.sink_entries`; ``(None,)`` without
    sinks), or with ``entries_only`` ``(entries,)`` before their sum; with ``debug`` the sink entries
    join the debug row sums ``dbg_ds`` (in place)."""
    if mods.sinks2 is None:
        return (None,)
    entries = sink_entries(mods.sinks2, lse2, delta, mask, b, sq_total)
    if debug:
        dbg_ds += entries.reshape(dbg_ds.shape)
    return (entries if entries_only else sink_grad(entries),)


def _launch_fp8(q, k, v, o, lse, dout, q_grad, kv_grads, lse2, lse2do, delta, dbg_ds, dbg_pabs, cu_q, cu_k,
                n_seq, max_q, max_k, scale, mask, config, debug, mods: LogitMods, kv_stats=None, q_stats=None,
                kv_copies=None):
    """FP8 mode on operands quantized once up front (kernels in backward_fp8.py); returns ``(dq, dk,
    dv)``, each allocated (``q_grad()``, ``kv_grads()``) just before the launch that writes it, so
    that no gradient sits beside an FP8 copy its launch does not read. Where LSE', D' and the dS
    bound have a launch of their own, it runs first, then dK/dV (beside all seven copies), then dQ
    (Q's and dO's channel-wise copies freed: five copies beside three gradients); where dQ's launch
    forms them, dQ runs first, then dK/dV (K's channel-wise copy, read by dQ alone, freed).
    ``lse2``, ``lse2do``, ``delta``: (B·Hq, Sq) fp32 buffers for LSE', LSE'^do and D' (see that
    module). ``mods``: the logit modifiers (:mod:`.logit_mods`). ``kv_stats``: K's
    and V's statistics when the forward computed them (else computed here); ``q_stats``: Q's,
    likewise (then dO's statistics launch reads dO alone); ``kv_copies``: K's and V's copies when
    the forward made them (:func:`triton_backward`), taken out of the list here."""
    b, hq, sq_total, d = q.shape
    hkv, sk_total = k.shape[1], k.shape[2]
    bq, bk, pow2 = config.block_q, config.block_k, bool(config.pow2_scales)
    varlen = mask.is_varlen
    cq, ck = (cu_q, cu_k) if varlen else (None, None)
    # Row-wise copies for B1/B2 and transposed channel-wise copies per recipe block for B3-B5, made
    # by the forward's quantization kernel (so B1's codes are the forward's F1 codes, bit for bit):
    # one launch for Q and dO, one for K and V.
    # The recipe's sequence statistics (channel amax, K's mean, per-head amax) come first, from the
    # same kernels as the forward's, so the codes of Q and K for QKᵀ are the forward's.
    mod_meta = mods.meta()
    kv_meta = {key: value for key, value in mod_meta.items() if key != "SINK"}  # in LSE' and LSE'^do already
    dq_gluon = _dq_runs_gluon(q, k, mask, config, mod_meta, debug)
    dkdv_gluon = _gluon_runs(backward_dkdv_gluon, "gluon_dkdv", q, k, mask, config, kv_meta)
    # The dQ and dK/dV launches that take their A operands in place (the Gluon ones' A_IN_PLACE, the
    # Triton ones' A_IN_PLACE_TRITON): K's channel-wise copy, read by dQ alone, then holds its keys,
    # Q's and dO's, read by dK/dV alone, their queries in that order (quantize.Copies.col_pv); a
    # forward that hands K's copy over made it so (dq_keys_in_pv_order).
    queries_in_pv_order = _in_place_order(dkdv_gluon, backward_dkdv_gluon.A_IN_PLACE, sq_total, mask)
    keys_in_pv_order = _in_place_order(dq_gluon, backward_dq_gluon.A_IN_PLACE, sk_total, mask)
    qc = backward_q_copies(config)._replace(col_pv=queries_in_pv_order)
    doc = copies_for("do", config, row=True, col=True)._replace(col_pv=queries_in_pv_order)
    kc, vc = backward_kv_copies(config)
    kc = kc._replace(col_pv=keys_in_pv_order)
    # Where no statistics were handed over, they and the copies come from one launch where it can.
    if q_stats is not None:
        qdo_stats = (q_stats, *stats_for((dout,), (doc,), cq, max_q))
        qdo = quantize_operands((q, dout), (qc, doc), block=bq, pow2=pow2, cu_seqlens=cq, max_seqlen=max_q,
                                stats=qdo_stats)
    else:
        _, qdo = stats_then_copies((q, dout), (qc, doc), block=bq, pow2=pow2, cu_seqlens=cq, max_seqlen=max_q)
    (qr, qrs, qct, qcs, toff_q), (dor, dors, doct, docs, _) = qdo
    if kv_copies:  # the forward's launch made them from the same statistics: the same codes
        *kv, handed_order = kv_copies.pop()
        if handed_order != keys_in_pv_order:  # (K and V may be stand-ins: no copies can be made here)
            order = {True: "the dQ launch's in-place operand order", False: "token order"}
            raise RuntimeError(f"triton_backward: K's channel-wise copy handed over by the forward holds its keys "
                               f"in {order[handed_order]}, this backward's dQ launch takes {order[keys_in_pv_order]}")
    elif kv_stats is not None:
        kv = quantize_operands((k, v), (kc, vc), block=bk, pow2=pow2, cu_seqlens=ck, max_seqlen=max_k, stats=kv_stats)
    else:
        _, kv = stats_then_copies((k, v), (kc, vc), block=bk, pow2=pow2, cu_seqlens=ck, max_seqlen=max_k)
    (kr, krs, kct, kcs, toff_k), (vr, vrs, _, _, _) = kv
    del qdo, kv  # each copy is freed as soon as its last reader has run (below)
    if not varlen:  # the kernels read tile offsets only for packed sequences
        toff_q, toff_k = cu_q, cu_k
    interp = interpreting()
    dp = padded_head_dim(d)
    table = launch_table(dp)
    common = dict(HEAD_D=d, BLOCK_D=dp, CAUSAL=bool(mask.causal),
                  HAS_WINDOW=mask.window is not None, VARLEN=mask.is_varlen, POW2=pow2,
                  DS_DTYPE=tl_fp8(config.ds_format), DS_MAX=config.ds_format.max, INTERPRET=interp)
    window = mask.window_arg
    qk_scale = float(scale) * LOG2E * logit_factor(config, d)
    recipe = dict(KV_HEAD=config.kv_scales is Granularity.HEAD, COL_SEQ=config.channel_scales is not Granularity.TILE)
    matched = config.delta is DeltaMode.MATCHED
    shift2, sinks2, softcap2 = mods.args(lse)
    # ds_scales "head": the statistics launch folds each row's dS bound into one value per (sequence,
    # query head) (an atomic max of fp32 bits, see bwd_dq_fp8_kernel) before any launch reads it,
    # so the statistics always have a launch of their own, for the stale delta too (dq_in_stats: the
    # one sweep forms them with dQ, and folds the bound as that launch does).
    ds_head = config.ds_scales is Granularity.HEAD
    ds_bound = torch.zeros(n_seq * hq, dtype=torch.int32, device=q.device) if ds_head else lse2
    one_sweep = config.dq_in_stats
    if one_sweep:
        dq_passes = ((True, True, "dq_sweep"),)
    elif (matched and LAUNCH["split_dq_stats"]) or ds_head:
        dq_passes = ((True, False, "dq_stats"), (False, True, "dq"))
    else:
        dq_passes = ((True, True, "dq"),)
    free = backward_block_free(config)

    def run_dq(passes, dq, kct, kcs) -> None:
        """The statistics and dQ launches ``passes`` (K's channel-wise copy ``kct``, ``kcs``); ``dq``
        is written only by those with grads."""
        for stats, grads, launch in passes:
            if (launch == "dq_stats" and not debug
                    and _gluon_runs(backward_stats_gluon, "gluon_dq_stats", q, k, mask, config, mod_meta)):
                backward_stats_gluon.gluon_dq_stats(qr, qrs, kr, krs, vr, vrs, dor, dors, lse2, lse2do, delta,
                                                    ds_bound, groups=hq // hkv, qk_scale=qk_scale,
                                                    causal=bool(mask.causal))
                continue
            if launch == "dq" and dq_gluon:
                backward_dq_gluon.gluon_dq(qr, qrs, kr, krs, kct, kcs, vr, dor, lse2do, delta, ds_bound, dq,
                                           groups=hq // hkv, qk_scale=qk_scale, tau=float(scale),
                                           causal=bool(mask.causal), pow2=pow2, keys_in_pv_order=keys_in_pv_order)
                continue
            tq, tk = _tiles(table, launch, free, config, dp, query_side=True)
            bdo = _channel_block(table, launch, dp)
            _run_prequant(bwd_dq_fp8_kernel, (cdiv(max_q, tq), n_seq * hq, dp // bdo), launch, dp, (
                qr, qrs, kr, krs, kct, kcs, vr, vrs, dor, dors,
                dout, o, lse, dq, lse2, lse2do, delta, dbg_ds, dbg_pabs, cu_q, cu_k, toff_k, shift2, sinks2, ds_bound,
                *dout.stride(), *o.stride(), *lse.stride(),
                hq, hq // hkv, sq_total, sk_total, kct.shape[-1], kcs.shape[2], sq_total, sk_total, window, qk_scale,
                float(scale), softcap2), dict(
                MATCHED=matched, DEBUG=debug, **common, BLOCK_Q=tq, BLOCK_K=tk, STATS=stats, GRADS=grads,
                ALIGNED=not varlen and sq_total % tq == 0 and sk_total % tk == 0, **recipe, **mod_meta,
                DS_HEAD=ds_head, ONE_SWEEP=one_sweep, BLOCK_DO=bdo, A_IN_PLACE=keys_in_pv_order,
                **_prequant_launch(launch, tq, tk, dp),
                **COMPILE_OPTIONS,
            ))

    def run_dkdv(dk, dv, qct, qcs, doct, docs) -> None:
        """The dK/dV launches (Q's and dO's channel-wise copies ``qct``, ``qcs``, ``doct``, ``docs``)."""
        if dkdv_gluon:
            backward_dkdv_gluon.gluon_dkdv(
                qr, qrs, qct, qcs, kr, krs, vr, vrs, dor, dors, doct, docs, lse2, delta, ds_bound, dk, dv,
                groups=hq // hkv, qk_scale=qk_scale, tau=float(scale), causal=bool(mask.causal), pow2=pow2,
                qdo_head=config.qdo_scales is Granularity.HEAD, queries_in_pv_order=queries_in_pv_order)
            return
        split_dkdv = (table.get("block_free", {}).get("split_dkdv", LAUNCH["split_dkdv"]) if free
                      else LAUNCH["split_dkdv"])
        passes = ((True, False, "dk"), (False, True, "dv")) if split_dkdv else ((True, True, "dkdv"),)
        for compute_dk, compute_dv, launch in passes:
            tq, tk = _tiles(table, launch, free, config, dp, query_side=False)
            bdo = _channel_block(table, launch, dp)
            _run_prequant(bwd_dkdv_fp8_kernel, (cdiv(max_k, tk), n_seq * hkv, dp // bdo), launch, dp, (
                qr, qrs, qct, qcs, kr, krs, vr, vrs, dor, dors, doct, docs,
                lse2, lse2do, delta, dk, dv, cu_q, cu_k, toff_q, shift2, ds_bound,
                hq, hq // hkv, sq_total, sk_total, qct.shape[-1], qcs.shape[2], sq_total, sk_total, window, qk_scale,
                float(scale), softcap2), dict(
                **common, BLOCK_Q=tq, BLOCK_K=tk, COMPUTE_DK=compute_dk, COMPUTE_DV=compute_dv,
                ALIGNED=not varlen and sq_total % tq == 0 and sk_total % tk == 0, **recipe, **kv_meta,
                P_FIXED=config.p_scales is PScaling.FIXED, DS_HEAD=ds_head,
                QDO_HEAD=config.qdo_scales is Granularity.HEAD, BLOCK_DO=bdo, A_IN_PLACE=queries_in_pv_order,
                **_prequant_launch(launch, tq, tk, dp),
                **COMPILE_OPTIONS,
            ))

    # Each gradient is allocated just before its first launch and each channel-wise copy freed after
    # its last reader: the peak is then seven copies beside two gradients, or five beside three,
    # where dQ first holds six copies beside all three.
    if dq_passes[0][1]:  # dQ's launch forms LSE', D' and the dS bound: dQ first
        dq = q_grad()
        run_dq(dq_passes, dq, kct, kcs)
        del kct, kcs  # read by dQ alone
        dk, dv = kv_grads()
        run_dkdv(dk, dv, qct, qcs, doct, docs)
    else:  # the statistics' own launch, then dK/dV, then dQ
        run_dq(dq_passes[:1], q, kct, kcs)  # q: a stand-in for dQ, which this launch never writes
        dk, dv = kv_grads()
        run_dkdv(dk, dv, qct, qcs, doct, docs)
        del qct, qcs, doct, docs  # read by dK/dV alone
        dq = q_grad()
        run_dq(dq_passes[1:], dq, kct, kcs)
    return dq, dk, dv


def dq_keys_in_pv_order(q, k, mask: MaskSpec, config: FP8AttentionConfig, mod_meta: dict) -> bool:
    """Whether the FP8 backward's dQ launch on ``q``, ``k`` takes K's channel-wise copy with its keys in
    the order it takes dS's codes in place (``quantize.Copies.col_pv``): the order a forward that
    hands K's copies over (:func:`takes_kv_copies`) makes that copy in. ``mod_meta``:
    ``LogitMods.meta`` of the call."""
    return _in_place_order(_dq_runs_gluon(q, k, mask, config, mod_meta), backward_dq_gluon.A_IN_PLACE, k.shape[2],
                           mask)


def _in_place_order(runs_gluon: bool, gluon_in_place: bool, contracted: int, mask: MaskSpec) -> bool:
    """Whether the dQ (dK/dV) launch takes its A operands in place, so that K's (Q's and dO's)
    channel-wise copy holds its ``contracted`` keys (queries) in that order: the Gluon kernel's
    switch ``gluon_in_place`` where it runs (``runs_gluon``), else the Triton launch's
    (:data:`A_IN_PLACE_TRITON`; the debug launch and the one-sweep dQ are Triton launches) where the
    copy can hold the order (:func:`.quantize.pv_order_fits`)."""
    if runs_gluon:
        return gluon_in_place
    return A_IN_PLACE_TRITON and pv_order_fits(contracted, mask.is_varlen)


def _dq_runs_gluon(q, k, mask: MaskSpec, config: FP8AttentionConfig, mod_meta: dict, debug: bool = False) -> bool:
    """Whether the Gluon kernel runs the FP8 backward's dQ launch: not the debug launch (it writes the
    row sums' diagnostics), nor the one-sweep dQ of ``dq_in_stats``."""
    return (not debug and not config.dq_in_stats
            and _gluon_runs(backward_dq_gluon, "gluon_dq", q, k, mask, config, mod_meta))


def _gluon_runs(module, key: str, q, k, mask: MaskSpec, config: FP8AttentionConfig, mod_meta: dict) -> bool:
    """Whether ``module``'s Gluon kernel (backward_stats_gluon, backward_dq_gluon or
    backward_dkdv_gluon) does this launch's work, ``LAUNCH[key]`` listing the head dims it is
    enabled at (:func:`.gluon_hopper.gluon_runs`)."""
    return gluon_runs(module, LAUNCH[key], q, k, mask, config, mod_meta, f"triton_backward ({key})")


def _tiles(table: dict, launch: str, free: bool, config: FP8AttentionConfig, dp: int, *,
           query_side: bool) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_K) of ``launch``: the table's ``block_free`` pair (``block_free_d64``'s at
    padded head dim ``dp`` <= 64) where the recipe's backward is block-free and the table names
    one; else the free tile on the launch's own side (query rows
    of the dQ launches, key rows of the dK/dV ones) and the recipe's block on the other."""
    small = table.get("block_free_d64", {}) if dp <= 64 else {}
    pair = small.get(launch, table.get("block_free", {}).get(launch)) if free else None
    if pair is not None:
        return pair
    if query_side:
        return table["free_tile"][launch] or config.block_q, config.block_k
    return config.block_q, table["free_tile"][launch] or config.block_k


def _run_prequant(kernel, grid, launch: str, dp: int, args: tuple, kwargs: dict) -> None:
    """``kernel[grid](*args, **kwargs)``, through :func:`.launch.launch`. At head dim 256 the 2-stage
    shapes of ``LAUNCH_D256`` fill the 227 KB of shared memory per block to within 1-2 KB (offline,
    Triton 3.9); where a Triton version allocates more, the launch raises OutOfResources before
    anything runs, and it is retried with one stage fewer, which the table then keeps (one warning)."""
    if dp <= 128:
        launch_kernel(kernel, grid, *args, **kwargs)
        return
    while True:
        try:
            launch_kernel(kernel, grid, *args, **kwargs)
            return
        except OutOfResources as err:
            stages = kwargs["num_stages"]
            if stages <= 1:
                raise
            logger.warning("triton_backward: %s launch at head dim %d: %s; retrying with %d stage(s)",
                           launch, dp, err, stages - 1)
            LAUNCH_D256[launch]["num_stages"] = min(LAUNCH_D256[launch]["num_stages"], stages - 1)
            kwargs = {**kwargs, "num_stages": stages - 1}


def _channel_block(table: dict, launch: str, dp: int) -> int:
    """Output channels per program of ``launch`` (grid axis 2 holds dp // block of them): all ``dp``
    unless the table's ``channel_block`` splits them (a launch that forms no gradient, the
    statistics, never splits)."""
    block = table.get("channel_block", {}).get(launch) or dp
    return min(block, dp)


def _mods(q, k, scale, mask, config, softcap, sinks) -> LogitMods:
    """The call's logit modifiers; K-smoothing's row constant only where the backward's QKᵀ operands
    are smoothed (the pre-quantized FP8 path; the in-register ones run unsmoothed recipes)."""
    smoothed = config.backward is BackwardPrecision.FP8 and LAUNCH["prequant"]
    return logit_mods(q, k, scale, mask, config, softcap, sinks, smoothed=smoothed)


def triton_backward(q, k, v, out, lse, dout, *, scale: float, mask: MaskSpec, config: FP8AttentionConfig,
                    softcap: float | None = None, sinks: torch.Tensor | None = None, kv_stats: tuple | None = None,
                    q_stats: tuple | None = None, kv_copies: list | None = None):
    """FP8 (or hybrid bf16) attention backward with the matched or stale delta, in Triton.

    Args:
        q: ``(B, Hq, Sq, D)`` bf16/fp16/fp32, any strides; k, v: ``(B, Hkv, Sk, D)``.
        out: forward output ``(B, Hq, Sq, D)``; read only by ``delta="stale"`` (None is fine when matched).
        lse: ``(B, Hq, Sq)`` fp32 natural-log LSE of the forward (-inf on rows with no key); read
            by the stale delta and by ``config.dq_in_stats`` (the matched delta otherwise forms its
            own normaliser).
        dout: ``(B, Hq, Sq, D)``.
        scale: softmax scale τ. mask: :class:`MaskSpec`. config: the recipe (tile sizes = quant blocks).
        softcap, sinks ``(Hq,)`` fp32: the forward's logit modifiers (:mod:`hf_fp8_attention.reference`).
        kv_stats: what :func:`.forward.triton_forward` left under ``for_backward["kv_stats"]`` for
            these k, v, mask and config (the same statistics this backward would compute: its K
            and V codes are the same bit for bit; two launches fewer). None: computed here.
        q_stats: Q's statistics, left under ``for_backward["q_stats"]`` by a forward that computes
            them anyway (recipes with one Q scale per head): the backward's statistics launches then
            read dO alone instead of Q and dO. None: computed here.
        kv_copies: what the forward left under ``for_backward["kv_copies"]`` where
            :func:`takes_kv_copies` held (``forward.HAND_OVER_KV_COPIES``): a one-item list of K's
            and V's copies and whether K's channel-wise copy holds its keys in the Gluon dQ's order
            (:func:`dq_keys_in_pv_order`; a RuntimeError where this backward takes the other), which
            this backward takes out (emptying the list), so that a copy nothing else holds is freed
            after its last reader as its own would be (the eager autograd call holds them as saved
            tensors until its backward ends, :mod:`hf_fp8_attention.ops`). It makes no K/V copies of
            its own then, and runs in one pass (never chunked): k and v are then read for their
            shapes and dtypes only (without soft-cap and sinks, whose statistics read K).
    Returns:
        ``(dq, dk, dv)`` contiguous, in the dtypes and shapes of q, k, v, followed with ``sinks`` by
        ``dsinks (Hq,)`` fp32.
    """
    # Handed-over copies mean one pass: the forward hands them over only where takes_kv_copies saw
    # one, and its caller may have kept no 16-bit K and V to make a chunk's copies from.
    chunks = [(slice(None),) * 3] if kv_copies else _chunk_slices(q, k, mask, config)
    if len(chunks) > 1:
        return _chunked_backward(q, k, v, out, lse, dout, scale, mask, config, softcap, sinks, kv_stats, q_stats,
                                 chunks)
    dq, dk, dv, _, _, dsinks = _launch(q, k, v, out, lse, dout, scale, mask, config, False, softcap, sinks, kv_stats,
                                       q_stats, kv_copies=kv_copies)
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


def takes_kv_copies(q, k, mask: MaskSpec, config: FP8AttentionConfig) -> bool:
    """Whether :func:`triton_backward` on these shapes quantizes K and V once, up front and whole (the
    FP8 backward on pre-quantized operands, in one chunk), so that copies its forward made
    (``kv_copies``) can stand in for its own."""
    return (config.backward is BackwardPrecision.FP8 and bool(LAUNCH["prequant"])
            and len(_chunk_slices(q, k, mask, config)) == 1)


def _chunk_slices(q, k, mask: MaskSpec, config: FP8AttentionConfig) -> list[tuple[slice, slice, slice]]:
    """``[(batch rows, query heads, kv heads), ...]``: the chunks of ``LAUNCH["backward_chunks"]``
    for the FP8 backward on pre-quantized operands with at least
    ``LAUNCH["backward_chunk_min_elements"]`` query elements where one pass would raise the memory
    peak (``LAUNCH["backward_chunks_below_peak"]``; one chunk elsewhere). Chunks split the batch
    rows, or with one row (every varlen batch) the kv heads with their query heads, so that each
    chunk's slice of a contiguous ``(B, H, S, D)`` gradient is contiguous."""
    whole = [(slice(None), slice(None), slice(None))]
    n = int(LAUNCH["backward_chunks"])
    if (n <= 1 or config.backward is not BackwardPrecision.FP8 or not LAUNCH["prequant"]
            or q.numel() < LAUNCH["backward_chunk_min_elements"]):
        return whole
    if LAUNCH["backward_chunks_below_peak"] and _one_pass_stays_under_peak(q, k):
        return whole
    b, hq = q.shape[:2]
    hkv = k.shape[1]
    g = hq // hkv
    if b > 1 and not mask.is_varlen:
        return [(slice(lo, hi), slice(None), slice(None)) for lo, hi in _even_ranges(b, n)]
    return [(slice(None), slice(lo * g, hi * g), slice(lo, hi)) for lo, hi in _even_ranges(hkv, n)]


def _one_pass_stays_under_peak(q, k) -> bool:
    """Whether one backward pass over ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Sk, D)`` fits under the
    device's peak of allocated memory so far (CUDA tensors only; False elsewhere). Counted, as an
    upper bound: the seven FP8 copies (Q and dO row- and channel-wise, K row- and channel-wise, V
    row-wise: 4·|Q| + 3·|K| bytes) and the three gradients, all live at once. Host-side allocator
    counters, read once as the allocator's nested dict (``torch.cuda.memory_allocated`` and
    ``max_memory_allocated`` each flatten and sort the whole of it in Python): no device sync. An
    allocator without them (a pluggable one raises) counts as False: the chunks then follow the size
    alone, as before the rule (the same gradients either way)."""
    if q.device.type != "cuda":
        return False
    nq, nk = q.numel(), k.numel()
    one_pass = 4 * nq + 3 * nk + q.element_size() * nq + 2 * k.element_size() * nk
    try:
        counters = torch.cuda.memory_stats_as_nested_dict(q.device)["allocated_bytes"]["all"]
    except (RuntimeError, KeyError):
        return False
    return counters["current"] + one_pass <= counters["peak"]


def _even_ranges(total: int, n: int) -> list[tuple[int, int]]:
    """``min(n, total)`` consecutive ranges covering ``range(total)``, sizes differing by at most one."""
    n = min(n, total)
    bounds = [total * i // n for i in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def _slice_stats(stats, rows: slice, heads: slice):
    """A :class:`.sequence_stats.SequenceStats` (fields ``(n_seq, H, ...)``; or None) restricted to a
    chunk's sequences and heads (contiguous, as the kernels read them)."""
    if stats is None:
        return None
    return type(stats)(*(field[rows, heads].contiguous() for field in stats))


def _chunked_backward(q, k, v, out, lse, dout, scale, mask, config, softcap, sinks, kv_stats, q_stats, chunks):
    """:func:`triton_backward` one chunk at a time (:func:`_chunk_slices`): the three gradients are
    allocated once, whole, and each chunk's launches write their slice of them, so at any time only
    one chunk's FP8 copies are live. Each chunk is a whole (sequence, head) set, the unit of every
    scale and statistic, so the result is the one-pass result bit for bit."""
    alloc = _gradient_alloc(mask)
    dq, dk, dv = (alloc(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    # The sinks' per-row entries, summed once at the end in the one-pass order.
    entries = None if sinks is None else torch.zeros(lse.shape, dtype=torch.float32, device=lse.device)
    for rows, qh, kh in chunks:
        part = _launch(q[rows, qh], k[rows, kh], v[rows, kh], None if out is None else out[rows, qh],
                       lse[rows, qh], dout[rows, qh], scale, mask, config, False, softcap,
                       None if sinks is None else sinks[qh],
                       None if kv_stats is None else tuple(_slice_stats(st, rows, kh) for st in kv_stats),
                       _slice_stats(q_stats, rows, qh), grads=(dq[rows, qh], dk[rows, kh], dv[rows, kh]),
                       sink_entries_only=True)
        if entries is not None:
            entries[rows, qh] = part[5]
    return (dq, dk, dv) if entries is None else (dq, dk, dv, sink_grad(entries))


def triton_backward_row_sums(q, k, v, out, lse, dout, *, scale: float, mask: MaskSpec, config: FP8AttentionConfig,
                             softcap: float | None = None, sinks: torch.Tensor | None = None):
    """Diagnostic variant of :func:`triton_backward` (a separately compiled kernel; the default
    path carries none of this).

    Returns ``(dq, dk, dv, ds_row_sum, p_abs_dp_row_sum)``: the last two ``(B, Hq, Sq)`` fp32 hold,
    per query row, Σ_j dS_ij of the fp32 dS the kernel formed (before quantization; with a cap the
    softmax input's dS̃) and Σ_j P_ij |dP_ij|, the natural size of that sum's terms. Their ratio is
    the zero-row-sum residual: fp32 rounding level in matched mode. With sinks the gradients are
    followed by dsinks, and the row sum includes the sink's entry −P_sink D_i (the extended sum).
    """
    dq, dk, dv, ds_sum, pabs, dsinks = _launch(q, k, v, out, lse, dout, scale, mask, config, True, softcap, sinks)
    shape = q.shape[:-1]
    grads = (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)
    return (*grads, ds_sum.view(shape), pabs.view(shape))
