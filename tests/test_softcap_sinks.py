"""Logit soft-capping and attention sinks in the emulation (docs/design.md, "Soft-capping and
attention sinks"): exactness without quantization, the zero-row-sum invariant, the FP8 error
budget, rows with no key, the custom-op / compile path and bad input. (The kernels against the
emulation: test_softcap_sinks_interpreter.py, tests/gpu/test_softcap_sinks_kernel.py.)

Tolerances:
- quantization off: fp32 rounding against float64, 1e-5 relative as in test_recipes (fp32 matmuls
  over 150 terms; dsinks is a signed sum over a head's rows, measured up to 2e-6);
- FP8 against float64: the budgets of :mod:`hf_fp8_attention.diagnostics`, unchanged by the
  features: the cap is elementwise with slope 1 − (s̃/c)² ≤ 1, so it shrinks a logit's FP8 error
  rather than amplifying it, and the sink is one exact logit in the normaliser with no quantized
  operand; dsinks against the natural size of its terms (``SINK_GRAD_BUDGET``).
"""
import math

import pytest
import torch

from hf_fp8_attention import RECIPES, FP8AttentionConfig, fp8_attention, reference
from hf_fp8_attention.diagnostics import (
    FP8_ERROR_BUDGET,
    HYBRID_MATCHED_GRAD_BUDGET,
    MATCHED_ROW_SUM_RESIDUAL_MAX,
    SINK_GRAD_BUDGET,
    diagnose,
    row_sum_residual,
)
from hf_fp8_attention.exact import exact_attention_grads
from hf_fp8_attention.masking import MaskSpec

from helpers import make_qkv, rel_err

CU = torch.tensor([0, 60, 140], dtype=torch.int32)  # two packed sequences and 10 tokens of padding
MASKS = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window=20),
    "full": dict(),
    "varlen": dict(causal=True, cu_seqlens_q=CU, cu_seqlens_k=CU),
}
MODS = ("softcap", "sinks", "both")
SOFTCAP = 3.0  # logits of the inputs below reach ~±8: the cap bends most of them


def _mask_spec(kwargs) -> MaskSpec:
    return MaskSpec(causal=kwargs.get("causal", False), window=kwargs.get("window"),
                    cu_seqlens_q=kwargs.get("cu_seqlens_q"), cu_seqlens_k=kwargs.get("cu_seqlens_k"))


