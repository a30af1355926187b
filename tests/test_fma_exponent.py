"""The forwards' one-FMA exponent and the bound that guards it (kernels/exponent.py), on the CPU.

The Gluon kernel runs only on Hopper (tests/gpu/test_gluon_forward.py); these tests check the
arithmetic its switch rests on, replayed by benchmarks/fma_exponent.py in float64 with each fp32
operation rounded once, and run the Triton kernel's two forms under the interpreter:

- below ``FMA_EXPONENT_BOUND`` the FMA form's p stays within 2^-24 · bound · ln 2 (plus the last
  rounding of each form's exponent) of the exact form's, at the bound's extreme inputs too;
- above it the FMA form can move a whole row's p by whole code steps (why the guard exists);
- on the real-activation slice every 64-row group takes the FMA with a wide margin, and the FMA
  form changes almost no P code and the output by far less than the recipe's error;
- the Triton forward's FMA loop runs where the bound allows and keeps the exact loop's outputs, and
  the exact loop runs where it does not, or with a logit modifier.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from fma_exponent import compare, exponents, f32  # noqa: E402
from recipe_errors import DEFAULT_FIXTURE, load_layers  # noqa: E402

from helpers import make_qkv  # noqa: E402
from hf_fp8_attention import RECIPES  # noqa: E402
from hf_fp8_attention.kernels import exponent  # noqa: E402
from hf_fp8_attention.kernels.exponent import FMA_EXPONENT_BOUND, LOG2_PMAX, fma_row_bound  # noqa: E402
from hf_fp8_attention.kernels.forward import REF_SLACK, triton_forward  # noqa: E402
from hf_fp8_attention.kernels.quantize import interpreting  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402

D = 128
X_MAX = D * 448.0 * 448.0  # |x|: a sum of D products of E4M3 codes


def _rows_at(bound: float, n: int = 4096, seed: int = 0):
    """Scores at the extremes the bound allows: ``x (n, 8)`` with the row max near ±X_MAX, references
    r (the row max, or m − slack/q2), and the largest factor q2 whose bound is ``bound``."""
    g = torch.Generator().manual_seed(seed)
    q2_max = (bound - REF_SLACK - LOG2_PMAX) / X_MAX
    q2 = f32(q2_max * (0.5 + 0.5 * torch.rand(n, generator=g, dtype=torch.float64)))
    slack_x = f32(REF_SLACK / q2)
    top = f32((X_MAX - 2 * slack_x) * (2 * torch.rand(n, generator=g, dtype=torch.float64) - 1))
    x = f32(top[:, None] - X_MAX * 1e-4 * torch.rand(n, 8, generator=g, dtype=torch.float64))
    x[:, 0] = top
    # even rows: the tile's own max; odd rows: a running max 2 slacks above it, so r = m − slack/q2
    running = f32(top + 2 * slack_x)
    r = torch.where(torch.arange(n) % 2 == 0, top, torch.maximum(top, f32(running - slack_x)))
    return x, r, q2


def test_fma_form_stays_within_its_bound_below_the_threshold():
    x, r, q2 = _rows_at(FMA_EXPONENT_BOUND * 0.999)
    assert fma_row_bound(q2.max().item(), D, REF_SLACK) < FMA_EXPONENT_BOUND
    e_exact, e_fma = exponents(x, r, q2, fma=False), exponents(x, r, q2, fma=True)
    # r·q2 − log2 448 rounded: at most half an ulp, 2^-24 · |c|; each exponent's own last rounding:
    # half an ulp of values up to log2 448 (2^-21), twice.
    allowed = 2.0**-24 * FMA_EXPONENT_BOUND + 2 * 2.0**-21
    assert (e_fma - e_exact).abs().max().item() <= allowed
    # so the largest code (the row's max, exponent log2 448 in the exact form) never saturates by
    # more than that: 448 · 2^allowed
    assert torch.exp2(e_fma).max().item() <= 448.0 * 2.0**allowed


def test_fma_form_breaks_at_huge_logits():
    """Why the guard: at |r·q2| ~ 2^26 the rounded reference moves a row's p by whole code steps."""
    x, r, q2 = _rows_at(2.0**27, seed=1)
    assert fma_row_bound(q2.max().item(), D, REF_SLACK) > FMA_EXPONENT_BOUND
    shift = (exponents(x, r, q2, fma=True) - exponents(x, r, q2, fma=False)).abs().max().item()
    assert shift >= 1.0  # a factor 2 in p: a saturated max code, where the exact form gives 448


def test_nan_factor_fails_the_bound():
    assert not fma_row_bound(math.nan, D, REF_SLACK) < FMA_EXPONENT_BOUND
    assert not fma_row_bound(math.inf, D, REF_SLACK) < FMA_EXPONENT_BOUND


