"""Tile, mask and sequence helpers shared by the forward and backward kernels.

- :func:`visible`: which (query, key) pairs of a tile attend (:mod:`..masking`'s rules);
- :func:`key_tile_range` (the rule), :func:`key_tiles` and its transpose :func:`query_tiles`: which
  tiles a tile visits, and which of them need no mask (split by :func:`split_tiles`);
- :func:`seq_bounds`, :func:`tile_slot`: a (packed or dense) sequence's token range and the index of
  its channel-wise scale tiles;
- host-side grid arithmetic, packed sequences' block offsets and the compiled-block limit.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..identity_cache import IdentityCache


@triton.jit
def split_tiles(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Tiles of BLOCK positions (tile t = [t·BLOCK, (t+1)·BLOCK)) covering the positions [lo, hi),
    split around those lying wholly inside [full_lo, full_hi): returns t_lo <= f_lo <= f_hi <= t_hi;
    [f_lo, f_hi) are the interior tiles, [t_lo, f_lo) and [f_hi, t_hi) the boundary tiles. Integer
    scalars; any bound may be negative and either range empty."""
    t_lo = tl.maximum(lo, 0) // BLOCK
    t_hi = tl.maximum(tl.cdiv(tl.maximum(hi, 0), BLOCK), t_lo)
    f_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(full_lo, 0), BLOCK), t_lo), t_hi)
    f_hi = tl.minimum(tl.maximum(tl.maximum(full_hi, 0) // BLOCK, f_lo), t_hi)
    return t_lo, f_lo, f_hi, t_hi


@triton.jit
def visible(ok, pos_q, key, window, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Which (query, key) pairs of a tile attend: ``ok`` (both in range) and the causal / window
    rules. ``pos_q`` (query positions, aligned to the keys) and ``key`` come broadcast to the tile's
    orientation: (BLOCK_Q, 1) and (1, BLOCK_K) for a query-major tile, transposed for a key-major one."""
    vis = ok
    if CAUSAL:
        vis = vis & (key <= pos_q)
    if HAS_WINDOW:
        vis = vis & ((pos_q - key) < window)
        if not CAUSAL:
            vis = vis & ((key - pos_q) < window)
    return vis


@triton.jit
def key_tile_range(pos_lo, pos_hi, k_len, window, interior_ok, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr,
                   HAS_WINDOW: tl.constexpr, GUARD_INTERIOR: tl.constexpr):
    """Key tiles of a query tile whose rows sit at key positions pos_lo .. pos_hi, as (t_lo, f_lo,
    f_hi, t_hi) of :func:`split_tiles`: [t_lo, t_hi) holds every key any row may see; the interior
    tiles [f_lo, f_hi) hold keys every row sees: inside the keys the first row sees (causal,
    non-causal window) and the last row sees (window). GUARD_INTERIOR: no interior unless the scalar
    ``interior_ok`` (e.g. "every row of the tile is in range"; not read otherwise)."""
    lo = 0
    hi = k_len
    full_lo = 0
    full_hi = k_len
    if CAUSAL:
        hi = tl.minimum(hi, pos_hi + 1)
        full_hi = tl.minimum(full_hi, pos_lo + 1)
    if HAS_WINDOW:
        lo = tl.maximum(lo, pos_lo - window + 1)
        full_lo = tl.maximum(full_lo, pos_hi - window + 1)
        if not CAUSAL:
            hi = tl.minimum(hi, pos_hi + window)
            full_hi = tl.minimum(full_hi, pos_lo + window)
    if GUARD_INTERIOR:
        full_hi = tl.where(interior_ok, full_hi, 0)
    return split_tiles(lo, hi, full_lo, full_hi, BLOCK_K)


@triton.jit
def key_tiles(m0, q_len, k_len, window, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
              CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Key tiles of the backward's query tile (rows m0 .. m0 + BLOCK_Q − 1, query i at key position
    i + k_len − q_len), by :func:`key_tile_range`: the interior tiles have every row and key in range
    and every pair visible, which needs all BLOCK_Q rows in range (a partial query tile has none)."""
    pos_lo = m0 + k_len - q_len
    pos_hi = pos_lo + BLOCK_Q - 1
    return key_tile_range(pos_lo, pos_hi, k_len, window, m0 + BLOCK_Q <= q_len, BLOCK_K, CAUSAL, HAS_WINDOW, True)


@triton.jit
def query_tiles(n0, q_len, k_len, window, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Query tiles (in query rows) of the backward's key tile (keys n0 .. n0 + BLOCK_K − 1): the
    transpose of :func:`key_tiles`. Interior query tiles need all BLOCK_K keys in range and lie inside
    the rows that the last key reaches (causal, non-causal window) and the first key reaches (window)."""
    shift = k_len - q_len
    lo = 0
    hi = q_len
    full_lo = 0
    full_hi = q_len
    if CAUSAL:
        lo = tl.maximum(lo, n0 - shift)
        full_lo = tl.maximum(full_lo, n0 + BLOCK_K - 1 - shift)
    if HAS_WINDOW:
        hi = tl.minimum(hi, n0 + BLOCK_K - 1 + window - shift)
        full_hi = tl.minimum(full_hi, n0 + window - shift)
        if not CAUSAL:
            lo = tl.maximum(lo, n0 - window + 1 - shift)
            full_lo = tl.maximum(full_lo, n0 + BLOCK_K - window - shift)
    full_hi = tl.where(n0 + BLOCK_K <= k_len, full_hi, 0)  # a partial key tile has no interior
    return split_tiles(lo, hi, full_lo, full_hi, BLOCK_Q)


@triton.jit
def seq_bounds(seq, CU_Q, CU_K, SQ, SK, VARLEN: tl.constexpr):
    """(batch, q_start, q_len, k_start, k_len) of sequence ``seq``: from cu_seqlens when VARLEN
    (packed, batch 0), else batch ``seq`` with the dense lengths SQ, SK starting at 0."""
    if VARLEN:
        q_start = tl.load(CU_Q + seq)
        q_len = tl.load(CU_Q + seq + 1) - q_start
        k_start = tl.load(CU_K + seq)
        k_len = tl.load(CU_K + seq + 1) - k_start
        batch = seq * 0
    else:
        q_start = seq * 0
        q_len = SQ + seq * 0
        k_start = seq * 0
        k_len = SK + seq * 0
        batch = seq
    return batch, q_start, q_len, k_start, k_len


@triton.jit
def tile_slot(seq, tile, TOFF, VARLEN: tl.constexpr):
    """Index of a tile's channel-wise scales (varlen: tiles of all sequences are packed)."""
    if VARLEN:
        s = tl.load(TOFF + seq) + tile
    else:
        s = tile
    return s


@triton.jit
def block_of_sequence(b, block, cu_ptr, block_off_ptr, S, IS_VARLEN: tl.constexpr):
    """``(start, length, slot, batch)`` of block ``block`` of sequence ``b`` on the token axis:
    VARLEN, the packed sequence's first token and length from ``cu_ptr`` (n_seq + 1,), the block's
    slot from ``block_off_ptr`` (each sequence's first slot) and batch 0; dense, batch ``b`` from
    token 0 with S tokens and slot ``block``. Used by the per-block programs of the quantization
    and statistics kernels."""
    if IS_VARLEN:
        start = tl.load(cu_ptr + b)
        length = tl.load(cu_ptr + b + 1) - start
        batch = b * 0
    else:
        start = 0
        length = S
        batch = b
    return start, length, tile_slot(b, block, block_off_ptr, IS_VARLEN), batch


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host-side grids (plain Python: ``triton.cdiv`` costs a microsecond a call in
    newer Triton, and a launch computes several)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), in plain Python like :func:`cdiv`."""
    return 1 << max(n - 1, 0).bit_length()


def on_cuda(device: torch.device) -> bool:
    """Whether ``device`` is a CUDA device: the host-side choices that differ there (TMA loads, the
    one-read launch, tiles per program) ask this, so that ``benchmarks/hopper_host_sim.py`` can
    take them on a machine without one."""
    return device.type == "cuda"


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int | None) -> int:
    """The multiprocessors of CUDA device ``device_index`` (cached: a device query per launch costs
    host time)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def has_tma(device_index: int | None) -> bool:
    """Hopper (sm_90) and newer have the tensor memory accelerator; Ada (sm_89) does not (cached, as
    :func:`sm_count`)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


# Every layer of a model forward, and its backward, passes the same cu_seqlens tensor: its block
# offsets are six small device ops (about 40 launches per layer's fwd+bwd uncached).
_BLOCK_OFFSETS = IdentityCache(maxsize=16)


def sequence_block_offsets(cu_seqlens: torch.Tensor, block: int) -> torch.Tensor:
    """Where each packed sequence's blocks of ``block`` tokens start in an array of per-block slots:
    the exclusive cumulative sum of ``ceil(len_i / block)``, int32 ``(n_seq,)``, on the device
    without a sync. Cached while ``cu_seqlens`` is the same unmodified tensor (see
    :mod:`..identity_cache`); the result is shared: read it, never write it. Not cached while a
    CUDA graph is being captured (a tensor made then lives in the graph's memory pool)."""
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return _block_offsets(cu_seqlens, block)
    return _BLOCK_OFFSETS.get((cu_seqlens,), block, lambda: _block_offsets(cu_seqlens, block))


def _block_offsets(cu_seqlens: torch.Tensor, block: int) -> torch.Tensor:
    n_blocks = (cu_seqlens[1:] - cu_seqlens[:-1] + (block - 1)) // block
    return (torch.cumsum(n_blocks, 0) - n_blocks).to(torch.int32)


# The recipe's blocks are contraction lengths of FP8 MMAs (keys in F2 and B4, queries in B3 and B5),
# and Triton's FP8 tl.dot needs K >= 32 (Hopper's FP8 wgmma contracts 32 elements per instruction).
MIN_COMPILED_BLOCK = 32


def check_compiled_blocks(block_q: int, block_k: int, who: str, interpreting: bool) -> None:
    """Raise a ValueError naming the fix when a recipe block is below :data:`MIN_COMPILED_BLOCK` and
    the kernels are about to be compiled for a GPU (the CPU interpreter runs any block)."""
    if interpreting:
        return
    small = {name: b for name, b in (("block_q", block_q), ("block_k", block_k)) if b < MIN_COMPILED_BLOCK}
    if small:
        got = ", ".join(f"{name}={b}" for name, b in small.items())
        raise ValueError(
            f"{who}: FP8AttentionConfig {got} is too small for the GPU kernels: FP8 tensor-core matmuls "
            f"contract over at least {MIN_COMPILED_BLOCK} tokens. Use blocks of {MIN_COMPILED_BLOCK}-256 "
            "tokens, or FP8AttentionConfig(backend=\"emulation\") to run this recipe in PyTorch"
        )
