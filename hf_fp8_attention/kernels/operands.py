"""The FP8 copies of Q, K, V and dO that a recipe asks for, and the statistics they need.

One place maps an :class:`~hf_fp8_attention.config.FP8AttentionConfig` onto the options of the
quantization kernel (:class:`.quantize.Copies`) for each operand and matmul role, so the forward
and the backward quantize Q and K for QKᵀ identically (the backward's logits are the forward's):

    role      copy     used by                          options from the config
    Q, K      rows     S = QKᵀ (F1, B1)                 rotate (hadamard), K: shift (smooth_k),
                                                        one scale per token or per (sequence, head)
    dO, V     rows     dP = dO Vᵀ (B2)                  per token or per (sequence, head)
    V, dO,    columns  PV (F2), Pᵀ dO (B3), dS K (B4),  channel_scales: per tile / channel / head
    K, Q               dSᵀ Q (B5)
"""
from __future__ import annotations

import functools

from ..config import FP8AttentionConfig, Granularity, PScaling
from ..transforms import hadamard_block
from . import one_read_prep
from .quantize import Copies, quantize_operands
from .sequence_stats import SequenceStats, StatsNeed, sequence_stats

COL_MODES = {Granularity.TILE: 0, Granularity.CHANNEL: 1, Granularity.HEAD: 2}


@functools.lru_cache(maxsize=256)  # (per recipe and role: a few entries; a call's host time, not a tensor)
def copies_for(role: str, config: FP8AttentionConfig, *, row: bool, col: bool) -> Copies:
    """The copies of operand ``role`` ("q", "k", "v" or "do") to emit (``row`` / ``col``)."""
    fmt = {"q": config.q_format, "k": config.k_format, "v": config.v_format, "do": config.do_format}[role]
    row_gran = config.qdo_scales if role in ("q", "do") else config.kv_scales
    return Copies(
        row=row, col=col, fmt=fmt,
        rotate=config.hadamard and role in ("q", "k"),
        shift=config.smooth_k and role == "k",
        row_head=row_gran is Granularity.HEAD,
        col_mode=COL_MODES[config.channel_scales],
    )


def stats_need(copies: Copies) -> StatsNeed:
    """The sequence statistics ``copies`` need (for copies with ``needs_stats``)."""
    return StatsNeed(rotate=copies.row and copies.rotate, smooth=copies.row and copies.shift,
                     row_amax=copies.row and copies.row_head, col_amax=copies.col and copies.col_mode != 0)


def backward_kv_copies(config: FP8AttentionConfig) -> tuple[Copies, Copies]:
    """The copies of K and V the FP8 backward quantizes: K row-wise (B1) and channel-wise (B4), V
    row-wise (B2)."""
    return copies_for("k", config, row=True, col=True), copies_for("v", config, row=True, col=False)


def backward_q_copies(config: FP8AttentionConfig) -> Copies:
    """The copies of Q the FP8 backward quantizes: row-wise (B1) and channel-wise (B5)."""
    return copies_for("q", config, row=True, col=True)


@functools.lru_cache(maxsize=256)
def operand_needs(copies: tuple[Copies, ...], also: tuple[Copies, ...] | None = None) -> tuple[StatsNeed | None, ...]:
    """Per operand the statistics its ``copies`` (and its ``also`` copies, see :func:`stats_for`)
    need, or None where they need none."""
    wanted = [[c] + ([also[i]] if also is not None else []) for i, c in enumerate(copies)]
    return tuple(StatsNeed(*map(any, zip(*(stats_need(c) for c in cs if c.needs_stats))))
                 if any(c.needs_stats for c in cs) else None for cs in wanted)


