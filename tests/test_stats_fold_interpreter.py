"""The statistics' fold loads several chunks' partials at a time (``sequence_stats.FOLD_LOADS``)
and adds them in order: under the Triton interpreter its statistics are the same bits as one chunk at
a time, in the partials launch and in the finishing launch, dense and packed, where the chunk count
is a multiple of FOLD_LOADS and where it is not. Each fold sets its counter back to zero, so the
counters kept between launches serve the next one."""
import pytest
import torch

from hf_fp8_attention.kernels import sequence_stats as stats_module
from hf_fp8_attention.kernels.quantize import interpreting
from hf_fp8_attention.kernels.sequence_stats import StatsNeed, sequence_stats

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's CPU run of the kernels")

CHUNK = 32  # tokens per partials program (256 in the launch): 200 tokens are 7 chunks
NEEDS = (StatsNeed(rotate=True, smooth=True, row_amax=True, col_amax=True), StatsNeed(row_amax=True, col_amax=True))


def _stats(k, v, cu, fold_loads: int, fold_in_partials: bool) -> list[torch.Tensor]:
    saved = stats_module.CHUNK, stats_module.FOLD_LOADS, stats_module.FOLD_IN_PARTIALS
    stats_module.CHUNK, stats_module.FOLD_LOADS, stats_module.FOLD_IN_PARTIALS = CHUNK, fold_loads, fold_in_partials
    try:
        return [t.clone() for st in sequence_stats((k, v), NEEDS, cu_seqlens=cu) for t in st]
    finally:
        stats_module.CHUNK, stats_module.FOLD_LOADS, stats_module.FOLD_IN_PARTIALS = saved


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("fold_in_partials", [True, False], ids=["in_partials", "finishing_launch"])
def test_fold_loads_keep_the_statistics_bits(packed, fold_in_partials):
    gen = torch.Generator().manual_seed(5)
    shape = (1 if packed else 2, 2, 200, 64)
    # Channel means far from zero and spread over three decades: the shift's sums round.
    k = (torch.randn(*shape, generator=gen) * torch.logspace(-2, 1, 64) + 3).to(torch.bfloat16)
    v = (torch.randn(*shape, generator=gen) * 5).to(torch.bfloat16)
    # Packed: 9 tokens (one chunk), none, 191 (six chunks, the last one partial).
    cu = torch.tensor([0, 9, 9, 200], dtype=torch.int32) if packed else None
    one = _stats(k, v, cu, 1, fold_in_partials)
    for fold_loads in (3, 8):  # 7 chunks: 3 + 3 + 1; all in one step
        got = _stats(k, v, cu, fold_loads, fold_in_partials)
        assert all(torch.equal(g, w) for g, w in zip(got, one)), fold_loads
    assert float(one[0].abs().max()) > 0  # the shift was computed (K is smoothed)


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_fold_sets_its_counters_back_to_zero_so_the_kept_buffer_serves_the_next_launch(monkeypatch, packed):
    gen = torch.Generator().manual_seed(6)
    shape = (1 if packed else 2, 2, 200, 64)
    k = (torch.randn(*shape, generator=gen) * 2 + 1).to(torch.bfloat16)
    v = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, 9, 9, 200], dtype=torch.int32) if packed else None
    monkeypatch.setattr(stats_module, "_FOLD_COUNTERS", {})
    # The finishing launch folds without counters: the reference.
    reference = _stats(k, v, cu, 1, False)
    assert not stats_module._FOLD_COUNTERS
    for _ in range(3):  # each launch finds the counters the one before left
        got = _stats(k, v, cu, 1, True)
        assert all(torch.equal(g, w) for g, w in zip(got, reference))
        (kept,) = stats_module._FOLD_COUNTERS.values()
        assert int(kept.abs().sum()) == 0, "a fold left its counter counted"
    # Counted counters (as a launch that raised midway may leave them) would make the next fold
    # come early or never: a launch that raises drops the kept buffer.
    kept.fill_(1)

    def raising(kernel, grid, *args, **meta):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(stats_module, "launch_kernel", raising)
    with pytest.raises(RuntimeError, match="launch failed"):
        _stats(k, v, cu, 1, True)
    assert not stats_module._FOLD_COUNTERS
    monkeypatch.undo()
    assert all(torch.equal(g, w) for g, w in zip(_stats(k, v, cu, 1, True), reference))


def test_a_launch_on_kept_counters_allocates_no_zeros(monkeypatch):
    """The point of keeping them: after the first launch, a statistics launch makes no ``torch.zeros``
    (an allocation and a zeroing launch of host time each on a GPU); with the switch off, one each."""
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(2, 2, 100, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    monkeypatch.setattr(stats_module, "_FOLD_COUNTERS", {})
    _stats(k, v, None, 1, True)  # makes the kept buffer
    zeros = []
    real_zeros = torch.zeros

    def counting(*args, **kwargs):
        zeros.append(args)
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", counting)
    _stats(k, v, None, 1, True)
    assert zeros == []
    monkeypatch.setattr(stats_module, "KEEP_FOLD_COUNTERS", False)
    _stats(k, v, None, 1, True)
    assert len(zeros) == 1