def _inputs(seed=0, sq=150, d=64, dtype=torch.float32, scale_qk=2.0):
    q, k, v, dout = make_qkv(hq=4, hkv=2, sq=sq, d=d, dtype=torch.float32, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    sinks = torch.randn(4, generator=g) * 2
    # A key bias (mean 1) so that K-smoothing's row constant is large and must be put back.
    return (q * scale_qk).to(dtype), (k * scale_qk + 1).to(dtype), v.to(dtype), dout.to(dtype), sinks


def _mods(name, sinks):
    return {"softcap": dict(softcap=SOFTCAP), "sinks": dict(sinks=sinks),
            "both": dict(softcap=SOFTCAP, sinks=sinks)}[name]


def _run(q, k, v, dout, config, mods, **mask):
    """fp8_attention's output and gradients (dq, dk, dv[, dsinks])."""
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    mods = dict(mods)
    if mods.get("sinks") is not None:
        mods["sinks"] = mods["sinks"].clone().requires_grad_(True)
        leaves.append(mods["sinks"])
    out = fp8_attention(*leaves[:3], config=config, **mods, **mask)
    return (out, *torch.autograd.grad(out, leaves, dout))


@pytest.fixture
def no_quantization(monkeypatch):
    """Every FP8 rounding of the emulation switched off (as in test_recipes)."""
    monkeypatch.setattr(reference, "fake_quantize", lambda x, **_: x.float())
    monkeypatch.setattr(reference, "fp8_round", lambda x, fmt: x)


# ---------------------------------------------------------------------------------------------
# exactness without quantization
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("delta", ["matched", "stale"])
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("mods", MODS)
def test_exact_without_quantization(no_quantization, mods, mask, delta):
    """The default recipe (K-smoothing and rotation), GQA 4/2: outputs and every gradient,
    dsinks included, equal float64 attention with the same cap and sinks."""
    q, k, v, dout, sinks = _inputs()
    m = _mods(mods, sinks)
    got = _run(q, k, v, dout, FP8AttentionConfig(backend="emulation", delta=delta), m, **MASKS[mask])
    want = exact_attention_grads(q, k, v, dout, mask=_mask_spec(MASKS[mask]), **m)
    assert len(got) == len(want)
    for name, x, ref in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert rel_err(x, ref) < 1e-5, (name, rel_err(x, ref))


@pytest.mark.parametrize("recipe", ["fp8_delta_fast", "fp8_delta_tile"])
def test_exact_without_quantization_other_recipes(no_quantization, recipe):
    """Per-head scales (fast) and no transforms (tile: nothing to put back before the cap)."""
    q, k, v, dout, sinks = _inputs(seed=1)
    m = _mods("both", sinks)
    got = _run(q, k, v, dout, RECIPES[recipe].replace(backend="emulation"), m, causal=True)
    want = exact_attention_grads(q, k, v, dout, mask=MaskSpec(causal=True), **m)
    for name, x, ref in zip(("out", "dq", "dk", "dv", "dsinks"), got, want):
        assert rel_err(x, ref) < 1e-5, (name, rel_err(x, ref))


def test_smoothing_constant_is_put_back(no_quantization):
    """Without the row constant τ q·μ, K-smoothing would shift the logits against the cap and the
    sink: the smoothed recipe would then differ from the unsmoothed one by far more than rounding."""
    q, k, v, dout, sinks = _inputs(seed=2)
    m = _mods("both", sinks)
    smooth = _run(q, k, v, dout, FP8AttentionConfig(backend="emulation", hadamard=False), m, causal=True)
    plain = _run(q, k, v, dout, FP8AttentionConfig(backend="emulation", hadamard=False, smooth_k=False), m,
                 causal=True)
    for x, y in zip(smooth, plain):
        assert rel_err(x, y) < 1e-5


def test_hybrid_backward_with_features_is_bf16_accurate():
    """FP8 forward, bf16 backward (matched): the bf16 budget of test_reference, features on."""
    q, k, v, dout, sinks = _inputs(seed=3, dtype=torch.bfloat16, scale_qk=1.0)
    m = _mods("both", sinks)
    got = _run(q, k, v, dout, RECIPES["hybrid_delta"].replace(backend="emulation"), m, causal=True)
    want = exact_attention_grads(q, k, v, dout, mask=MaskSpec(causal=True), **m)
    for name, x, ref in zip(("dq", "dk", "dv"), got[1:4], want[1:4]):
        assert rel_err(x, ref) <= HYBRID_MATCHED_GRAD_BUDGET, (name, rel_err(x, ref))


# ---------------------------------------------------------------------------------------------
# the zero-row-sum invariant and the FP8 error budget
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mods, causal", [("softcap", False), ("sinks", True), ("both", True)])
def test_matched_zero_row_sum_with_features(mods, causal):
    """Matched: Σ_j dS̃_ij (+ the sink's −P_sink D_i) is fp32 rounding; stale: FP8-sized."""
    q, k, v, dout, sinks = _inputs(seed=4, sq=200, dtype=torch.bfloat16, scale_qk=1.0)
    m = _mods(mods, sinks)
    mask = MaskSpec(causal=causal)
    residuals = {}
    for recipe in ("fp8_delta", "fp8_stale"):
        config = RECIPES[recipe]
        out, lse = reference.emulated_forward(q, k, v, scale=0.125, mask=mask, config=config, **m)
        _, internals = reference.emulated_backward(q, k, v, out, lse, dout, scale=0.125, mask=mask, config=config,
                                                   return_internals=True, **m)
        assert (internals[0].ds_sink is None) == (mods == "softcap")
        residuals[recipe] = float(row_sum_residual(internals).median())
    good, bad = residuals["fp8_delta"], residuals["fp8_stale"]
    assert good <= MATCHED_ROW_SUM_RESIDUAL_MAX
    assert bad >= 100 * max(good, 1e-8)


@pytest.mark.parametrize("recipe, d, causal", [("fp8_delta", 64, True), ("fp8_delta", 128, False),
                                               ("fp8_delta_fast", 64, False), ("fp8_stale", 128, True)])
def test_fp8_errors_within_budget_with_features(recipe, d, causal):
    """Cap 1 (every logit of these inputs, std 1, is bent) and sinks: the budgets of the plain op."""
    q, k, v, dout = make_qkv(sq=200, d=d, seed=d + causal)
    sinks = torch.randn(4, generator=torch.Generator().manual_seed(d)) * 2
    report = diagnose(q, k, v, dout, config=RECIPES[recipe], causal=causal, softcap=1.0, sinks=sinks)
    for name, budget in FP8_ERROR_BUDGET.items():
        assert report.rel_err[name] <= budget, (name, report.rel_err[name], budget)
    assert report.rel_err["dsinks"] <= SINK_GRAD_BUDGET, report.rel_err["dsinks"]


# ---------------------------------------------------------------------------------------------
# rows with no key, non-finite values, dtypes
# ---------------------------------------------------------------------------------------------


def test_rows_with_no_key_put_their_mass_on_the_sink():
    """A packed sequence with queries and no keys: with sinks every row of it is all sink, so its
    output is 0, its LSE is σ_h, and every gradient is finite (its rows add nothing to dsinks)."""
    q, k, v, dout, sinks = _inputs(seed=5, sq=40)
    cu_q = torch.tensor([0, 10, 40], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 30], dtype=torch.int32)  # sequence 0: 10 queries, no key
    mask = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for config in (RECIPES["fp8_delta"], RECIPES["fp8_stale"]):
        out, lse = reference.emulated_forward(q, k, v, scale=0.125, mask=_mask_spec(mask), config=config,
                                              sinks=sinks, softcap=SOFTCAP)
        assert not out[:, :, :10].any()
        torch.testing.assert_close(lse[0, :, :10], sinks[:, None].expand(4, 10), rtol=0, atol=0)
        got = _run(q, k, v, dout, config, dict(sinks=sinks, softcap=SOFTCAP), **mask)
        assert all(torch.isfinite(g).all() for g in got)
        assert not got[1][:, :, :10].any()  # dq of the keyless rows
        alone = _run(q[:, :, 10:], k[:, :, :30], v[:, :, :30], dout[:, :, 10:], config,
                     dict(sinks=sinks, softcap=SOFTCAP))
        torch.testing.assert_close(got[4], alone[4], rtol=1e-5, atol=1e-6)


