"""The PyTorch emulation: Delta-Matching's invariant, error budgets, masks, GQA, varlen."""
import pytest
import torch

from hf_fp8_attention import FP8AttentionConfig, fp8_attention
from hf_fp8_attention.diagnostics import MATCHED_ROW_SUM_RESIDUAL_MAX, diagnose
from hf_fp8_attention.exact import exact_attention, exact_attention_grads
from hf_fp8_attention.masking import MaskSpec

from helpers import BUDGET, HYBRID_MATCHED_GRAD_BUDGET, assert_within_budget, make_qkv, rel_err

MATCHED, STALE = FP8AttentionConfig.from_recipe("fp8_delta"), FP8AttentionConfig.from_recipe("fp8_stale")
HYB_MATCHED, HYB_STALE = FP8AttentionConfig.from_recipe("hybrid_delta"), FP8AttentionConfig.from_recipe("hybrid_stale")


# Lengths include ones that are not multiples of the 128-wide tiles.
@pytest.mark.parametrize("seq", [100, 300, 513])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("matched, stale", [(MATCHED, STALE), (HYB_MATCHED, HYB_STALE)], ids=["fp8", "hybrid"])
def test_matched_delta_restores_zero_row_sum(seq, causal, outliers, matched, stale):
    q, k, v, dout = make_qkv(sq=seq, outliers=outliers, seed=seq)
    good = diagnose(q, k, v, dout, config=matched, causal=causal)
    bad = diagnose(q, k, v, dout, config=stale, causal=causal)
    # Matched: Σ_j dS_ij = D_i (1 − Σ_j P_ij), zero up to fp32 rounding of the row sums.
    assert good.median_row_sum_residual <= MATCHED_ROW_SUM_RESIDUAL_MAX
    # Stale: the mismatch between rowsum(dO∘O) and Σ P·dP is FP8-sized (1e-3..1e-1), not rounding.
    assert bad.median_row_sum_residual >= 100 * max(good.median_row_sum_residual, 1e-8)
    # Seen from outside: the gradient is less biased along the key-shift direction.
    assert good.key_shift_residual < bad.key_shift_residual


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_fp8_errors_within_budget(causal, d):
    q, k, v, dout = make_qkv(sq=200, d=d, seed=d)
    report = diagnose(q, k, v, dout, config=MATCHED, causal=causal)
    for name, budget in BUDGET.items():
        assert report.rel_err[name] <= budget, (name, report.rel_err[name], budget)


def test_hybrid_matched_gradients_are_bf16_accurate_and_stale_are_not():
    q, k, v, dout = make_qkv(sq=256, seed=3)
    good = diagnose(q, k, v, dout, config=HYB_MATCHED, causal=True)
    bad = diagnose(q, k, v, dout, config=HYB_STALE, causal=True)
    for name in ("dq", "dk", "dv"):
        assert good.rel_err[name] <= HYBRID_MATCHED_GRAD_BUDGET
        # The stale delta leaves an FP8-sized error in a bf16 backward.
        assert bad.rel_err[name] > 3 * good.rel_err[name]


@pytest.mark.parametrize("key_bias", [0.0, 3.0])
def test_hybrid_stale_gradients_are_fp8_sized_whatever_the_keys_mean(key_bias):
    """The stale hybrid normalises its bf16 (unsmoothed) logits by the FP8 forward's LSE, whose
    logits K-smoothing shifted by τ q_i·μ per row: without that constant added back its P rows are
    off by exp(τ q_i·μ), and a pretrained model's keys (large mean) gave gradients of 1e18. Its
    delta is fp8_stale's (same forward, same rowsum(dO ∘ O)) and its other operands are bf16, so its
    errors are fp8_stale's size; 2x allows for its P rows' normalisation mismatch, exp(LSE_bf16 −
    LSE_fp8), which fp8_stale's consistent logits do not have (measured 0.75-1.45x)."""
    q, k, v, dout = make_qkv(sq=256, seed=4, outliers=True)
    k = (k.float() + key_bias).to(k.dtype)
    hybrid = diagnose(q, k, v, dout, config=HYB_STALE, causal=True)
    fp8 = diagnose(q, k, v, dout, config=STALE, causal=True)
    for name in ("dq", "dk", "dv"):
        assert hybrid.rel_err[name] <= 2 * fp8.rel_err[name], (name, hybrid.rel_err[name], fp8.rel_err[name])


