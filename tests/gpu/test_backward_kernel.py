"""The Triton FP8 backward on an FP8-capable GPU: against the emulation (same config) and fp64.

The kernels get the emulation's forward (out, LSE) moved to the GPU, so these tests check the
backward alone. Tolerances, kernel vs emulation with the same config:
- On the GPU the per-token codes and scales of Q, K, V, dO are bit-identical to the emulation's
  (IEEE division, round-to-nearest-even saturating FP8 conversion). But Hopper's FP8 MMA does not
  accumulate in full fp32: it keeps ~14 mantissa bits (DeepSeek-V3 report, §3.3.2; seen here: the
  first GPU run measured 3.9e-3 on dQ at S=1000 with a bound of 1e-3). So the kernel's logits and
  dP carry ~2^-14 ≈ 6e-5 relative noise against the emulation's fp32 matmuls. dS = P(dP − D)
  cancels, which amplifies that noise to ~3e-4 of |dS| per element, and P/dS codes flip where it
  meets a rounding boundary (~2e-3 of elements, each moving 1/16 of one term): ~4e-3 of the
  gradient norm. GRAD_REL = 1e-2 covers that with 2.5x margin and stays 5x below the FP8
  quantization error itself (~5e-2 against fp64); a wrong tile, scale axis, mask or delta gives
  errors of that size or O(1), and the fp64 budget tests below bound the absolute error too.
- bf16 gradients: on top of the above, both sides round to bf16, so elements at a rounding
  boundary differ by one bf16 step (2^-8 relative at most): BF16_REL = GRAD_REL + 2^-8 (the first
  GPU run measured above 2^-8 alone, as the accumulation noise says it must).
Kernel vs float64: the FP8 budget of tests/helpers.py (dV: u = 2^-4, dQ/dK: 1.5u).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import BUDGET, make_qkv, rel_err  # noqa: E402

from hf_fp8_attention import FP8AttentionConfig  # noqa: E402
from hf_fp8_attention.diagnostics import key_shift_residual  # noqa: E402
from hf_fp8_attention.exact import exact_attention_grads  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from hf_fp8_attention.reference import emulated_backward, emulated_forward  # noqa: E402

pytestmark = pytest.mark.gpu

GRAD_REL = 1e-2
BF16_REL = GRAD_REL + 2.0**-8
MATCHED, STALE = FP8AttentionConfig.from_recipe("fp8_delta"), FP8AttentionConfig.from_recipe("fp8_stale")


def _kernels():
    from hf_fp8_attention.kernels import backward

    return backward


def _mask(causal=False, window=None, cu=None):
    if cu is None:
        return MaskSpec(causal=causal, window=window)
    cq, ck = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in cu)
    return MaskSpec(causal=causal, window=window, cu_seqlens_q=cq, cu_seqlens_k=ck)


def _setup(b, hq, hkv, sq, sk, d, mask, config, dtype=torch.float32, seed=0, outliers=False):
    """Inputs and the emulation's forward (out, LSE) on the GPU."""
    q, k, v, do = (t.cuda() for t in make_qkv(b, hq, hkv, sq, sk, d, dtype=dtype, seed=seed, outliers=outliers))
    scale = d**-0.5
    out, lse = emulated_forward(q, k, v, scale=scale, mask=mask, config=config)
    return q, k, v, do, out, lse, scale


def _kernel_and_emulation(shape, mask, config, dtype=torch.float32, seed=0):
    q, k, v, do, out, lse, scale = _setup(*shape, mask, config, dtype=dtype, seed=seed)
    got = _kernels().triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
    ref = emulated_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
    torch.cuda.synchronize()
    return got, ref


