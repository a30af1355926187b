"""How far the FP8 kernels may sit from the emulation on one problem: the code-flip noise model.

The GPU tests' base bounds (O_REL, GRAD_REL, LSE_ABS) are typical sizes of the kernel-vs-emulation
noise on problems of hundreds of rows and keys with unit-normal inputs. That noise is code flips:
the kernel's FP8 MMA accumulates in 13 mantissa bits and truncates, a mean error of 2^-14 of each
partial sum (tests/gpu/test_forward_kernel.py measured ~14 bits), so a value x it rounds to an FP8
code (P for O and dV, dS for dQ and dK) differs from the emulation's by some Δx, and where x lies
within Δx of a rounding boundary the two round to neighbouring codes, one step (2^-m of |x| to
within a factor 2) apart. The GPU tests' docstrings put the flipped share at ~1% of
P codes and ~0.2% of dS codes on their problems (the first GPU run measured ‖ΔdQ‖/‖dQ‖ = 3.9e-3 at
S = 1000, a 0.17% share at one step per flip). A problem may have a handful of terms (one query, a
window of 2), terms that are themselves a cancellation residue (a query that sees one key, with
the stale delta: dS = dP − rowsum(dO ∘ O) is then the FP8 error of O alone, so a fixed Δx is a
large share of x), or logits far larger than unit-normal inputs give (outlier channels, a sink
key): there few terms flip, or many do. The model scales the measured shares by the problem's
sensitivity to the same noise. Per element, from the emulation's own P and dS (fp32, before
quantization):
  Δs  = 2^-14 · τ ‖q_i‖ (‖k_j‖ + ‖μ‖)                logit noise; ΔP = P Δs
  ΔdP = 2^-14 · ‖dO_i‖ ‖v_j‖
  ΔdS = P ΔdP + Δs |dS| + P |ΔD|,   ΔD = Σ_j (P ΔdP + Δs P |dP|) matched, 0 stale (rowsum(dO ∘ O)
        of the same inputs on both sides)
  f   = min(1, 2^m |Δx| / (|x| ln 2))                flip probability (codes log-uniform in a binade)
and F = Σ f t² / Σ t² over the terms t of a sum is the share of its sum of squares that flips.
The products of norms bound Σ_d |q_d k_d| of whatever the kernel multiplies (a rotation keeps norms;
K-smoothing subtracts the keys' channel mean μ), so the model holds for every recipe. A soft-cap's
slope is at most 1 (it shrinks a logit's noise) and a sink is one exact logit, so both enter only
through the emulation's P and dS. These Δ are sums of absolute sizes, larger than the errors'
typical size, so F itself overstates the share; the problem's share is the measured one times
F(problem) / F(reference), with the reference the GPU tests' problem (unit-normal inputs, d = 128,
1000 causal tokens). With n_eff = (Σ t²)² / Σ t⁴ the number of terms carrying the sum of squares,
the flipped count is Poisson(share · n_eff), below k_max with probability 1 - 1e-4, and one flip
moves its term by 2^-m / u for |x| = u 2^e, u in [1, 2): over a log-uniform u, each flip weighted
by its probability (∝ u), that is sqrt(1/2) · 2^-m rms, so
  ‖Δ‖/‖ref‖ <= max(base, sqrt(1/2) · 2^-m · sqrt(k_max / n_eff)).
Outlier inputs: the flip model widens a bound only where terms are few; over many terms it gives
the base bound back, which is a typical size on unit-normal problems. Where a problem's noise is
larger than that everywhere (outlier channels: each wgmma step aligns its addends to the largest
one, tests/hopper_accumulator.py), ``accumulator_model=True`` scales the base bounds of O and the
gradients by the ratio of that model's difference on the problem to its difference on the reference
problem, when above 1. (On the soft-cap/sink tests' inputs the model gave 0.0109 for the stale
recipe's dQ with sinks and a 200-key window, 2.1x the reference; the H200 measured 0.0113 against a
base bound of 0.01. The model's gradients match the H200 to within ~10% on the three cases it puts
nearest their bounds.)
LSE: ΔLSE_i = Σ_j P_ij Δs_ij to first order. Hopper's FP8 MMA adds each 32-wide slice of a dot into
an accumulator of 13 mantissa bits that truncates (e8m13), so an add is off by up to 2^-13 of the
partial sum (2^-14 on average, the 2^-14 above), and |Δs_ij| <= (D/32) · 2^-13 · τ ‖q_i‖ (‖k_j‖ + ‖μ‖).
That is not a strict worst case (each step also cuts its addends at the largest one's exponent,
tests/hopper_accumulator.py), but truncation errors share a sign, so it takes the per-add maximum:
with the mean 2^-14 instead, the H200 measured up to 1.66x the model's LSE on the soft-cap/sink
tests (unsmoothed, unrotated keys with outlier channels); with 2^-13 those five are covered (1.2x
margin at the largest), as is the accumulator model's LSE on every soft-cap/sink case
(benchmarks/results/cpu_predicted_softcap_sinks_g2.md). The base LSE_ABS is the typical size on
unit-normal inputs, and the bound is the larger of the two.
"""
from __future__ import annotations

