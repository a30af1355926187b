"""The persistent Gluon kernels' host side without a GPU: the schedule of query blocks over programs
(kernels/persistent_schedule.py) and the 2-D view of Q the persistent forward's TMA boxes read
(kernels/forward_persistent.py). The kernels themselves are checked bit for bit against the
per-block kernels on a GPU (tests/gpu/test_gluon_forward.py, test_gluon_backward.py)."""
from __future__ import annotations

import pytest
import torch

from hf_fp8_attention import FP8AttentionConfig
from hf_fp8_attention.kernels import forward_gluon, forward_persistent, persistent_schedule


def _lists(table: list[int], programs: int) -> list[list[int]]:
    return [table[table[p]:table[p + 1]] for p in range(programs)]


def _grouped_program(lin: int, n_blk: int, rows: int, group: int) -> tuple[int, int]:
    """gluon_hopper.grouped_program's (rank, row) of the program with linear index ``lin``, as its
    Gluon code computes it."""
    first = (lin // (group * n_blk)) * group
    size = min(rows - first, group)
    within = lin - first * n_blk
    return within // size, first + within % size


@pytest.mark.parametrize("causal,group", [(True, 4), (True, 1), (True, 3), (False, 1)])
@pytest.mark.parametrize("n_blk,rows", [(64, 32), (8, 6), (16, 1)])
def test_launch_order_is_the_per_block_grids(n_blk, rows, causal, group):
    """Every (row, block) once, in the order the per-block grid's programs start (query_block):
    causal blocks longest first within each group of rows."""
    order = persistent_schedule.launch_order(n_blk, rows, causal, group)
    assert sorted(order) == [(r, b) for r in range(rows) for b in range(n_blk)]
    for lin, (row, blk) in enumerate(order):
        if causal:
            rank, want_row = _grouped_program(lin, n_blk, rows, group)
            assert (row, blk) == (want_row, n_blk - 1 - rank)
        else:
            assert (row, blk) == (lin // n_blk, lin % n_blk)


@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize("n_blk,rows,programs", [(64, 32, 132), (16, 32, 132), (4, 3, 132), (128, 16, 114)])
def test_schedule_gives_every_block_once_and_balances_the_programs(n_blk, rows, programs, causal):
    """Offsets then blocks; each block in exactly one program's list, in launch order within it; no
    program's cost (key tiles + BLOCK_COST_TILES per block) above the ideal share by more than one
    block's cost (greedy list scheduling's bound)."""
    programs = min(programs, n_blk * rows)
    table = persistent_schedule.schedule(n_blk, rows, n_blk, causal, 4 if causal else 1, programs,
                                        torch.device("cpu")).tolist()
    assert table[0] == programs + 1 and table[programs] == len(table)
    lists = _lists(table, programs)
    assert all(blocks for blocks in lists)
    assert sorted(x for blocks in lists for x in blocks) == list(range(n_blk * rows))
    rank = {row * n_blk + blk: i for i, (row, blk) in
            enumerate(persistent_schedule.launch_order(n_blk, rows, causal, 4 if causal else 1))}
    assert all([rank[x] for x in blocks] == sorted(rank[x] for x in blocks) for blocks in lists)

    def cost(x):
        return (x % n_blk + 1 if causal else n_blk) + persistent_schedule.BLOCK_COST_TILES
    loads = [sum(cost(x) for x in blocks) for blocks in lists]
    assert max(loads) <= sum(loads) / programs + max(cost(x) for x in range(n_blk * rows))


@pytest.mark.parametrize("b,h", [(2, 3), (1, 4), (3, 1), (1, 1)])
def test_q_rows_addresses_every_token_of_head_and_token_major_q(b, h):
    """Row b·RB + h·RH + s, columns h·CH .. + D of the 2-D view hold q[b, h, s] for a contiguous and
    a token-major q (any batch or head count, size-1 dims included); other token strides, an offset
    view or strided channels give None."""
    s, d = 256, 128
    base = torch.randn(b, h, s, d)
    for q in (base, base.transpose(1, 2).contiguous().transpose(1, 2)):
        q2d, rb, rh, ch = forward_persistent.q_rows(q)
        for bi, hi, si in ((0, 0, 0), (b - 1, h - 1, s - 1), (b // 2, h // 2, 77)):
            assert torch.equal(q2d[bi * rb + hi * rh + si, hi * ch:hi * ch + d], q[bi, hi, si])
    wide = torch.randn(b, s, h, 2 * d)
    assert forward_persistent.q_rows(wide[..., :d].transpose(1, 2)) is None
    assert forward_persistent.q_rows(torch.randn(b, h, s + 1, d)[:, :, 1:]) is None
    assert forward_persistent.q_rows(torch.randn(b, h, s, 2 * d)[..., ::2]) is None


def test_persistent_kernel_keeps_the_launch_for_q_it_cannot_box(monkeypatch):
    """With ``PERSISTENT`` on, Q whose tokens are neither head-major nor token-major is quantized by
    the launch (its reason names why); off, the per-block kernel loads any token strides."""
    config = FP8AttentionConfig.from_recipe("fp8_delta")
    q = torch.zeros(1, 2, 256, 256, dtype=torch.bfloat16)[..., :128]  # channels contiguous, rows of 256
    monkeypatch.setattr(forward_gluon, "cvt_mode", lambda: 0)  # the GPU's conversion (off the GPU: emulated)
    monkeypatch.setattr(forward_gluon, "PERSISTENT", False)
    assert forward_gluon.q_quantization_reason(q, config, True) is None
    monkeypatch.setattr(forward_gluon, "PERSISTENT", True)
    assert "TMA" in forward_gluon.q_quantization_reason(q, config, True)
    assert forward_gluon.q_quantization_reason(q.contiguous(), config, True) is None