def stats_for(xs: tuple, copies: tuple[Copies, ...], cu_seqlens=None, max_seqlen: int | None = None,
              also: tuple[Copies, ...] | None = None) -> tuple[SequenceStats | None, ...]:
    """Per operand of ``xs`` (one to three tensors ``(B, H, S, D)`` sharing B, S, D and dtype, as
    :func:`.sequence_stats.sequence_stats` takes them) its :class:`SequenceStats` when its
    ``copies`` need them, else None; the operands that need them share one launch. ``cu_seqlens``
    (int32) and ``max_seqlen``: the token axis of a packed batch. ``also``: per operand more copies
    whose statistics to compute in the same launch (the backward's, for the forward to hand over);
    each statistic comes out the same whichever others are computed beside it."""
    needs = operand_needs(copies, also)
    needed = [i for i, n in enumerate(needs) if n is not None]
    out: list[SequenceStats | None] = [None] * len(xs)
    if needed:
        stats = sequence_stats(tuple(xs[i] for i in needed), tuple(needs[i] for i in needed),
                               cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        for i, st in zip(needed, stats):
            out[i] = st
    return tuple(out)


def stats_then_copies(xs: tuple, copies: tuple[Copies, ...], *, block: int, pow2: bool = False, cu_seqlens=None,
                      max_seqlen: int | None = None, also: tuple[Copies, ...] | None = None,
                      beside: tuple | None = None):
    """``stats_for(xs, copies, cu_seqlens, max_seqlen, also)``, then the copies of
    :func:`.quantize.quantize_operands` from those statistics (``block``, ``pow2``: its arguments).
    Returns ``(stats, copies)`` as the two give them, the same bits either way; in one launch that
    reads each input from HBM once where :func:`.one_read_prep.one_read_reason` allows (a packed
    batch needs ``max_seqlen`` for that).

    ``beside``: ``(x, copies, also)`` of one more operand on the same token axis (its own head count
    allowed: the forward's Q beside K and V) whose statistics alone are wanted; they come last in
    ``stats``, computed in the statistics launch of ``xs`` (in one of their own where the one-read
    launch runs), the same bits either way."""
    max_len = xs[0].shape[2] if cu_seqlens is None else max_seqlen
    if one_read_prep.ONE_READ and max_len is not None:  # (its switch first: host time when off)
        needs = operand_needs(copies, also)
        if one_read_prep.one_read_reason(xs, needs, block, int(max_len)) is None:
            stats, outs = one_read_prep.one_read_operands(xs, copies, needs, block=block, pow2=pow2,
                                                          cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
            if beside is not None:
                x_b, copies_b, also_b = beside
                stats = (*stats, *stats_for((x_b, ), (copies_b, ), cu_seqlens, max_seqlen,
                                            also=None if also_b is None else (also_b, )))
            return stats, outs
    all_xs = xs
    if beside is not None:  # (an operand's own copies as its ``also`` add nothing to its needs)
        x_b, copies_b, also_b = beside
        all_xs = (*xs, x_b)
        also = (*(also or copies), also_b or copies_b)  # (before ``copies`` gains the operand)
        copies = (*copies, copies_b)
    stats = stats_for(all_xs, copies, cu_seqlens, max_seqlen, also=also)
    return stats, quantize_operands(xs, copies[:len(xs)], block=block, pow2=pow2, cu_seqlens=cu_seqlens,
                                    max_seqlen=max_seqlen, stats=stats[:len(xs)])


def logit_factor(config: FP8AttentionConfig, head_dim: int) -> float:
    """What the softmax scale is multiplied by for the rotated QKᵀ (1/block of the ±1 Hadamard)."""
    return 1.0 / hadamard_block(head_dim) if config.hadamard else 1.0


# What the backward's scale settings must be for no scale to be shared over a block of tokens:
# (field, test of its value). Per-token row scales are per token, so they never are.
BLOCK_FREE_FIELDS = (
    ("channel_scales", lambda value: value is not Granularity.TILE),  # per sequence or head
    ("p_scales", lambda value: value is PScaling.FIXED),
    ("ds_scales", lambda value: value is Granularity.HEAD),
)


def block_shared_fields(config: FP8AttentionConfig) -> list[str]:
    """The fields of ``config`` whose scales are shared over a block of tokens (``BLOCK_FREE_FIELDS``),
    as ``name='value'`` phrases; empty for a block-free backward."""
    return [f"{name}={getattr(config, name).value!r}" for name, ok in BLOCK_FREE_FIELDS
            if not ok(getattr(config, name))]


def backward_block_free(config: FP8AttentionConfig) -> bool:
    """True when no backward scale is shared over a block of tokens (channel scales per sequence or
    head, P on the fixed grid, dS per head): the backward's numerics then do not depend on
    ``block_q`` / ``block_k``, so the kernels may tile freely."""
    return not block_shared_fields(config)


def tile_recipe(config: FP8AttentionConfig) -> bool:
    """True for the first release's recipe: per-token and per-tile scales, no transforms."""
    return (config.qdo_scales is Granularity.TOKEN and config.kv_scales is Granularity.TOKEN
            and config.channel_scales is Granularity.TILE and config.p_scales is PScaling.TILE
            and config.ds_scales is Granularity.TILE and not config.smooth_k and not config.hadamard)