SHAPES = {
    # name: ((B, Hq, Hkv, Sq, Sk, D), mask kwargs)
    "dense_d64": ((2, 4, 2, 300, 300, 64), {}),
    "causal_d128_1000": ((1, 4, 1, 1000, 1000, 128), {"causal": True}),
    "causal_d96_odd17": ((2, 2, 2, 17, 17, 96), {"causal": True}),
    "causal_d80_gqa": ((1, 4, 2, 333, 333, 80), {"causal": True}),
    "causal_qshort": ((1, 4, 2, 129, 700, 128), {"causal": True}),
    "single_query": ((1, 4, 2, 1, 300, 64), {"causal": True}),
    "window_causal": ((1, 2, 1, 700, 700, 128), {"causal": True, "window": 200}),
    "window_noncausal": ((1, 2, 1, 400, 400, 64), {"window": 100}),
    "varlen_causal": ((1, 4, 2, 1000, 1000, 128), {"causal": True, "cu": ([0, 1, 300, 717, 1000], [0, 1, 300, 717, 1000])}),
    # Head dim 256 (Gemma 2/3): two 128-channel blocks per dQ/dK/dV tile (backward.LAUNCH_D256).
    "causal_d256_gqa": ((1, 4, 2, 700, 700, 256), {"causal": True}),
    "window_d256_odd": ((2, 2, 1, 333, 333, 256), {"causal": True, "window": 100}),
    "varlen_d256": ((1, 4, 2, 900, 900, 256), {"causal": True, "cu": ([0, 1, 300, 617, 900], [0, 1, 300, 617, 900])}),
}


# Every shape with the matched delta; the stale delta (a different dQ-kernel branch) on three.
EMULATION_CASES = [(name, "matched") for name in sorted(SHAPES)] + [
    (name, "stale") for name in ("causal_d128_1000", "varlen_causal", "window_noncausal", "causal_d256_gqa")
]


@pytest.mark.parametrize("name, delta", EMULATION_CASES)
def test_kernel_matches_emulation_fp32(name, delta):
    config = MATCHED if delta == "matched" else STALE
    shape, mask_kw = SHAPES[name]
    got, ref = _kernel_and_emulation(shape, _mask(**mask_kw), config)
    for label, x, r in zip(("dq", "dk", "dv"), got, ref):
        assert torch.isfinite(x).all(), label
        assert rel_err(x, r) <= GRAD_REL, (label, rel_err(x, r))


@pytest.mark.parametrize(
    "config",
    [
        FP8AttentionConfig.from_recipe("hybrid_delta"),
        FP8AttentionConfig.from_recipe("hybrid_stale"),
        FP8AttentionConfig.from_recipe("fp8_delta_pow2"),
        FP8AttentionConfig.from_recipe("fp8_delta_e5m2_grads"),
        FP8AttentionConfig(block_q=64, block_k=64),
        FP8AttentionConfig(block_q=256, block_k=256),  # single-stage launch (shared memory)
        FP8AttentionConfig(block_q=32, block_k=128),  # the smallest block the FP8 MMAs contract over
        FP8AttentionConfig(block_q=128, block_k=32),
    ],
    ids=["hybrid_delta", "hybrid_stale", "pow2", "e5m2_grads", "tiles64", "tiles256", "q32", "k32"],
)
@pytest.mark.parametrize("d", [128, 256])
def test_recipes_match_emulation(config, d):
    got, ref = _kernel_and_emulation((1, 4, 2, 513, 513, d), _mask(causal=True), config)
    for label, x, r in zip(("dq", "dk", "dv"), got, ref):
        assert rel_err(x, r) <= GRAD_REL, (label, rel_err(x, r))


@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize("config", [FP8AttentionConfig.from_recipe("fp8_delta_token"),
                                    FP8AttentionConfig.from_recipe("fp8_stale_token")], ids=["matched", "stale"])
def test_split_and_fused_launches_give_identical_gradients(config, d, monkeypatch):
    """The default launches (LSE'/D, dQ, dK, dV separately) and the fused ones compute every element
    with the same operations: identical gradients, as compiled for this GPU too. (So with P per tile:
    on the fixed grid the fused dK/dV launch forms dS from dV's 448·Pᵀ, one exponential per element,
    where the dK launch alone takes its own, so there dK differs by rounding.) At head dim 256 the
    table gives the statistics launch tiles of its own (64 rows on 4 warps against dQ's 128 on 8),
    whose row sums round in another order (the H200 saw dQ differ); here it takes dQ's shape, so
    that only the fusion differs."""
    mask = _mask(causal=True)
    q, k, v, do, out, lse, scale = _setup(2, 4, 2, 1000, 1000, d, mask, config, dtype=torch.bfloat16, seed=5)
    kernels = _kernels()
    if d > 128:
        monkeypatch.setitem(kernels.LAUNCH_D256, "dq_stats", dict(kernels.LAUNCH_D256["dq"]))
        monkeypatch.setitem(kernels.LAUNCH_D256, "free_tile", {**kernels.LAUNCH_D256["free_tile"],
                                                                "dq_stats": kernels.LAUNCH_D256["free_tile"]["dq"]})
    split = kernels.triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
    monkeypatch.setitem(kernels.LAUNCH, "split_dkdv", False)
    monkeypatch.setitem(kernels.LAUNCH, "split_dq_stats", False)
    fused = kernels.triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
    for label, a, b in zip(("dq", "dk", "dv"), split, fused):
        assert torch.equal(a, b), label


