"""Per-(sequence, head) statistics of an attention operand, for the recipe's sequence-wide scales
and the QKᵀ transforms (docs/design.md, "Recipes").

For ``x (B, H, S, D)`` (varlen: ``B == 1`` and cu_seqlens delimit the sequences) two launches give,
per (sequence, head):

- ``col_amax (n_seq, H, DP)``: max over the sequence's tokens of |x| per channel (the channel-wise
  scales of the token contractions, granularity ``channel``; its max over channels for ``head``);
- ``shift (n_seq, H, DP)``: what the row-wise copy subtracts after the optional rotation: the
  rotated channel mean μH (K-smoothing), or zeros;
- ``row_amax (n_seq, H)``: max over tokens and channels of |xH − shift| (the ``head`` granularity
  of the head-dim contractions), exact from the per-channel extremes:
  ``max_c max(max_t (xH)_tc − shift_c, shift_c − min_t (xH)_tc)`` (subtracting one number is
  monotonic in fp32, so this equals the amax of the values the quantization kernel forms).

Launch 1 (:func:`_partials_kernel`) reduces chunks of ``CHUNK`` tokens to four vectors (max and min of
the rotated rows, amax and sum of the raw rows); launch 2 (:func:`_finish_kernel`) folds each
sequence's chunks in order. No atomics: the statistics, and so the codes, are the same on every
call (the backward re-quantizes Q and K exactly as the forward did).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .quantize import COMPILE_OPTIONS, abs_max, dot_dtype, hadamard_operand, max_nan, padded_head_dim, rotate_rows
from .tiles import block_of_sequence, cdiv

# Tokens one partials program reduces, and how many it loads at a time.
CHUNK = 256
SUB_CHUNK = 32


@triton.jit
def _min_nan(a, b):
    """Combine for ``tl.reduce``: minimum that keeps NaN (the twin of :func:`.quantize.max_nan`)."""
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _partials_kernel(
    x_ptr, sxb, sxh, sxs, sxd, h_ptr, part_ptr,  # part: (n_slots, B·H, 4, BLOCK_D) fp32
    cu_ptr, chunk_off_ptr, H, S, D, N_BH,
    CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCK_D: tl.constexpr, ROTATE: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    """One program per (chunk of CHUNK tokens of one sequence, batch·head): the chunk's max and min of
    the (rotated) rows and amax and sum of the raw rows, per channel."""
    chunk = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    start, length, slot, bb = block_of_sequence(b, chunk, cu_ptr, chunk_off_ptr, S, IS_VARLEN)
    if chunk * CHUNK >= length:
        return
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    base = x_ptr + bb.to(tl.int64) * sxb + h * sxh
    hi = tl.full([BLOCK_D], float("-inf"), tl.float32)
    lo = tl.full([BLOCK_D], float("inf"), tl.float32)
    amax = tl.zeros([BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_D], tl.float32)
    for c in range(0, CHUNK, SUB):
        offs_s = chunk * CHUNK + c + tl.arange(0, SUB)
        s_ok = offs_s < length
        ptrs = base + (start + offs_s)[:, None].to(tl.int64) * sxs + offs_d[None, :] * sxd
        x = tl.load(ptrs, mask=s_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        amax = max_nan(amax, abs_max(x, 0))
        total += tl.sum(x, 0)
        if ROTATE:
            y = rotate_rows(x, h_ptr, BLOCK_D, DOT_DTYPE)
        else:
            y = x
        hi = max_nan(hi, tl.reduce(tl.where(s_ok[:, None], y, float("-inf")), 0, max_nan))
        lo = _min_nan(lo, tl.reduce(tl.where(s_ok[:, None], y, float("inf")), 0, _min_nan))
    out = part_ptr + (slot.to(tl.int64) * N_BH + bb * H + h) * 4 * BLOCK_D + offs_d
    tl.store(out, hi)
    tl.store(out + BLOCK_D, lo)
    tl.store(out + 2 * BLOCK_D, amax)
    tl.store(out + 3 * BLOCK_D, total)


@triton.jit
def _finish_kernel(
    part_ptr, h_ptr, shift_ptr, row_amax_ptr, col_amax_ptr,
    cu_ptr, chunk_off_ptr, H, S, N_BH,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, ROTATE: tl.constexpr, SMOOTH: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """One program per (sequence, head): fold the sequence's chunks in order and write its
    statistics (module docstring). An empty sequence gets zeros."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    if IS_VARLEN:
        length = tl.load(cu_ptr + seq + 1) - tl.load(cu_ptr + seq)
        slot0 = tl.load(chunk_off_ptr + seq)
        bh = h
    else:
        length = S
        slot0 = 0
        bh = seq * H + h
    offs_d = tl.arange(0, BLOCK_D)
    hi = tl.full([BLOCK_D], float("-inf"), tl.float32)
    lo = tl.full([BLOCK_D], float("inf"), tl.float32)
    amax = tl.zeros([BLOCK_D], tl.float32)
    total = tl.zeros([BLOCK_D], tl.float32)
    for c in range(0, tl.cdiv(length, CHUNK)):
        base = part_ptr + ((slot0 + c).to(tl.int64) * N_BH + bh) * 4 * BLOCK_D + offs_d
        hi = max_nan(hi, tl.load(base))
        lo = _min_nan(lo, tl.load(base + BLOCK_D))
        amax = max_nan(amax, tl.load(base + 2 * BLOCK_D))
        total += tl.load(base + 3 * BLOCK_D)
    shift = tl.zeros([BLOCK_D], tl.float32)
    if SMOOTH:
        mean = total / tl.maximum(length, 1).to(tl.float32)
        if ROTATE:
            # μH as a broadcast sum: one (BLOCK_D,) vector times the matrix, fp32 throughout.
            hm = tl.load(h_ptr + offs_d[:, None] * BLOCK_D + offs_d[None, :])
            shift = tl.sum(mean[:, None] * hm, 0)
        else:
            shift = mean
    ext = max_nan(hi - shift, shift - lo)
    row_amax = tl.where(length > 0, tl.reduce(ext, 0, max_nan), 0.0)
    out = (seq * H + h).to(tl.int64)
    tl.store(shift_ptr + out * BLOCK_D + offs_d, shift)
    tl.store(row_amax_ptr + out, row_amax)
    tl.store(col_amax_ptr + out * BLOCK_D + offs_d, amax)


