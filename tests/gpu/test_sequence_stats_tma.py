"""The statistics' partials launch with its slices loaded by TMA (``sequence_stats.TMA_LOADS``)
against pointer loads, on the GPU: the same values reach the same arithmetic, so every statistic
(shift, row amax, column amax) must be the same bits, on dense and packed shapes (empty sequences,
sequences ending inside a slice, whose next tokens the TMA block also brings), head dims 64 / 96 /
128 / 256, bf16 and fp32 inputs, the rotating and the plain operand of a pair, and a strided view (K as
a (B, S, H, D) projection transposed). Inputs TMA cannot address (a row stride of 14 bytes, a head
dim above 256) get no descriptors and load by pointer."""
import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("triton")
stats_module = pytest.importorskip("hf_fp8_attention.kernels.sequence_stats")
StatsNeed = stats_module.StatsNeed

# name -> (batch, heads, tokens, head dim, dtype, cu_seqlens or None, (B, S, H, D) view)
SHAPES = {
    "dense_d128_8k": (2, 4, 8192, 128, torch.bfloat16, None, False),
    "dense_d64_ragged": (1, 3, 1000, 64, torch.bfloat16, None, False),
    "dense_d96_fp32": (1, 2, 777, 96, torch.float32, None, False),
    "dense_d256": (1, 2, 600, 256, torch.bfloat16, None, False),
    "bshd_view_d128": (2, 4, 3000, 128, torch.bfloat16, None, True),
    "packed_d128_empty": (1, 4, 5000, 128, torch.bfloat16, [0, 0, 1, 257, 257, 3001, 5000, 5000], False),
}
# (K, V) in the v2 recipes' forward (K rotated and smoothed); (Q, dO) of the fast recipe's backward
# (per-head scales: Q's rotated, not smoothed) and of fp8_delta's (channel amax only: a launch that
# rotates no rows, PLAIN_TMA_STAGES).
PAIRS = {
    "kv": (StatsNeed(rotate=True, smooth=True, row_amax=True, col_amax=True), StatsNeed(row_amax=True, col_amax=True)),
    "q_do_fast": (StatsNeed(rotate=True, row_amax=True, col_amax=True), StatsNeed(row_amax=True, col_amax=True)),
    "q_do_delta": (StatsNeed(rotate=True, col_amax=True), StatsNeed(col_amax=True)),
}


def _input(b, h, s, d, dtype, bshd, gen):
    shape = (b, s, h, d) if bshd else (b, h, s, d)
    x = (torch.randn(*shape, generator=gen, device="cuda") * torch.logspace(-2, 1, d, device="cuda") + 1.5)
    x = x.to(dtype)
    return x.transpose(1, 2) if bshd else x


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_tma_loads_give_the_pointer_loads_bits(name, pair, monkeypatch):
    b, h, s, d, dtype, cu, bshd = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(3)
    xs = (_input(b, h, s, d, dtype, bshd, gen), _input(b, h, s, d, dtype, bshd, gen) * 4)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    needs = PAIRS[pair]
    got = {}
    for tma in (False, True):
        monkeypatch.setattr(stats_module, "TMA_LOADS", tma)
        if tma:
            assert stats_module.tma_descriptors(xs, 32, 128) is not None, "the case must take the TMA path"
        got[tma] = [t.clone() for st in stats_module.sequence_stats(xs, needs, cu_seqlens=cu_t) for t in st]
    for want, have in zip(got[False], got[True]):
        assert torch.equal(want, have)
    assert all(bool(torch.isfinite(t).all()) for t in got[True])


def test_inputs_tma_cannot_address_load_by_pointer(monkeypatch):
    monkeypatch.setattr(stats_module, "TMA_LOADS", True)
    odd = torch.randn(1, 2, 64, 7, device="cuda", dtype=torch.bfloat16)  # rows 14 bytes apart
    assert stats_module.tma_descriptors((odd,), 32, 8) is None
    wide = torch.randn(1, 2, 64, 512, device="cuda", dtype=torch.bfloat16)
    assert stats_module.tma_descriptors((wide,), 16, 512) is None
    st = stats_module.sequence_stats((odd,), (StatsNeed(row_amax=True, col_amax=True),))
    assert torch.equal(st[0].col_amax[..., :7], odd.float().abs().amax(2))


# Q (16 heads, token-major as an attention layer makes it) beside K and V (8 heads) in one launch, as the
# forward runs it (kernels.forward.Q_STATS_BESIDE_KV): the same bits as the K/V launch and Q's own,
# with TMA loads and with pointer loads, dense and packed.
@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointer"])
@pytest.mark.parametrize("cu", [None, [0, 1, 257, 257, 3001, 5000]], ids=["dense", "packed"])
def test_q_beside_kv_gives_the_bits_of_their_own_launches(tma, cu, monkeypatch):
    monkeypatch.setattr(stats_module, "TMA_LOADS", tma)
    gen = torch.Generator(device="cuda").manual_seed(4)
    b = 2 if cu is None else 1
    k, v = _input(b, 8, 5000, 128, torch.bfloat16, False, gen), _input(b, 8, 5000, 128, torch.bfloat16, False, gen)
    q = _input(b, 16, 5000, 128, torch.bfloat16, True, gen)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")
    nk, nv = PAIRS["kv"]
    nq = PAIRS["q_do_fast"][0]
    together = [t.clone() for st in stats_module.sequence_stats((k, v, q), (nk, nv, nq), cu_seqlens=cu_t) for t in st]
    apart = [t.clone() for st in (*stats_module.sequence_stats((k, v), (nk, nv), cu_seqlens=cu_t),
                                  *stats_module.sequence_stats((q,), (nq,), cu_seqlens=cu_t)) for t in st]
    for want, have in zip(apart, together):
        assert torch.equal(want, have)
    assert together[-2].shape == (2 if cu is None else 5, 16)  # Q's row amax per (sequence, query head)