def test_bf16_inputs_match_emulation():
    got, ref = _kernel_and_emulation((2, 4, 2, 1000, 1000, 128), _mask(causal=True), MATCHED, dtype=torch.bfloat16)
    for label, x, r in zip(("dq", "dk", "dv"), got, ref):
        assert x.dtype == torch.bfloat16
        assert rel_err(x, r) <= BF16_REL, (label, rel_err(x, r))


@pytest.mark.parametrize("config, d", [(MATCHED, 64), (MATCHED, 96), (MATCHED, 128), (STALE, 128), (MATCHED, 256)],
                         ids=["matched-d64", "matched-d96", "matched-d128", "stale-d128", "matched-d256"])
def test_within_fp8_budget_of_float64(config, d):
    mask = _mask(causal=True)
    q, k, v, do, out, lse, scale = _setup(1, 4, 2, 1000, 1000, d, mask, config, dtype=torch.bfloat16, seed=d)
    got = _kernels().triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
    _, *exact = exact_attention_grads(q, k, v, do, scale=scale, mask=mask)
    for label, x, r in zip(("dq", "dk", "dv"), got, exact):
        assert rel_err(x, r) <= BUDGET[label], (label, rel_err(x, r))


@pytest.mark.parametrize("outliers", [False, True])
def test_matched_row_sums_vanish_stale_do_not_and_key_shift_shrinks(outliers):
    """Zero-row-sum residual |Σ_j dS_ij| / Σ_j P_ij|dP_ij| of the dS the kernel forms. Matched:
    fp32 rounding of row sums of up to 1024 terms (~sqrt(1024) · 2^-24 ≈ 2e-6 typical), so median
    <= 1e-5. Stale: the FP8 mismatch of rowsum(dO∘O) vs Σ P dP, >= 100x larger. The key-shift
    residual ‖Σ_j dK_j‖ / ‖Σ_j |dK_j|‖ shrinks with the matched delta."""
    mask = _mask(causal=True)
    res, shift = {}, {}
    for name, config in (("matched", MATCHED), ("stale", STALE)):
        q, k, v, do, out, lse, scale = _setup(1, 4, 2, 1024, 1024, 128, mask, config, seed=11, outliers=outliers)
        dq, dk, dv, ds_sum, pabs = _kernels().triton_backward_row_sums(
            q, k, v, out, lse, do, scale=scale, mask=mask, config=config
        )
        assert (pabs > 0).all()
        res[name] = (ds_sum.double().abs() / pabs.double()).median().item()
        shift[name] = key_shift_residual(dk)
    print(f"row-sum residual median {res}; key-shift residual {shift}")
    assert res["matched"] <= 1e-5, res
    assert res["stale"] >= 100 * max(res["matched"], 1e-8), res
    assert shift["matched"] < shift["stale"], shift


def test_rows_without_keys_get_zero_gradients_and_no_nan():
    # Sequence 0 has 300 queries and 100 keys (causal, aligned to the end): its first 200 queries
    # see nothing. Tokens after the last sequence belong to none.
    cu = ([0, 300, 800], [0, 100, 600])
    mask = _mask(causal=True, cu=cu)
    for config in (MATCHED, STALE):
        q, k, v, do, out, lse, scale = _setup(1, 2, 1, 900, 700, 128, mask, config, seed=2)
        dq, dk, dv = _kernels().triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
        for x in (dq, dk, dv):
            assert torch.isfinite(x).all()
        assert not dq[:, :, :200].any() and not dq[:, :, 800:].any()
        assert not dk[:, :, 600:].any() and not dv[:, :, 600:].any()
        ref = emulated_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
        for x, r in zip((dq, dk, dv), ref):
            assert rel_err(x, r) <= GRAD_REL


