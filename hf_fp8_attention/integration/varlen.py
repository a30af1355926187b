"""Turn a padded (and possibly packed) batch into one varlen batch, and back.

The FP8 kernels take a dense causal/window mask or packed sequences delimited by
``cu_seqlens`` (see :mod:`hf_fp8_attention.masking`); they never take a dense 4D mask. So padding
and packing are expressed as varlen: every maximal run of valid tokens of one row that belongs to
one packed sequence becomes one sequence of the varlen batch (the FlashAttention-2 approach).

Queries are always the LAST ``q_len`` positions of the key axis (prefill: ``q_len == kv_len``;
KV-cache decode / chunked prefill: ``q_len < kv_len``). Since every query token is also a key,
the valid queries of a sequence are exactly its last valid keys, so the varlen rule "causal
diagonal aligned to each sequence's end" reproduces per-position causal masking for any padding
pattern (left, right, or holes).

Why not ``transformers.modeling_flash_attention_utils._get_unpad_data`` / ``_pad_input``: they are
private (underscore) helpers and cover padding only, not padding combined with per-row packing;
the few tensor ops below do both and are tested in ``tests/test_integration_varlen.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VarlenPlan:
    """Where each token of a padded batch goes in the packed varlen batch.

    ``idx_q``: ``(Tq,)`` int64 indices into the flattened ``(B * q_len)`` query tokens.
    ``idx_k``: ``(Tk,)`` int64 indices into the flattened ``(B * kv_len)`` key tokens.
    ``cu_seqlens_q`` / ``cu_seqlens_k``: ``(n_seq + 1,)`` int32, starting at 0.
    ``has_holes``: some sequence has a padded position between two of its valid tokens (its
    packed token distances then differ from the padded ones, which matters for sliding windows).
    """

    batch: int
    q_len: int
    kv_len: int
    idx_q: torch.Tensor
    idx_k: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    has_holes: bool


def _cumulative(counts: torch.Tensor) -> torch.Tensor:
    """``(n,)`` counts -> ``(n + 1,)`` int32 offsets starting at 0."""
    return torch.nn.functional.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))


def plan_varlen(valid: torch.Tensor, q_len: int, segment_ids: torch.Tensor | None = None) -> VarlenPlan:
    """Plan the varlen batch of a padded/packed batch.

    Args:
        valid: ``(B, kv_len)`` bool, True for real tokens (the 2D padding mask; all True if none).
        q_len: number of queries per row; they are the last ``q_len`` key positions.
        segment_ids: optional ``(B, kv_len)`` integer ids: consecutive valid tokens of one row with
            different ids belong to different packed sequences (never see each other); values on
            padding are ignored, and ids must lie in ``[0, B * kv_len]``.
    """
    if valid.dim() != 2 or valid.dtype != torch.bool:
        raise ValueError(f"plan_varlen: valid must be a 2-D bool tensor, got {valid.dtype} {tuple(valid.shape)}")
    batch, kv_len = valid.shape
    if not 0 < q_len <= kv_len:
        raise ValueError(f"plan_varlen: q_len={q_len} must be in [1, kv_len={kv_len}]")
    device = valid.device
    rows = torch.arange(batch, device=device)[:, None]
    seg = torch.zeros_like(valid, dtype=torch.long) if segment_ids is None else segment_ids.long()
    if seg.shape != valid.shape:
        raise ValueError(f"plan_varlen: segment_ids shape {tuple(seg.shape)} != valid shape {tuple(valid.shape)}")
    # One key per (row, segment): ids lie in [0, B * kv_len], so row * (B * kv_len + 1) + seg is unique.
    group_key = (rows * (batch * kv_len + 1) + seg).reshape(-1)
    idx_k = valid.reshape(-1).nonzero().squeeze(1)
    keys = group_key[idx_k]
    starts = torch.ones_like(keys, dtype=torch.bool)
    starts[1:] = keys[1:] != keys[:-1]
    group = starts.cumsum(0) - 1  # (Tk,) sequence index of each valid key token
    n_seq = int(group[-1]) + 1 if group.numel() else 0
    # A hole: two consecutive valid tokens of one sequence that are not adjacent positions.
    has_holes = bool(((idx_k[1:] - idx_k[:-1] != 1) & ~starts[1:]).any()) if idx_k.numel() > 1 else False
    # Queries: the last q_len positions of each row; each inherits the sequence of its key position.
    group_of_pos = torch.full((batch * kv_len,), -1, dtype=torch.long, device=device)
    group_of_pos[idx_k] = group
    q_group = group_of_pos.view(batch, kv_len)[:, kv_len - q_len :].reshape(-1)
    idx_q = (q_group >= 0).nonzero().squeeze(1)
    counts_q = torch.bincount(q_group[idx_q], minlength=n_seq)
    cu_seqlens_q = _cumulative(counts_q)
    # Every key position a query (q_len == kv_len): the same offsets, one tensor for both (the forward
    # then computes Q's statistics in the K/V launch: kernels.forward.q_stats_beside_kv).
    cu_seqlens_k = cu_seqlens_q if q_len == kv_len else _cumulative(torch.bincount(group, minlength=n_seq))
    return VarlenPlan(
        batch=batch,
        q_len=q_len,
        kv_len=kv_len,
        idx_q=idx_q,
        idx_k=idx_k,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        has_holes=has_holes,
    )


def pack(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``(B, H, S, D)`` -> ``(1, H, T, D)``: the tokens at ``indices`` of the flattened ``(B * S)`` axis."""
    b, h, s, d = x.shape
    tokens = x.transpose(1, 2).reshape(b * s, h, d).index_select(0, indices)  # (T, H, D)
    return tokens.transpose(0, 1).unsqueeze(0)