import functools
import math

import torch

from hf_fp8_attention import RECIPES, FP8AttentionConfig
from hf_fp8_attention.config import DeltaMode
from hf_fp8_attention.masking import MaskSpec
from hf_fp8_attention.reference import emulated_backward, emulated_forward

FLIP_RATE = {"p": 1e-2, "ds": 2e-3}  # the flipped shares on the reference problem
ACCUMULATOR_BITS = 13  # mantissa bits the FP8 MMA's accumulator keeps; it truncates
MMA_SLICE = 32  # tokens or channels one FP8 MMA step contracts before it adds into the accumulator
STEP_RMS = math.sqrt(0.5)  # one flip's rms step over |x|, in units of 2^-m
TAIL = 1e-4


def poisson_upper(lam: float, tail: float = TAIL) -> int:
    """The smallest k with P(Poisson(lam) > k) < tail."""
    k, pmf = 0, math.exp(-lam)
    cdf = pmf
    while 1.0 - cdf >= tail:
        k += 1
        pmf *= lam / k
        cdf += pmf
    return k


class TermStats:
    """Σ t², Σ t⁴ and Σ f t² over the terms t of a sum, accumulated over packed sequences."""

    def __init__(self):
        self.s2 = self.s4 = self.flipped = 0.0

    def add(self, terms: torch.Tensor, flip: torch.Tensor) -> None:
        t2 = terms.double() ** 2
        self.s2 += float(t2.sum())
        self.s4 += float((t2 * t2).sum())
        self.flipped += float((flip.double() * t2).sum())

    @property
    def n_eff(self) -> float:
        """How many terms carry the sum of squares: (Σ t²)² / Σ t⁴ (inf without any)."""
        return self.s2 * self.s2 / self.s4 if self.s4 > 0 else float("inf")

    @property
    def flip_share(self) -> float:
        """F = Σ f t² / Σ t²: the expected share of the sum of squares that flips."""
        return self.flipped / self.s2 if self.s2 > 0 else 0.0


def flip_probability(x: torch.Tensor, noise: torch.Tensor, mantissa_bits: int) -> torch.Tensor:
    """min(1, 2^m |Δx| / (|x| ln 2)) per element (1 where x = 0: such a term weighs nothing)."""
    ratio = noise / x.abs()
    return torch.where(x == 0, 1.0, (2.0**mantissa_bits / math.log(2) * ratio).clamp(max=1.0))


def flip_bound(base: float, stats: TermStats, share: float, mantissa_bits: int) -> float:
    """``base``, or the model's bound for these terms (``share`` of them flipped) when that is
    larger (module docstring)."""
    n_eff = stats.n_eff
    if not math.isfinite(n_eff):
        return base
    step = STEP_RMS * 2.0**-mantissa_bits
    return max(base, step * math.sqrt(poisson_upper(share * n_eff) / n_eff))