def test_nan_sink_is_not_hidden():
    q, k, v, _, sinks = _inputs(seed=6, sq=20)
    sinks[1] = float("nan")
    out = fp8_attention(q, k, v, causal=True, sinks=sinks)
    assert out[:, 1].isnan().all()
    assert torch.isfinite(out[:, [0, 2, 3]]).all()


def test_sinks_of_another_dtype_get_their_gradient_in_it():
    """bf16 q/k/v with an fp32 sinks parameter (a model's parameter under autocast) and a bf16 one."""
    q, k, v, dout, sinks = _inputs(seed=7, sq=30, dtype=torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16):
        s = sinks.detach().to(dtype).requires_grad_(True)
        fp8_attention(q, k, v, causal=True, sinks=s).float().mul(dout.float()).sum().backward()
        assert s.grad.dtype == dtype and torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# the custom ops and torch.compile
# ---------------------------------------------------------------------------------------------


def test_custom_op_and_compile_equal_the_eager_path():
    """fullgraph compile (aot_eager: the custom ops and their autograd formula) and the eager
    autograd Function give the same output and gradients, dsinks included, bit for bit."""
    q, k, v, dout, sinks = _inputs(seed=8, sq=40)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]

    def attend(q, k, v, s):
        return fp8_attention(q, k, v, causal=True, window=17, softcap=SOFTCAP, sinks=s)

    torch._dynamo.reset()
    try:
        compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")(*leaves)
        grads_c = torch.autograd.grad(compiled, leaves, dout)
    finally:
        torch._dynamo.reset()
    eager = attend(*leaves)
    grads_e = torch.autograd.grad(eager, leaves, dout)
    assert torch.equal(compiled, eager)
    for a, b in zip(grads_c, grads_e):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"softcap": 0.0}, ValueError, "softcap must be a positive finite number"),
        ({"softcap": -2.0}, ValueError, "softcap must be a positive finite number"),
        ({"softcap": math.inf}, ValueError, "softcap must be a positive finite number"),
        ({"softcap": math.nan}, ValueError, "softcap must be a positive finite number"),
        ({"softcap": True}, ValueError, "softcap must be a positive finite number"),
        ({"softcap": "50"}, ValueError, "softcap must be a positive finite number"),
        ({"sinks": [0.0] * 4}, TypeError, "sinks must be a torch.Tensor"),
        ({"sinks": torch.zeros(4, dtype=torch.int64)}, TypeError, "sinks must be a floating-point tensor"),
        ({"sinks": torch.zeros(2)}, ValueError, r"sinks must have shape \(num_query_heads,\) = \(4,\)"),
        ({"sinks": torch.zeros(1, 4)}, ValueError, r"got shape \(1, 4\)"),
        ({"sinks": torch.zeros(4, device="meta")}, ValueError, "sinks must be on q's device"),
    ],
)
def test_bad_softcap_and_sinks(kwargs, error, message):
    q, k, v = make_qkv(sq=16)[:3]
    with pytest.raises(error, match=message):
        fp8_attention(q, k, v, **kwargs)