def _grads(q, k, v, dout, **kwargs):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = fp8_attention(q, k, v, **kwargs)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def test_gqa_equals_repeated_heads_without_repeating():
    q, k, v, dout = make_qkv(hq=6, hkv=2, sq=150, dtype=torch.float32, seed=5)
    out, dq, dk, dv = _grads(q, k, v, dout, causal=True)
    rep = [t.repeat_interleave(3, dim=1) for t in (k, v)]
    out_r, dq_r, dk_r, dv_r = _grads(q, *rep, dout, causal=True)
    torch.testing.assert_close(out, out_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dq, dq_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dk, dk_r.reshape(1, 2, 3, 150, 64).sum(2), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dv, dv_r.reshape(1, 2, 3, 150, 64).sum(2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [1, 16, 100])
def test_sliding_window(window):
    q, k, v, dout = make_qkv(sq=160, seed=window)
    mask = MaskSpec(causal=True, window=window)
    out, dq, dk, dv = _grads(q, k, v, dout, causal=True, window=window)
    assert_within_budget((out, dq, dk, dv), exact_attention_grads(q, k, v, dout, mask=mask))
    # A key outside every query's window changes nothing it cannot see, where every scale is per
    # token or per tile (the tile recipe). The sequence-wide recipes take K's mean and channel
    # scales over all keys, so there it moves the quantization grid (not the maths) of the rest.
    tile = FP8AttentionConfig.from_recipe("fp8_delta_tile")
    k2 = k.clone()
    k2[:, :, 0] += 5.0
    out1 = fp8_attention(q, k, v, causal=True, window=window, config=tile)
    out2 = fp8_attention(q, k2, v, causal=True, window=window, config=tile)
    assert torch.equal(out1[:, :, window:], out2[:, :, window:])


def test_window_wider_than_sequence_is_plain_causal():
    q, k, v, _ = make_qkv(sq=90, seed=7)
    assert torch.equal(fp8_attention(q, k, v, causal=True, window=90), fp8_attention(q, k, v, causal=True))


def test_decode_queries_are_the_last_rows_of_the_full_sequence():
    q, k, v, dout = make_qkv(sq=140, dtype=torch.float32, seed=8)
    full = fp8_attention(q, k, v, causal=True)
    for q_len in (1, 13):
        tail = fp8_attention(q[:, :, -q_len:], k, v, causal=True)
        # Same quantization blocks and logits; only the fp32 matmul's blocking differs.
        torch.testing.assert_close(tail, full[:, :, -q_len:], rtol=1e-5, atol=1e-6)
        ref = exact_attention(q[:, :, -q_len:], k, v, mask=MaskSpec(causal=True))
        assert rel_err(tail, ref) <= BUDGET["out"]


def test_varlen_equals_separate_runs_and_gaps_are_zero():
    lens = [37, 128, 5]
    total = sum(lens) + 6  # six trailing tokens belong to no sequence (e.g. padding)
    q, k, v, dout = make_qkv(b=1, sq=total, dtype=torch.float32, seed=9)
    cu = torch.tensor([0, 37, 165, 170], dtype=torch.int32)
    out, dq, dk, dv = _grads(q, k, v, dout, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        o_i, dq_i, dk_i, dv_i = _grads(*(t[:, :, s:e] for t in (q, k, v, dout)), causal=True)
        torch.testing.assert_close(out[:, :, s:e], o_i, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dq[:, :, s:e], dq_i, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dk[:, :, s:e], dk_i, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(dv[:, :, s:e], dv_i, rtol=1e-5, atol=1e-6)
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t).all() and not t[:, :, 170:].any()


@pytest.mark.parametrize("seq", [1, 17, 131])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_odd_lengths_and_dtypes(seq, dtype):
    q, k, v, dout = make_qkv(sq=seq, dtype=dtype, seed=seq)
    out, dq, dk, dv = _grads(q, k, v, dout, causal=True)
    assert out.dtype == dq.dtype == dk.dtype == dv.dtype == dtype
    assert_within_budget((out, dq, dk, dv), exact_attention_grads(q, k, v, dout, mask=MaskSpec(causal=True)))


def test_non_contiguous_inputs_match_contiguous():
    q, k, v, dout = make_qkv(sq=70, seed=11)
    # (B, S, H, D) storage viewed as (B, H, S, D), as Transformers hands them over.
    qt, kt, vt = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not qt.is_contiguous()
    a, b = _grads(q, k, v, dout, causal=True), _grads(qt, kt, vt, dout, causal=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_nan_inputs_are_not_hidden():
    q, k, v, _ = make_qkv(sq=20, seed=12)
    q[0, 0, 3, 7] = float("nan")
    out = fp8_attention(q, k, v)
    assert out[0, 0, 3].isnan().all()
    assert torch.isfinite(out[0, 0, :3]).all() and torch.isfinite(out[0, 1:]).all()


def test_matched_mode_does_not_keep_the_output_for_backward():
    q, k, v, _ = make_qkv(sq=32, seed=13)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))

    def count_saved(config):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            fp8_attention(q, k, v, config=config)
        return saved

    assert count_saved(MATCHED) == [q.shape, k.shape, v.shape, q.shape[:-1]]
    assert count_saved(STALE) == [q.shape, k.shape, v.shape, q.shape[:-1], q.shape]


def test_stale_and_matched_share_the_forward():
    q, k, v, _ = make_qkv(sq=64, seed=14)
    assert torch.equal(fp8_attention(q, k, v, config=MATCHED), fp8_attention(q, k, v, config=STALE))


@pytest.mark.parametrize("a", [100.0, 1000.0, 3000.0])
def test_huge_logits_keep_rows_normalised(a):
    """q = k = a·1 (logits 8e4 to 7e7), v = 1, causal: the exact output is 1 everywhere. Normalised
    through LSE = m + log l, which fp32 cannot hold apart from m at these magnitudes, the rows summed
    to up to their number of keys. The tile recipe (no smoothing: the logits stay huge) in fp32;
    every P code is 448 and every V code exact, so the output is 1 to fp32 rounding."""
    q = torch.full((1, 2, 70, 64), a)
    v = torch.ones(1, 2, 70, 64)
    config = FP8AttentionConfig.from_recipe("fp8_delta_tile", backend="emulation")
    q_, k_ = q.clone().requires_grad_(True), q.clone().requires_grad_(True)
    out = fp8_attention(q_, k_, v, causal=True, config=config)
    assert (out - 1).abs().max() < 1e-5
    dq, dk = torch.autograd.grad(out.sum(), (q_, k_))
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all()


def test_fp16_inputs_near_the_top_of_the_range_give_no_inf():
    """q = k = v = 6e4 in fp16 (logits 2.9e10): the output is v, finite (SDPA gives 6e4)."""
    x = torch.full((1, 1, 64, 64), 6e4, dtype=torch.float16)
    for config in (FP8AttentionConfig(backend="emulation"),
                   FP8AttentionConfig.from_recipe("fp8_delta_tile", backend="emulation")):
        out = fp8_attention(x, x, x, causal=True, config=config)
        assert torch.isfinite(out).all()
        assert (out.float() - 6e4).abs().max() <= 32  # fp16's spacing at 6e4