@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast", "fp8_stale"])
def test_nan_in_q_reaches_every_gradient_it_touches(recipe):
    """One NaN element of Q (non-causal, so its query row sees every key): its dQ row, and through
    its P row every dV row and through dS's scale of the head every dK row, are NaN; no
    gradient hides it. (Under the interpreter, whose fp32 -> FP8 cast turns NaN into a finite code,
    the fixed-grid P cannot carry it: tests/test_backward_interpreter.py.)"""
    config = FP8AttentionConfig.from_recipe(recipe)
    mask = _mask()
    q, k, v, do, out, lse, scale = _setup(1, 1, 1, 256, 256, 128, mask, config, seed=6)
    q[0, 0, 5, 7] = float("nan")
    dq, dk, dv = _kernels().triton_backward(q, k, v, out, lse, do, scale=scale, mask=mask, config=config)
    assert torch.isnan(dq[0, 0, 5]).all()
    assert torch.isnan(dv).all(), "every key's dV has a NaN term P_5j dO_5"
    assert not torch.isfinite(dk).all()


def test_deterministic_and_strided_inputs():
    """No atomics: two runs are bit-identical; non-contiguous (B, S, H, D)-transposed inputs give
    the same result as contiguous ones."""
    mask = _mask(causal=True)
    q, k, v, do, out, lse, scale = _setup(2, 4, 2, 777, 777, 128, mask, MATCHED, dtype=torch.bfloat16, seed=4)
    kb = _kernels()
    a = kb.triton_backward(q, k, v, None, lse, do, scale=scale, mask=mask, config=MATCHED)
    b = kb.triton_backward(q, k, v, None, lse, do, scale=scale, mask=mask, config=MATCHED)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    dot = do.transpose(1, 2).contiguous().transpose(1, 2)
    c = kb.triton_backward(qt, k, v, None, lse, dot, scale=scale, mask=mask, config=MATCHED)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y) and torch.equal(x, z)


def test_finite_difference_direction():
    """The FP8 gradient points downhill on the exact loss: for L = <O_exact(q, k, v), dO>,
    (L(x + εg) − L(x − εg)) / 2ε ≈ <∇L, g> > 0.9 |g| |∇L| for each FP8 gradient g (cosine > 0.9;
    the FP8 gradient error is ~5-10%, giving cosines ~0.99)."""
    from hf_fp8_attention.exact import exact_attention

    mask = _mask(causal=True)
    q, k, v, do, out, lse, scale = _setup(1, 2, 1, 64, 64, 64, mask, MATCHED, seed=9)
    grads = _kernels().triton_backward(q, k, v, None, lse, do, scale=scale, mask=mask, config=MATCHED)
    _, *exact = exact_attention_grads(q, k, v, do, scale=scale, mask=mask)
    args = [q.double(), k.double(), v.double()]
    for i, g in enumerate(grads):
        eps = 1e-4 / g.double().norm()
        plus, minus = list(args), list(args)
        plus[i] = args[i] + eps * g.double()
        minus[i] = args[i] - eps * g.double()
        fd = ((exact_attention(*plus, scale=scale, mask=mask) - exact_attention(*minus, scale=scale, mask=mask)) * do).sum() / (2 * eps)
        cos = fd / (g.double().norm() * exact[i].norm())
        assert cos > 0.9, (i, float(cos))


def test_autograd_through_fp8_attention_uses_the_kernel():
    """End to end through the public API (Triton forward + this backward) vs the emulation backend."""
    from hf_fp8_attention import fp8_attention

    q, k, v, do = (t.cuda() for t in make_qkv(1, 4, 2, 600, 600, 128, dtype=torch.float32, seed=7))
    res = {}
    for backend in ("triton", "emulation"):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        o = fp8_attention(*leaves, causal=True, config=MATCHED.replace(backend=backend))
        res[backend] = torch.autograd.grad(o, leaves, do)
    for x, r in zip(res["triton"], res["emulation"]):
        assert rel_err(x, r) <= GRAD_REL
