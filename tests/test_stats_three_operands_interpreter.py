"""One statistics launch over three operands of different head counts (the forward's Q beside K and
V, grouped-query attention) gives, under the Triton interpreter, the same bits as the K/V launch and
Q's launch apart: dense and packed (an empty sequence included), with the fold in the partials
launch and in the finishing launch; and tensors that cannot share a launch are refused by name."""
import pytest
import torch

from hf_fp8_attention.kernels import sequence_stats as stats_module
from hf_fp8_attention.kernels.quantize import interpreting
from hf_fp8_attention.kernels.sequence_stats import StatsNeed, sequence_stats

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's CPU run of the kernels")

# K: smoothed and rotated with both amaxes (the fast recipe's, plus the backward's channel amax); V:
# its amaxes; Q: rotated, its row amax and channel amax (the backward's, handed over).
K_NEED = StatsNeed(rotate=True, smooth=True, row_amax=True, col_amax=True)
V_NEED = StatsNeed(row_amax=True, col_amax=True)
Q_NEED = StatsNeed(rotate=True, row_amax=True, col_amax=True)


def _run(xs, needs, cu, fold_in_partials: bool) -> list[list[torch.Tensor]]:
    saved = stats_module.CHUNK, stats_module.FOLD_IN_PARTIALS
    stats_module.CHUNK, stats_module.FOLD_IN_PARTIALS = 32, fold_in_partials  # 100 tokens: 4 chunks
    try:
        return [[t.clone() for t in st] for st in sequence_stats(xs, needs, cu_seqlens=cu)]
    finally:
        stats_module.CHUNK, stats_module.FOLD_IN_PARTIALS = saved


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("fold_in_partials", [True, False], ids=["in_partials", "finishing_launch"])
def test_q_beside_k_and_v_gives_the_same_bits(packed, fold_in_partials):
    gen = torch.Generator().manual_seed(3)
    b, s, d = (1 if packed else 2), 100, 64
    k = (torch.randn(b, 2, s, d, generator=gen) * torch.logspace(-2, 1, d) + 3).to(torch.bfloat16)
    v = (torch.randn(b, 2, s, d, generator=gen) * 5).to(torch.bfloat16)
    # Q token-major, as attention layers make it: (B, S, Hq, D) transposed.
    q = (torch.randn(b, s, 4, d, generator=gen) * 2 - 1).to(torch.bfloat16).transpose(1, 2)
    cu = torch.tensor([0, 30, 30, 100], dtype=torch.int32) if packed else None  # 30 tokens, none, 70
    got_k, got_v, got_q = _run((k, v, q), (K_NEED, V_NEED, Q_NEED), cu, fold_in_partials)
    want_k, want_v = _run((k, v), (K_NEED, V_NEED), cu, fold_in_partials)
    (want_q,) = _run((q,), (Q_NEED,), cu, fold_in_partials)
    for got, want in ((got_k, want_k), (got_v, want_v), (got_q, want_q)):
        assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want]
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert got_q[1].shape == (3 if packed else 2, 4)  # a row amax per (sequence, query head)
    assert float(got_q[1].min()) > 0 if not packed else float(got_q[1][1].abs().max()) == 0  # the empty one: 0
    assert float(got_k[0].abs().max()) > 0  # K's shift was computed


def test_q_as_the_middle_operand_gives_the_same_bits():
    """The operand with more heads need not be the last: Y has its own head count too (Q between K
    and V, and Q as the second of two)."""
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(1, 2, 70, 64, generator=gen).to(torch.bfloat16)
    q = torch.randn(1, 6, 70, 64, generator=gen).to(torch.bfloat16)
    v = torch.randn(1, 2, 70, 64, generator=gen).to(torch.bfloat16)
    (want_k,), (want_q,), (want_v,) = (_run((x,), (n,), None, True) for x, n in ((k, K_NEED), (q, Q_NEED), (v, V_NEED)))
    got_k, got_q, got_v = _run((k, q, v), (K_NEED, Q_NEED, V_NEED), None, True)
    assert all(torch.equal(g, w) for g, w in zip(got_k + got_q + got_v, want_k + want_q + want_v))
    got_k, got_q = _run((k, q), (K_NEED, Q_NEED), None, True)
    assert all(torch.equal(g, w) for g, w in zip(got_k + got_q, want_k + want_q))


@pytest.mark.parametrize("other", [(2, 4, 99, 64), (2, 4, 100, 128), (1, 4, 100, 64)], ids=["length", "dim", "batch"])
def test_operands_that_cannot_share_a_launch_are_refused(other):
    k = torch.zeros(2, 2, 100, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="share batch, length, head dim and dtype"):
        sequence_stats((k, k, torch.zeros(other, dtype=torch.bfloat16)), (V_NEED, V_NEED, V_NEED))
    with pytest.raises(ValueError, match="one to three tensors"):
        sequence_stats((k,) * 4, (V_NEED,) * 4)
