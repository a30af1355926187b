"""Which query blocks each program of a persistent Gluon kernel runs (kernels/forward_persistent.py,
and the persistent forms of backward_dq_gluon.py and backward_stats_gluon.py): a table built on the
host once per shape.

The per-block kernels run one program per (query block, batch · query head), which the GPU starts in
launch order as SMs free up (gluon_hopper.query_block: causal blocks longest first,
``DISPATCH["head_group"]`` rows at a time). A persistent kernel runs one program per SM over a list of
blocks; :func:`schedule` gives the blocks to programs in that same order, each to the program that
would be free first: the list scheduling the GPU does for the per-block grid, so the balance is the
per-block kernel's, without each program's start and end exposed.
"""
from __future__ import annotations

import functools
import heapq

import torch

from .tiles import sm_count

# A query block's fixed cost, in 128-key tiles' time, beside its key tiles: its operands' first
# loads and its epilogue, about 2 µs against the H100's ~1.4 µs per 128 x 128 tile of the forward
# (benchmarks/NOTES.md, "Forward"). It only weighs blocks of different lengths against each other.
BLOCK_COST_TILES = 1.5


def launch_order(n_blk: int, rows: int, causal: bool, head_group: int) -> list[tuple[int, int]]:
    """(row, block) of the per-block kernel's programs in launch order: gluon_hopper.query_block's
    mapping (causal: ``grouped_program``'s groups of ``head_group`` rows, longest block first)."""
    order = []
    for lin in range(n_blk * rows):
        if causal:
            first = (lin // (head_group * n_blk)) * head_group
            size = min(rows - first, head_group)
            within = lin - first * n_blk
            order.append((first + within % size, n_blk - 1 - within // size))
        else:
            order.append((lin // n_blk, lin % n_blk))
    return order


@functools.lru_cache(maxsize=64)
def schedule(n_blk: int, rows: int, n_tiles_k: int, causal: bool, head_group: int, programs: int,
             device: torch.device) -> torch.Tensor:
    """The programs' lists of query blocks, int32 on ``device``: ``programs + 1`` offsets into the
    table itself (program p runs entries [table[p], table[p + 1]) ), then the blocks, each as row ·
    n_blk + block (row: batch · query head; block: 128 queries). Greedy list scheduling of the
    launch order (:func:`launch_order`) onto ``programs`` programs; a block's cost is its key tiles
    (causal: block + 1; else ``n_tiles_k``, in tiles of 128 keys) plus ``BLOCK_COST_TILES``."""
    free_at = [(0.0, p) for p in range(programs)]
    lists: list[list[int]] = [[] for _ in range(programs)]
    for row, blk in launch_order(n_blk, rows, causal, head_group):
        at, p = heapq.heappop(free_at)
        lists[p].append(row * n_blk + blk)
        heapq.heappush(free_at, (at + (blk + 1 if causal else n_tiles_k) + BLOCK_COST_TILES, p))
    offsets = [programs + 1]
    for blocks in lists:
        offsets.append(offsets[-1] + len(blocks))
    return torch.tensor(offsets + [x for blocks in lists for x in blocks], dtype=torch.int32, device=device)


def launch_table(n_blk: int, rows: int, sk: int, causal: bool, head_group: int,
                 device: torch.device) -> tuple[torch.Tensor, int]:
    """(table, programs) of a persistent launch over ``n_blk`` 128-query blocks in each of ``rows``
    rows (batch · query head) against ``sk`` keys: one program per SM, at most one per block, and
    :func:`schedule`'s table for them (its costs in tiles of 128 keys, whatever the kernel's tile)."""
    programs = min(sm_count(device.index), n_blk * rows)
    return schedule(n_blk, rows, sk // 128, causal, head_group, programs, device), programs


__all__ = ["BLOCK_COST_TILES", "launch_order", "launch_table", "schedule"]