class _Problem:
    """The emulation's forward and backward of one problem, and the model's per-element noise."""

    def __init__(self, q, k, v, dout, mask: MaskSpec, config: FP8AttentionConfig, scale: float, mods: dict):
        q, k, v, dout = (t.detach() for t in (q, k, v, dout))
        out, self.lse = emulated_forward(q, k, v, scale=scale, mask=mask, config=config, **mods)
        _, self.internals = emulated_backward(q, k, v, out, self.lse, dout, scale=scale, mask=mask,
                                              config=config, return_internals=True, **mods)
        self.spans = mask.sequence_bounds() if mask.is_varlen else [(0, q.shape[2], 0, k.shape[2])]
        self.q, self.k, self.v, self.dout = (t.float() for t in (q, k, v, dout))
        self.hkv, self.g = k.shape[1], q.shape[1] // k.shape[1]
        self.scale, self.smooth_k = scale, config.smooth_k

    def noise(self, span):
        """(Δs, ΔdP) of one sequence ``(B, Hkv, G, Sq_span, Sk_span)`` (module docstring)."""
        qs, qe, ks, ke = span
        keys = self.k[:, :, ks:ke]
        q_norm = self.q[:, :, qs:qe].norm(dim=-1).unflatten(1, (self.hkv, self.g))[..., None]
        do_norm = self.dout[:, :, qs:qe].norm(dim=-1).unflatten(1, (self.hkv, self.g))[..., None]
        k_norm = keys.norm(dim=-1)
        if self.smooth_k and ke > ks:
            k_norm = k_norm + keys.mean(dim=2, keepdim=True).norm(dim=-1)
        v_norm = self.v[:, :, ks:ke].norm(dim=-1)
        unit = 2.0 ** -(ACCUMULATOR_BITS + 1)  # a truncation's mean error, in units of the partial sum
        return (unit * self.scale * q_norm * k_norm[:, :, None, None, :],
                unit * do_norm * v_norm[:, :, None, None, :])

    def term_stats(self, config: FP8AttentionConfig) -> tuple[TermStats, TermStats]:
        """(P terms, dS terms) under the model of the module docstring."""
        p_bits, ds_bits = config.p_format.mantissa_bits, config.ds_format.mantissa_bits
        matched = config.delta is DeltaMode.MATCHED
        p_stats, ds_stats = TermStats(), TermStats()
        for span, parts in zip(self.spans, self.internals):
            d_logit, d_dp = self.noise(span)
            p, dp, ds = parts.p, parts.dp, parts.ds
            d_delta = (p * d_dp + d_logit * p * dp.abs()).sum(-1, keepdim=True) if matched else 0.0
            d_ds = p * d_dp + d_logit * ds.abs() + p * d_delta
            p_stats.add(p, flip_probability(torch.ones_like(p), d_logit, p_bits))  # ΔP / P = Δs
            ds_stats.add(ds, flip_probability(ds, d_ds, ds_bits))
        return p_stats, ds_stats

    def lse_model(self) -> float:
        """max_i Σ_j P_ij |Δs_ij| with the worst-case slice-accumulated Δs (module docstring)."""
        d = self.q.shape[-1]
        worst_per_add = 2.0  # a truncation's worst error over its mean
        worst = 0.0
        for span, parts in zip(self.spans, self.internals):
            if span[3] > span[2] and span[1] > span[0]:
                d_logit, _ = self.noise(span)
                per_row = (parts.p * d_logit).sum(-1) * (max(d, MMA_SLICE) / MMA_SLICE) * worst_per_add
                worst = max(worst, float(per_row.max()))
        return worst


def _reference_problem():
    """The GPU tests' problem the base bounds and FLIP_RATE come from (module docstring)."""
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 4, 1000, 128, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, 2, 1000, 128, generator=gen) for _ in range(2))
    return q, k, v, dout, MaskSpec(causal=True), RECIPES["fp8_delta"], 128**-0.5


@functools.lru_cache(maxsize=1)
def reference_flip_shares() -> tuple[float, float]:
    """The model's F for P and for dS on the reference problem (module docstring)."""
    q, k, v, dout, mask, config, scale = _reference_problem()
    p_stats, ds_stats = _Problem(q, k, v, dout, mask, config, scale, {}).term_stats(config)
    return p_stats.flip_share, ds_stats.flip_share


@functools.lru_cache(maxsize=1)
def reference_modelled_differences() -> dict:
    """tests/hopper_accumulator.py's differences on the reference problem (module docstring)."""
    from hopper_accumulator import modelled_differences

    return modelled_differences(*_reference_problem())