def unpack(x: torch.Tensor, indices: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """``(1, H, T, D)`` -> ``(B, S, H, D)``: scatter back; positions not in ``indices`` are 0.

    Differentiable: the gradient flows to the packed tokens only (padding gets none).
    """
    _, h, _, d = x.shape
    tokens = x.squeeze(0).transpose(0, 1)  # (T, H, D)
    out = tokens.new_zeros(batch * seq_len, h, d).index_copy(0, indices, tokens)
    return out.view(batch, seq_len, h, d)


def segments_from_positions(position_ids: torch.Tensor, valid: torch.Tensor | None,
                            batch: int | None = None) -> torch.Tensor | None:
    """Packed-sequence ids from ``position_ids`` restarting, looking at valid tokens only.

    A new sequence starts wherever a valid token's position is not the previous valid token's
    position + 1 (in the same row), as Transformers' ``find_packed_sequence_indices`` decides for
    unpadded rows. Skipping padding matters: left-padded ``generate`` gives padding arbitrary
    positions, and a hole in the mask must not split a sequence whose positions continue over it.

    Args:
        position_ids: ``(B, S)`` integer positions (``(1, S)`` is broadcast over the batch).
        valid: ``(B, S)`` bool, True for real tokens; None when every token is (``batch`` rows).
            Then the valid tokens' indices are known without reading the mask: the check reads the
            device once (whether any position restarts) instead of twice. A read drains the GPU's
            queue, and in a training step each one left the GPU idle for 0.3-0.45 ms.
    Returns:
        ``(B, S)`` int64 ids (distinct for distinct sequences; arbitrary on padding), or None when
        no row holds more than one sequence.
    """
    if valid is None:
        if batch is None:
            raise ValueError("segments_from_positions: give valid, or batch when every token is valid")
        seq_len, device = position_ids.shape[-1], position_ids.device
        idx = torch.arange(batch * seq_len, device=device)
    else:
        (batch, seq_len), device = valid.shape, valid.device
        idx = valid.reshape(-1).nonzero().squeeze(1)
    pos = position_ids.to(device).expand(batch, seq_len).reshape(-1)
    if idx.numel() < 2:
        return None
    p, rows = pos[idx], idx // seq_len
    same_row = rows[1:] == rows[:-1]
    restart = same_row & (p[1:] != p[:-1] + 1)
    if not bool(restart.any()):
        return None
    starts = torch.ones_like(p, dtype=torch.bool)
    starts[1:] = restart | ~same_row
    segments = torch.zeros(batch * seq_len, dtype=torch.long, device=device)
    segments[idx] = starts.cumsum(0)
    return segments.view(batch, seq_len)


def plan_contiguous_padding(valid: torch.Tensor, q_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A varlen layout of a padded batch built without reading any value on the host.

    For ``torch.compile`` (``fullgraph=True``): :func:`plan_varlen` selects the valid tokens, a
    data-dependent shape. Here the whole ``(B * len)`` token axis is kept, and every row becomes
    three sequences, ``[left padding | valid tokens | right padding]`` (any of them may be empty),
    so ``cu_seqlens`` have the static size ``3 * B + 1``. Padding tokens only see padding; their
    outputs are discarded by the caller (``query_valid``). The valid sequence is the same as in
    :func:`plan_varlen`, so the FP8 result is too (tiles restart at every sequence start).

    Assumes each row's valid tokens are contiguous (left or right padding, as tokenizers pad): a
    hole inside a row is padding inside the middle sequence here (it cannot be checked without a
    host read). Eager calls use :func:`plan_varlen`, which handles holes.

    Args:
        valid: ``(B, kv_len)`` bool.
        q_len: the queries are the last ``q_len`` key positions.
    Returns:
        ``cu_seqlens_q (3B + 1,)``, ``cu_seqlens_k (3B + 1,)`` int32 over the flattened
        ``(B * q_len)`` / ``(B * kv_len)`` axes, and ``query_valid (B, q_len)`` bool.
    """
    batch, kv_len = valid.shape
    pos = torch.arange(kv_len, device=valid.device)
    first = torch.where(valid, pos, kv_len).amin(1)  # kv_len for a row of padding only
    end = torch.maximum(torch.where(valid, pos + 1, 0).amax(1), first)
    ends = torch.stack([first, end, torch.full_like(first, kv_len)], 1)  # (B, 3) row-local sequence ends
    rows = torch.arange(batch, device=valid.device)[:, None]
    cu_k = ends + rows * kv_len
    cu_q = (ends - (kv_len - q_len)).clamp(min=0) + rows * q_len
    zero = torch.zeros(1, dtype=torch.int32, device=valid.device)
    return (torch.cat([zero, cu_q.reshape(-1).to(torch.int32)]), torch.cat([zero, cu_k.reshape(-1).to(torch.int32)]),
            valid[:, kv_len - q_len:])


def flatten_batch(x: torch.Tensor) -> torch.Tensor:
    """``(B, H, S, D)`` -> ``(1, H, B * S, D)``: all tokens, row after row (no selection)."""
    b, h, s, d = x.shape
    return x.transpose(0, 1).reshape(h, b * s, d).unsqueeze(0)


def unflatten_batch(x: torch.Tensor, batch: int, keep: torch.Tensor) -> torch.Tensor:
    """``(1, H, B * S, D)`` -> ``(B, S, H, D)`` with the tokens where ``keep (B, S)`` is False set to 0."""
    _, h, t, d = x.shape
    out = x.squeeze(0).view(h, batch, t // batch, d).permute(1, 2, 0, 3)
    return torch.where(keep[:, :, None, None], out, out.new_zeros(()))