def test_switches_set_each_kernels_bound(monkeypatch):
    monkeypatch.setattr(exponent, "FMA_EXPONENT", False)
    monkeypatch.setattr(exponent, "FMA_EXPONENT_TRITON", True)
    assert exponent.fma_bound() == 0.0  # the exact form only, one copy of the loops
    assert exponent.fma_bound(triton=True) == FMA_EXPONENT_BOUND
    exponent.set_fma_exponent(True)
    assert exponent.fma_bound() == exponent.fma_bound(triton=True) == FMA_EXPONENT_BOUND
    exponent.set_fma_exponent(False)
    assert exponent.fma_bound() == exponent.fma_bound(triton=True) == 0.0


@pytest.mark.parametrize("recipe", ["fp8_delta", "fp8_delta_fast"])
def test_real_activations_take_the_fma_and_keep_their_outputs(recipe):
    """The committed slice (SmolLM2, layers 10 and 22, 512 tokens here; d = 64, where the bound's D is
    half the Gluon kernel's, so 2x is added to the margin below). Measured on 2048 tokens of four
    layers (benchmarks/NOTES.md): bounds 866-934 at most, p moved by 2.7e-6, 5e-7 to 9e-7 of the
    codes, O by at most 9.4e-5 relative per head."""
    for q, k, v, _ in load_layers(DEFAULT_FIXTURE, 512).values():
        stats = compare(q, k, v, RECIPES[recipe])
        assert 2 * stats["bound_max"] < FMA_EXPONENT_BOUND / 8
        assert stats["dp"] < 1e-5  # 2^-24 · (|r·q2| ~ 40) · ln 2, with room
        assert stats["flip_share"] < 1e-4
        # a code flip moves one term by one E4M3 step; against the recipe's ~1% error on O
        assert stats["o_diff"] < 1e-3
        assert abs(stats["o_err_fma"] - stats["o_err_exact"]) < 1e-4


# The Triton forward kernel under the interpreter (kernels/forward.py: one decision per program).
def _triton_forward(q, k, v, mask, config, fma: bool, monkeypatch, softcap=None):
    monkeypatch.setattr(exponent, "FMA_EXPONENT_TRITON", fma)
    return triton_forward(q, k, v, scale=q.shape[-1] ** -0.5, mask=mask, config=config, block_m=16, softcap=softcap)


needs_interpreter = pytest.mark.skipif(not interpreting(), reason="the interpreter's CPU run of the kernels")


@needs_interpreter
def test_triton_forward_fma_form_keeps_the_exact_forms_outputs(monkeypatch):
    """fp8_delta, GQA, causal, one packed batch of 9, 0 and 23 tokens: outputs within 1e-4 (norm) of
    the exact form's, LSE within 1e-5, and not the same bits (the FMA loop ran: the interpreter rounds
    x·q2 and the subtraction apart, so nearly every p moves in its last bits); dense, q and k 30x
    larger: the bound is exceeded and the exact loop runs, the same bits as with the switch off."""
    config = RECIPES["fp8_delta"].replace(backend="triton", block_q=16, block_k=16)
    q, k, v, _ = make_qkv(1, 2, 1, 32, d=64, dtype=torch.float32, seed=4, outliers=True)
    cu = torch.tensor([0, 9, 9, 32], dtype=torch.int32)
    mask = MaskSpec(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=23, max_seqlen_k=23)
    want, want_lse = _triton_forward(q, k, v, mask, config, False, monkeypatch)
    got, lse = _triton_forward(q, k, v, mask, config, True, monkeypatch)
    assert not torch.equal(got, want)
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    seen = torch.isfinite(want_lse)
    assert torch.equal(seen, torch.isfinite(lse)) and (lse[seen] - want_lse[seen]).abs().max().item() < 1e-5
    huge = (q[:, :, :16] * 30, k[:, :, :16] * 30, v[:, :, :16])
    runs = [_triton_forward(*huge, MaskSpec(causal=True), config, fma, monkeypatch) for fma in (True, False)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@needs_interpreter
def test_triton_forward_keeps_the_exact_form_with_a_soft_cap(monkeypatch):
    """The logit modifiers move x off the code products the bound is for: the exact form runs."""
    config = RECIPES["fp8_delta"].replace(backend="triton", block_q=16, block_k=16)
    q, k, v, _ = make_qkv(1, 2, 1, 16, d=64, dtype=torch.float32, seed=6)
    runs = [_triton_forward(q, k, v, MaskSpec(causal=True), config, fma, monkeypatch, softcap=20.0)
            for fma in (True, False)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))