def accumulator_scales(q, k, v, dout, mask: MaskSpec, config: FP8AttentionConfig, scale: float, mods: dict) -> dict:
    """Per O and gradient, max(1, the accumulator model's difference on this problem over the one on
    the reference problem) (module docstring)."""
    from hopper_accumulator import modelled_differences

    here = modelled_differences(*(t.detach().cpu().float() for t in (q, k, v, dout)), _on_cpu(mask), config,
                                scale, {n: x.cpu() if torch.is_tensor(x) else x for n, x in mods.items()})
    ref = reference_modelled_differences()
    return {n: max(1.0, here[n] / ref[n]) for n in ("o", "dq", "dk", "dv")}


def _on_cpu(mask: MaskSpec) -> MaskSpec:
    if not mask.is_varlen:
        return mask
    return MaskSpec(causal=mask.causal, window=mask.window, cu_seqlens_q=mask.cu_seqlens_q.cpu(),
                    cu_seqlens_k=mask.cu_seqlens_k.cpu())


def noise_bounds(q, k, v, dout, mask: MaskSpec, config: FP8AttentionConfig, *, scale: float, o_rel: float,
                 lse_abs: float, grad_rel: float, softcap: float | None = None,
                 sinks: torch.Tensor | None = None, accumulator_model: bool = False) -> dict:
    """The bounds on one problem, q/dout ``(B, Hq, Sq, D)``, k/v ``(B, Hkv, Sk, D)`` (any device and
    dtype; ``softcap``, ``sinks`` ``(Hq,)`` as :func:`emulated_forward` takes them): ``o``, ``lse``
    (absolute), ``dq``, ``dk``, ``dv`` (relative, before the bf16/fp16 output rounding the caller
    adds). Each is the base bound or the model's, whichever is larger; with ``accumulator_model``
    the base bounds of O and the gradients are first scaled by :func:`accumulator_scales`."""
    mods = {name: x for name, x in (("softcap", softcap), ("sinks", sinks)) if x is not None}
    problem = _Problem(q, k, v, dout, mask, config, scale, mods)
    p_stats, ds_stats = problem.term_stats(config)
    p_ref, ds_ref = reference_flip_shares()
    p_share = FLIP_RATE["p"] * p_stats.flip_share / p_ref
    ds_share = FLIP_RATE["ds"] * ds_stats.flip_share / ds_ref
    p_bits, ds_bits = config.p_format.mantissa_bits, config.ds_format.mantissa_bits
    base = {"o": o_rel, "dq": grad_rel, "dk": grad_rel, "dv": grad_rel}
    if accumulator_model:
        scales = accumulator_scales(q, k, v, dout, mask, config, scale, mods)
        base = {n: b * scales[n] for n, b in base.items()}
    return {
        "o": flip_bound(base["o"], p_stats, p_share, p_bits),
        "lse": max(lse_abs, problem.lse_model()),
        "dv": flip_bound(base["dv"], p_stats, p_share, p_bits),  # dV's terms are P codes
        "dq": flip_bound(base["dq"], ds_stats, ds_share, ds_bits),
        "dk": flip_bound(base["dk"], ds_stats, ds_share, ds_bits),
    }


def grad_bounds(errors: dict, q, k, v, dout, mask: MaskSpec, config: FP8AttentionConfig, *, scale: float,
                grad_rel: float) -> dict:
    """The bounds on gradient errors ``errors`` ({"dq" | "dk" | "dv": relative error}) for one
    problem (q/dout ``(B, Hq, Sq, D)``, k/v ``(B, Hkv, Sk, D)``, on the CPU): ``grad_rel`` where
    every error is within it, else :func:`noise_bounds`' with the accumulator model (never below
    ``grad_rel``), so that a problem more sensitive than the reference to the accumulation noise
    gets its own bound. The same test as always taking the model's, which costs seconds per problem
    on the CPU."""
    if all(e <= grad_rel for e in errors.values()):
        return dict.fromkeys(errors, grad_rel)
    model = noise_bounds(q, k, v, dout, mask, config, scale=scale, o_rel=grad_rel, lse_abs=1.0, grad_rel=grad_rel,
                         accumulator_model=True)
    return {name: model[name] for name in errors}