class SequenceStats(NamedTuple):
    """Statistics of one operand, per (sequence, head): see the module docstring."""

    shift: torch.Tensor  # (n_seq, H, DP) fp32
    row_amax: torch.Tensor  # (n_seq, H) fp32
    col_amax: torch.Tensor  # (n_seq, H, DP) fp32


def sequence_stats(
    x: torch.Tensor,
    *,
    rotate: bool,
    smooth: bool,
    row_amax: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> SequenceStats:
    """:class:`SequenceStats` of ``x (B, H, S, D)`` (any strides; varlen: ``B == 1`` and int32
    ``cu_seqlens (n_seq + 1,)`` with ``max_seqlen`` its longest sequence). ``rotate`` / ``smooth``:
    the row-wise copy's transforms. ``row_amax=False`` skips the rotation of every row in the first
    launch when only the shift and the channel amax are wanted (the returned ``row_amax`` is then
    meaningless)."""
    bsz, heads, seq, d = x.shape
    dp = padded_head_dim(d)
    varlen = cu_seqlens is not None
    dev = x.device
    if varlen:
        n_seq = cu_seqlens.numel() - 1
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
        n_chunks = (lens + CHUNK - 1) // CHUNK
        chunk_off = (torch.cumsum(n_chunks, 0) - n_chunks).to(torch.int32)
        n_slots = seq // CHUNK + n_seq
        max_len = int(max_seqlen) if max_seqlen is not None else int(lens.max()) if n_seq else 0
    else:
        n_seq, chunk_off, n_slots, max_len = bsz, x, cdiv(max(seq, 1), CHUNK), seq
    h = hadamard_operand(d, dev) if rotate else x
    part = torch.empty(max(n_slots, 1), bsz * heads, 4, dp, dtype=torch.float32, device=dev)
    shift = torch.empty(n_seq, heads, dp, dtype=torch.float32, device=dev)
    row_max = torch.empty(n_seq, heads, dtype=torch.float32, device=dev)
    col_amax = torch.empty(n_seq, heads, dp, dtype=torch.float32, device=dev)
    if n_seq == 0:
        return SequenceStats(shift, row_max, col_amax)
    cu = cu_seqlens if varlen else x
    if max_len > 0:
        _partials_kernel[(cdiv(max_len, CHUNK), n_seq * heads)](
            x, *x.stride(), h, part, cu, chunk_off, heads, seq, d, bsz * heads,
            CHUNK=CHUNK, SUB=SUB_CHUNK, BLOCK_D=dp, ROTATE=rotate and row_amax, IS_VARLEN=varlen,
            DOT_DTYPE=dot_dtype(x),
            num_warps=4, **COMPILE_OPTIONS,
        )
    _finish_kernel[(n_seq, heads)](
        part, h, shift, row_max, col_amax, cu, chunk_off, heads, seq, bsz * heads,
        CHUNK=CHUNK, BLOCK_D=dp, ROTATE=rotate, SMOOTH=smooth, IS_VARLEN=varlen, num_warps=4, **COMPILE_OPTIONS,
    )
    return SequenceStats(shift, row_max, col_amax)
