"""Where the one-read preparation launch runs (``one_read_prep.one_read_reason``): its waits are
safe only for sequences of at most one chunk per SM, and only where programs run concurrently. Its
values are checked against the two launches on the GPU (tests/gpu/test_one_read_prep_kernel.py)."""
from types import SimpleNamespace

import pytest
import torch

from hf_fp8_attention.config import RECIPES
from hf_fp8_attention.kernels import one_read_prep as orp
from hf_fp8_attention.kernels import operands
from hf_fp8_attention.kernels.sequence_stats import CHUNK

SMS = 132


def _cuda_like(b, h, s, d):
    """What one_read_reason reads of a tensor, as a CUDA tensor would give it."""
    return SimpleNamespace(shape=(b, h, s, d), is_cuda=True, device=torch.device("cuda", 0))


@pytest.fixture
def compiled(monkeypatch):
    """The reason as a compiled run on an SM count of 132 would see it."""
    monkeypatch.setattr(orp, "interpreting", lambda: False)
    monkeypatch.setattr(orp, "sm_count", lambda index: SMS)
    monkeypatch.setattr(orp, "ONE_READ", True)


def _kv_needs(recipe="fp8_delta"):
    config = RECIPES[recipe]
    copies = (operands.copies_for("k", config, row=True, col=False), operands.copies_for("v", config, row=False,
                                                                                          col=True))
    return operands.operand_needs(copies, operands.backward_kv_copies(config))


def test_forward_kv_runs_up_to_one_chunk_per_sm(compiled):
    xs = (_cuda_like(2, 16, 8192, 128),) * 2
    needs = _kv_needs()
    assert all(n is not None for n in needs)
    assert orp.one_read_reason(xs, needs, 128, 8192) is None
    assert orp.one_read_reason(xs, needs, 64, SMS * CHUNK) is None
    assert "more than 132 chunks" in orp.one_read_reason(xs, needs, 128, SMS * CHUNK + 1)


@pytest.mark.parametrize("case, expect", [
    ("off", "ONE_READ is off"),
    ("interpreter", "interpreter"),
    ("cpu", "not a CUDA tensor"),
    ("no_stats", "needs no sequence statistics"),
    ("d256", "head dim above 128"),
    ("block", "do not divide"),
    ("empty", "no tokens"),
])
def test_two_launches_where_the_wait_is_not_safe_or_not_needed(compiled, monkeypatch, case, expect):
    x = _cuda_like(1, 4, 4096, 256 if case == "d256" else 128)
    needs = _kv_needs()
    block, max_len = (512 if case == "block" else 128), (0 if case == "empty" else 4096)
    if case == "off":
        monkeypatch.setattr(orp, "ONE_READ", False)
    if case == "interpreter":
        monkeypatch.setattr(orp, "interpreting", lambda: True)
    if case == "cpu":
        x = torch.empty(1, 4, 4096, 128)
    if case == "no_stats":
        needs = (needs[0], None)
    assert expect in orp.one_read_reason((x, x), needs, block, max_len)


def test_tile_recipe_needs_no_statistics():
    """The first release's recipe scales per tile: its copies need no sequence statistics, so it
    keeps the quantization launch alone."""
    assert all(n is None for n in _kv_needs("fp8_delta_tile"))


def test_cpu_falls_back_to_the_two_launches():
    """On CPU tensors (the interpreter) the statistics and copies are the two launches' own."""
    config = RECIPES["fp8_delta"]
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, 96, 64, generator=gen).bfloat16() for _ in range(2))
    copies = (operands.copies_for("k", config, row=True, col=False), operands.copies_for("v", config, row=False,
                                                                                          col=True))
    assert orp.one_read_reason((k, v), operands.operand_needs(copies), config.block_k, 96) is not None
    stats, outs = operands.stats_then_copies((k, v), copies, block=config.block_k)
    want_stats = operands.stats_for((k, v), copies)
    for got, want in zip(stats, want_stats):
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert outs[0][0].shape == (1, 2, 96, 64) and outs[1][2].shape[2] == 64
