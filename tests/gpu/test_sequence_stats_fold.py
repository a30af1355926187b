"""The sequence statistics folded in their partials launch (``sequence_stats.FOLD_IN_PARTIALS``) against
the separate finishing launch, on the GPU: there the programs of one sequence run concurrently, and
the fold depends on the counter's acquire-release making every chunk's partial visible to the
program that counts last (the interpreter runs programs one after another, so it cannot test that).

Per shape (dense and packed, empty sequences included, long sequences of many chunks, head dims 64 /
96 / 128 / 256), both operands of a launch, every statistic:

- the column amax equals the finishing launch's bit for bit (a max does not depend on order);
- the shift (the rotated mean μH, its ±1 matrix making each term ±μ_i) within twice the
  recursive-summation bound of one sum of ``DP`` terms, ``2 (DP - 1) u Σ|μ_i|`` with u = 2^-24: both
  launches fold the same partials in the same order, so μ is the same, but they run the sum on
  different warp counts and may associate it differently; the row amax (a max over channels of
  |extreme − shift|) within that bound plus two roundings of the result;
- repeated calls give the same bits (a missed partial, read before its program stored it, would
  change them from call to call).

The rotating launch as Hᵀxᵀ (``TRANSPOSED_ROTATION``) against the xH form, on the same shapes: the
column amax bit for bit; the shift, which it takes as the mean of rotated rows instead of the
rotated mean, within the recursive-summation bounds of both orders.
"""
import pytest
import torch

pytestmark = pytest.mark.gpu

pytest.importorskip("triton")
sequence_stats_module = pytest.importorskip("hf_fp8_attention.kernels.sequence_stats")
StatsNeed, sequence_stats = sequence_stats_module.StatsNeed, sequence_stats_module.sequence_stats

# name -> (batch, heads, tokens, head dim, cu_seqlens or None)
SHAPES = {
    "dense_d128_8k": (2, 8, 8192, 128, None),
    "dense_d64_16k": (1, 9, 16384, 64, None),
    "dense_d256_2k": (2, 4, 2048, 256, None),
    "packed_d96_empty": (1, 6, 5000, 96, [0, 0, 1, 257, 257, 3000, 5000, 5000]),
    "packed_d128_long": (1, 4, 20000, 128, [0, 300, 20000]),
}
NEEDS = (StatsNeed(rotate=True, smooth=True, row_amax=True, col_amax=True),  # K in the v2 recipes
         StatsNeed(rotate=True, row_amax=True, col_amax=True))  # V with the fast recipe's per-head scale
REPEATS = 20


def _stats(xs, cu, fold: bool, monkeypatch, transposed: bool = False):
    monkeypatch.setattr(sequence_stats_module, "FOLD_IN_PARTIALS", fold)
    monkeypatch.setattr(sequence_stats_module, "TRANSPOSED_ROTATION", transposed)
    out = sequence_stats(xs, NEEDS, cu_seqlens=cu)
    torch.cuda.synchronize()
    return [tuple(t.clone() for t in st) for st in out]


def _per_sequence(x, cu, reduce):
    """``reduce`` over the tokens of each (sequence, head) of ``x (B, H, S, D)`` in float64, as
    ``(n_seq, H, D)`` (zeros for an empty sequence); ``reduce`` maps ``(H, S_i, D)`` to ``(H, D)``."""
    x = x.double()
    if cu is None:
        return torch.stack([reduce(x[i]) for i in range(x.shape[0])])
    bounds = cu.tolist()
    return torch.stack([reduce(x[0, :, lo:hi]) if hi > lo else x.new_zeros(x.shape[1], x.shape[3])
                        for lo, hi in zip(bounds, bounds[1:])])


def _channel_mean(x, cu):
    """Each (sequence, head)'s channel mean ``(n_seq, H, D)`` in float64 (zeros for an empty one)."""
    return _per_sequence(x, cu, lambda t: t.mean(1))


