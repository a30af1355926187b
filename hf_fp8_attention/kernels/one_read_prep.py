"""An operand pair's sequence statistics and FP8 copies in one launch, each chunk read from HBM once.

The recipes' copies need statistics of the whole sequence (K's mean, channel and per-head amax:
:mod:`.sequence_stats`) before any code is cast, so the two-launch path reads every input twice:
once for the statistics, once for the copies (:func:`.quantize.quantize_operands`). Here one
program per (chunk of ``sequence_stats.CHUNK`` tokens, sequence·head, operand) reduces its chunk
to partials as the statistics launch does, counts it done, waits until the program that counted
its (sequence, head, operand)'s last chunk has folded them and published the statistics, then
makes the copies of the same chunk, which it read a moment before: the second read comes from L2.

The wait is safe because programs take their work by ticket (one atomic counter), in order, one
sequence's chunks after the other's: when a program waits, every chunk before its own has
started, and only the sequence being handed out can have chunks not yet started. A sequence of
at most as many chunks as the GPU has SMs then always finishes (each SM holds at least one
program), and with it the programs waiting on it. Longer sequences, and the interpreter (which
runs programs one at a time), take the two launches.

Both paths give the same statistics and copies: the partials are :func:`.sequence_stats.
chunk_partials` on the statistics launch's warps, the copies :func:`.quantize.quantize_block`,
whose values depend on the statistics and the element alone (bit-identity on the GPU:
``tests/gpu/test_one_read_prep_kernel.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch as launch_kernel
from .quantize import Copies, interpreting, padded_head_dim, plan_quantize, quantize_block
from .sequence_stats import CHUNK, FOLD_IN_PARTIALS, SequenceStats, StatsNeed, chunk_partials, stats_launch, \
    wait_for_statistics
from .tiles import cdiv, on_cuda, sm_count

# The one-read launch where it applies (one_read_reason); off: always the two launches. Off: the same
# bits, but on the H100 the forward's K/V step took 231 against 192 us at 2 x 8k tokens and the op
# 0.4-3.8% longer: the copies on the statistics' 2 warps, one slice in flight per program, run slower
# than the quantization launch's pipelined 8 (benchmarks/NOTES.md, "Quantization").
ONE_READ = False
# The copies' slices in the one-read launch, which runs on the statistics launch's warps (2 with a
# rotation, 4 without): 16-token rows and 16-channel groups. Offline (sm_90a) the forward's K/V
# launch then holds 178-180 registers, as the statistics launch alone (176); 32-token rows took 255
# and spilled.
ONE_READ_LAUNCH = {"row_chunk": 16, "col_group": 16, "num_warps": None, "row_stages": None, "tiles": None}


@triton.jit
def _one_read_kernel(
    x_ptr, sxb, sxh, sxs, sxd, y_ptr, syb, syh, sys_, syd, z_ptr, szb, szh, szs, szd, h_ptr, part_ptr, cu_ptr,
    chunk_off_ptr, H, HY, HZ, S, D, N_BATCH, N_SEQ, N_SLOTS,  # the statistics launch's (no Z; HY == H)
    sync_ptr,  # int32 (1 + 2·N_SEQ·H,) zeros: the ticket, then one counter per (operand, sequence·head)
    x_out_ptr, y_out_ptr, z_out_ptr, N_CHUNKS, N_ROWS,
    qx_row_codes_ptr, qx_row_scales_ptr, qx_col_codes_ptr, qx_col_scales_ptr,  # the copies' (quantize_kernel)
    qy_row_codes_ptr, qy_row_scales_ptr, qy_col_codes_ptr, qy_col_scales_ptr,
    x_shift_ptr, x_row_amax_ptr, x_col_amax_ptr, y_shift_ptr, y_row_amax_ptr, y_col_amax_ptr,
    qcu_ptr, tile_off_ptr, S_PAD, NT,
    CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_D: tl.constexpr, IS_VARLEN: tl.constexpr,
    DOT_DTYPE: tl.constexpr, ELEMENTWISE: tl.constexpr, STAGES: tl.constexpr, TRANSPOSED: tl.constexpr,
    SX_ROTATE: tl.constexpr, SX_EXT: tl.constexpr, SX_SUM: tl.constexpr, SX_AMAX: tl.constexpr,
    SY_ROTATE: tl.constexpr, SY_EXT: tl.constexpr, SY_SUM: tl.constexpr, SY_AMAX: tl.constexpr,
    SX_MEAN_ROTATE: tl.constexpr, SY_MEAN_ROTATE: tl.constexpr, MEAN_COLS: tl.constexpr, FOLD_LOADS: tl.constexpr,
    BLOCK_S: tl.constexpr, ROW_CHUNK: tl.constexpr, COL_GROUP: tl.constexpr, POW2: tl.constexpr, CVT: tl.constexpr,
    X_ROW: tl.constexpr, X_COL: tl.constexpr, X_FMAX: tl.constexpr, X_DTYPE: tl.constexpr,
    X_MANT: tl.constexpr, X_SUB_MAGIC: tl.constexpr, X_SUB_MIN: tl.constexpr,
    X_ROTATE: tl.constexpr, X_SHIFT: tl.constexpr, X_ROW_HEAD: tl.constexpr, X_COL_MODE: tl.constexpr,
    Y_ROW: tl.constexpr, Y_COL: tl.constexpr, Y_FMAX: tl.constexpr, Y_DTYPE: tl.constexpr,
    Y_MANT: tl.constexpr, Y_SUB_MAGIC: tl.constexpr, Y_SUB_MIN: tl.constexpr,
    Y_ROTATE: tl.constexpr, Y_SHIFT: tl.constexpr, Y_ROW_HEAD: tl.constexpr, Y_COL_MODE: tl.constexpr,
    ROW_STAGES: tl.constexpr, TILES: tl.constexpr, COL_FMA: tl.constexpr, COL_PREFETCH: tl.constexpr,
    X_COL_PV: tl.constexpr = False, Y_COL_PV: tl.constexpr = False,
):
    """One program per (chunk, sequence·head row, operand), N_CHUNKS · N_ROWS · operands of them,
    each taking its chunk by ticket (module docstring); X_*/Y_* are the copies' options (as
    :func:`.quantize.quantize_kernel`'s), SX_*/SY_* the statistics' (``_partials_kernel``'s X_*/Y_*)."""
    item = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    chunk = item % N_CHUNKS
    bh = (item // N_CHUNKS) % N_ROWS
    op = item // (N_CHUNKS * N_ROWS)
    count_ptr = sync_ptr + 1
    length = chunk_partials(x_ptr, sxb, sxh, sxs, sxd, y_ptr, syb, syh, sys_, syd, z_ptr, szb, szh, szs, szd, h_ptr,
                            part_ptr, cu_ptr, chunk_off_ptr, chunk, bh, op, H, H, H, S, D, N_BATCH, N_SEQ, N_SLOTS,
                            count_ptr, x_out_ptr, y_out_ptr, z_out_ptr, CHUNK, SUB, BLOCK_D, IS_VARLEN, DOT_DTYPE,
                            ELEMENTWISE, STAGES, TRANSPOSED, SX_ROTATE, SX_EXT, SX_SUM, SX_AMAX, SY_ROTATE, SY_EXT,
                            SY_SUM, SY_AMAX, False, False, False, False, True, SX_MEAN_ROTATE, SY_MEAN_ROTATE, False,
                            MEAN_COLS, FOLD_LOADS, True, False)
    if chunk * CHUNK < length:
        wait_for_statistics(count_ptr, op, bh, length, H, H, H, N_SEQ, CHUNK)
        quantize_block(
            chunk * TILES, bh, op,
            x_ptr, sxb, sxh, sxs, sxd, qx_row_codes_ptr, qx_row_scales_ptr, qx_col_codes_ptr, qx_col_scales_ptr,
            y_ptr, syb, syh, sys_, syd, qy_row_codes_ptr, qy_row_scales_ptr, qy_col_codes_ptr, qy_col_scales_ptr,
            x_shift_ptr, x_row_amax_ptr, x_col_amax_ptr, y_shift_ptr, y_row_amax_ptr, y_col_amax_ptr,
            h_ptr, qcu_ptr, tile_off_ptr, H, S, D, S_PAD, NT,
            BLOCK_S, BLOCK_D, ROW_CHUNK, COL_GROUP, POW2, IS_VARLEN, CVT,
            X_ROW, X_COL, X_FMAX, X_DTYPE, X_MANT, X_SUB_MAGIC, X_SUB_MIN, X_ROTATE, X_SHIFT, X_ROW_HEAD, X_COL_MODE,
            Y_ROW, Y_COL, Y_FMAX, Y_DTYPE, Y_MANT, Y_SUB_MAGIC, Y_SUB_MIN, Y_ROTATE, Y_SHIFT, Y_ROW_HEAD, Y_COL_MODE,
            DOT_DTYPE, ROW_STAGES, TILES, COL_FMA, COL_PREFETCH, X_COL_PV, Y_COL_PV,
        )


def one_read_reason(xs: tuple[torch.Tensor, ...], needs: tuple[StatsNeed | None, ...], block: int,
                    max_len: int) -> str | None:
    """Why ``xs`` (one or two ``(B, H, S, D)`` tensors, sequences of at most ``max_len`` tokens)
    take the two launches instead of the one-read launch, or None where the one-read launch runs.
    ``needs``: per operand the statistics its copies need (None: none)."""
    x = xs[0]
    if not ONE_READ:
        return "one_read_prep.ONE_READ is off"
    if interpreting():
        return "the interpreter runs programs one at a time"
    if not on_cuda(x.device):
        return "not a CUDA tensor"
    if any(n is None for n in needs):
        return "an operand needs no sequence statistics"
    if padded_head_dim(x.shape[-1]) > 128:
        return "head dim above 128"
    if not FOLD_IN_PARTIALS:
        return "sequence_stats.FOLD_IN_PARTIALS is off"
    if block > CHUNK or CHUNK % block:
        return f"tiles of {block} tokens do not divide the statistics' chunks of {CHUNK}"
    if x.shape[0] * x.shape[1] == 0 or max_len <= 0:
        return "no tokens"
    if cdiv(max_len, CHUNK) > sm_count(x.device.index):
        return f"sequences of more than {sm_count(x.device.index)} chunks of {CHUNK} tokens"
    return None


def one_read_operands(
    xs: tuple[torch.Tensor, ...],
    copies: tuple[Copies, ...],
    needs: tuple[StatsNeed, ...],
    *,
    block: int,
    pow2: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> tuple[tuple[SequenceStats, ...], list[tuple]]:
    """``sequence_stats(xs, needs)`` and then ``quantize_operands(xs, copies, stats=those)`` (see
    there for the arguments and what each returns), in one launch. The caller checked
    :func:`one_read_reason`."""
    st = stats_launch(xs, needs, cu_seqlens, max_seqlen)
    plan = plan_quantize(xs, copies, block=block, pow2=pow2, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
                         stats=st.results, launch=ONE_READ_LAUNCH, fn="one_read_operands")
    n_chunks, n_rows, n_ops = st.grid
    sync = torch.zeros(1 + st.counters, dtype=torch.int32, device=xs[0].device)
    # Each operand's copies' buffers follow its input and four strides (which the statistics'
    # arguments carry, as they do the Hadamard matrix and the sizes but S_PAD and NT).
    copies_x, copies_y = plan.operands[0][5:], plan.operands[1][5:]
    stats_xy = (*plan.stats[0], *plan.stats[1])
    packing = (*plan.packing, *plan.sizes[3:])
    stats_meta = {("S" + k if k[:2] in ("X_", "Y_") else k): v for k, v in st.meta.items() if k[:2] != "Z_"}
    copies_meta = {k: v for k, v in plan.meta.items()
                   if k not in stats_meta and k not in ("num_warps", "maxnreg")}
    copies_meta["TILES"] = CHUNK // block
    launch_kernel(_one_read_kernel, (n_chunks * n_rows * n_ops,), *st.args, sync, *st.outs, n_chunks, n_rows,
                  *copies_x, *copies_y, *stats_xy, *packing, **stats_meta, **copies_meta)
    return st.results, plan.outs