def _operands(name):
    """(K, V) bf16 of shape ``name`` and its cu_seqlens (None: dense)."""
    b, h, s, d, cu = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(5)
    # A channel mean far from zero (what K-smoothing removes) and outliers in a few channels.
    k = (torch.randn(b, h, s, d, device="cuda", generator=gen) * torch.logspace(-1, 1, d, device="cuda") + 2)
    v = torch.randn(b, h, s, d, device="cuda", generator=gen) * 3
    return (k.bfloat16(), v.bfloat16()), None if cu is None else torch.tensor(cu, dtype=torch.int32, device="cuda")


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_folded_statistics_equal_the_finishing_launch(name, monkeypatch):
    xs, cu = _operands(name)
    want = _stats(xs, cu, False, monkeypatch)
    got = _stats(xs, cu, True, monkeypatch)
    dp = want[0][0].shape[-1]
    u = 2.0**-24
    for op, (w, g) in enumerate(zip(want, got)):
        shift_w, row_w, col_w = w
        shift_g, row_g, col_g = g
        assert torch.equal(col_g, col_w), f"operand {op}: column amax differs"
        mean_abs_sum = _channel_mean(xs[op], cu).abs().sum(-1)  # (n_seq, H)
        bound = 2 * (dp - 1) * u * mean_abs_sum.float()
        assert ((shift_g - shift_w).abs() <= bound[..., None]).all(), f"operand {op}: shift beyond the bound"
        assert ((row_g - row_w).abs() <= bound + 2 * u * row_w.abs()).all(), f"operand {op}: row amax"
    for _ in range(REPEATS):
        again = _stats(xs, cu, True, monkeypatch)
        for g, a in zip(got, again):
            assert all(torch.equal(x, y) for x, y in zip(g, a)), "the folded statistics changed between calls"


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_transposed_rotation_matches_the_row_form(name, monkeypatch):
    xs, cu = _operands(name)
    want = _stats(xs, cu, True, monkeypatch)
    got = _stats(xs, cu, True, monkeypatch, transposed=True)
    dp = want[0][0].shape[-1]
    chunk = sequence_stats_module.CHUNK
    u = 2.0**-24
    lengths = (torch.diff(cu) if cu is not None else torch.full((xs[0].shape[0],), xs[0].shape[2])).double().cpu()
    for op, (w, g) in enumerate(zip(want, got)):
        assert torch.equal(g[2], w[2]), f"operand {op}: column amax differs"
        # Per (sequence, head): A, the mean over tokens of Σ_j |x_tj|, bounds every rotated row's
        # entries and the rotated mean's on average; M, their largest, bounds each rotated entry.
        row_l1 = xs[op].double().abs().sum(-1, keepdim=True)  # (B, H, S, 1)
        a = _channel_mean(row_l1, cu)[..., 0].cpu()
        m = _per_sequence(row_l1, cu, lambda t: t.amax(1))[..., 0].cpu()
        # Each form sums its tokens in chunks of CHUNK then folds the chunks, and its d channels once
        # (the rotation): (CHUNK + chunks + DP) u A apiece, twice for the two forms, plus the
        # division's rounding.
        chunks = torch.ceil(lengths / chunk)[:, None]
        shift_bound = (2 * (chunk + chunks + dp) * u * a).float().cuda()
        shift_diff = (g[0] - w[0]).abs()
        assert (shift_diff <= shift_bound[..., None] + 2 * u * w[0].abs()).all(), f"operand {op}: shift"
        # The row amax: the shifts' largest difference, plus each form's rotated extremes within
        # (DP - 1) u M of the exact ones, plus two roundings of the result.
        row_bound = shift_diff.amax(-1) + 2 * (dp - 1) * u * m.float().cuda() + 2 * u * w[1].abs()
        assert ((g[1] - w[1]).abs() <= row_bound).all(), f"operand {op}: row amax"
    for _ in range(REPEATS // 4):
        again = _stats(xs, cu, True, monkeypatch, transposed=True)
        for g, a in zip(got, again):
            assert all(torch.equal(x, y) for x, y in zip(g, a)), "the transposed statistics changed between calls"


def test_kept_fold_counters_serve_a_side_stream_and_a_captured_graph(monkeypatch):
    """The fold counters kept between launches (``KEEP_FOLD_COUNTERS``): the statistics are those of
    fresh zeros, on the default stream, on a side stream (its own buffer) and replayed from a CUDA
    graph (fresh zeros captured, no buffer kept); every kept buffer is all zeros after its launches."""
    xs, cu = _operands("dense_d128_8k")  # dense: no length sync, so it can be captured
    monkeypatch.setattr(sequence_stats_module, "_FOLD_COUNTERS", {})
    monkeypatch.setattr(sequence_stats_module, "KEEP_FOLD_COUNTERS", False)
    want = _stats(xs, cu, True, monkeypatch)
    assert not sequence_stats_module._FOLD_COUNTERS
    monkeypatch.setattr(sequence_stats_module, "KEEP_FOLD_COUNTERS", True)

    def same(out):
        return all(torch.equal(a, b) for st, w in zip(out, want) for a, b in zip(st, w))

    for _ in range(3):
        assert same(_stats(xs, cu, True, monkeypatch)), "kept counters changed the statistics"
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            out = sequence_stats(xs, NEEDS, cu_seqlens=cu)
    torch.cuda.synchronize()
    assert same(out), "the side stream's statistics differ"
    assert len(sequence_stats_module._FOLD_COUNTERS) == 2, "one buffer per stream"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sequence_stats(xs, NEEDS, cu_seqlens=cu)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert same(captured), "the replayed statistics differ"
    assert len(sequence_stats_module._FOLD_COUNTERS) == 2, "a capture keeps no buffer"
    for kept in sequence_stats_module._FOLD_COUNTERS.values():
        assert int(kept.abs().sum()) == 0, "a kept buffer left counters counted"
