"""Measure the stale-delta bias and the FP8 error of one attention call (docs/design.md §1).

Two views of the same defect:

- **Zero-row-sum residual** (inside): exact softmax gradients satisfy Σ_j dS_ij = 0. Per query
  row we report |Σ_j dS_ij| / Σ_j P_ij |dP_ij|, with dS, P, dP the fp32 values the backward formed
  before quantizing dS. The denominator is the natural size of the row's terms, so the ratio is
  meaningful even when a row's gradient is tiny; rows with no visible key (denominator 0) are left out.
  With a soft-cap dS is the softmax input's gradient dS̃ (before the cap's factor); with sinks the
  row sum includes the sink's entry −P_sink D_i (dP_sink = 0 adds nothing to the denominator).
- **Key-shift residual** (outside): exact attention is invariant to adding one vector to every key,
  so Σ_j dK_j = 0 per (batch, kv head). We report ‖Σ_j dK_j‖ / ‖Σ_j |dK_j|‖.

Plus the relative error ‖x − x_exact‖ / ‖x_exact‖ of O, dQ, dK, dV against float64 attention.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import reference
from .config import FP8AttentionConfig
from .exact import exact_attention, exact_attention_grads
from .masking import MaskSpec

# FP8 error budget: relative Frobenius error of one attention call against float64 attention on
# well-conditioned (random-normal) inputs. E4M3 keeps 3 mantissa bits: unit roundoff u = 2^-4.
# Each FP8 matmul operand carries a per-element rounding error of at most u (RMS about u/3 for
# uniform mantissas), and independent errors average out in the sums, so one level of quantized
# matmul lands near u/2:
#   - O and dV pass through two quantized operand levels (S's operands via P, and V or dO): budget u.
#   - dQ and dK pass through three (S's operands, dP's operands, then dS and K/Q): budget 1.5u.
# Measured by the emulation: O 4.2-4.7%, dV 4.4-4.7%, dQ/dK 5.6-6.9% (seq 200-1000, d 64-128).
U_E4M3 = 2.0**-4
FP8_ERROR_BUDGET = {"out": U_E4M3, "dv": U_E4M3, "dq": 1.5 * U_E4M3, "dk": 1.5 * U_E4M3}
# The matched hybrid backward has bf16 operands (u = 2^-8) and inherits the FP8 forward only through
# its own normaliser: within 4 bf16 units (1.6%).
HYBRID_MATCHED_GRAD_BUDGET = 4 * 2.0**-8
# The sinks' gradient dσ_h = −Σ_i P_i,sink D_i is a signed sum over a head's rows, dominated by the
# few early rows of a causal head that see few keys, where single dP products carry large relative
# errors; its relative error over a handful of heads says little (40-110% measured on random
# inputs). It is measured against the natural size of its terms, Σ_i |P_i,sink D_i| (exact values,
# :func:`sink_grad_error`): D_i passes through two quantized levels (S's operands via P, dP's
# operands: u, as O) and P_sink through one (u/2), so 1.5u. Measured 0.4-1.6% (seq 100-513, d 64
# and 128, every recipe, with and without a cap).
SINK_GRAD_BUDGET = 1.5 * U_E4M3
# The matched zero-row-sum residual is fp32 rounding of the row sums (measured median 1e-8, max
# 3e-7 on random inputs); the stale delta leaves 1e-3..1e-1.
MATCHED_ROW_SUM_RESIDUAL_MAX = 1e-6


@dataclass
class DiagnosticsReport:
    """Results of :func:`diagnose`.

    ``row_sum_residual``: float64 ``(n_valid_rows,)``; ``key_shift_residual``: float;
    ``rel_err``: ``{"out", "dq", "dk", "dv"}`` -> float relative error against float64 attention.
    """

    row_sum_residual: torch.Tensor
    key_shift_residual: float
    rel_err: dict[str, float] = field(default_factory=dict)

    @property
    def median_row_sum_residual(self) -> float:
        return float(self.row_sum_residual.median()) if self.row_sum_residual.numel() else float("nan")

    def summary(self) -> dict[str, float]:
        """Flat dict of the headline numbers (for tables and logs)."""
        return {
            "row_sum_residual_median": self.median_row_sum_residual,
            "row_sum_residual_max": float(self.row_sum_residual.max()) if self.row_sum_residual.numel() else float("nan"),
            "key_shift_residual": self.key_shift_residual,
            **{f"rel_err_{k}": v for k, v in self.rel_err.items()},
        }


def row_sum_residual(internals: list[reference.BackwardInternals]) -> torch.Tensor:
    """Per valid row |Σ_j dS_ij (+ dS_i,sink)| / Σ_j P_ij |dP_ij| (float64, flattened over all
    heads/sequences)."""
    parts = []
    for it in internals:
        num = it.ds.double().sum(dim=-1)
        if it.ds_sink is not None:
            num = num + it.ds_sink.double()
        num = num.abs()
        den = (it.p.double() * it.dp.double().abs()).sum(dim=-1)
        parts.append((num / den)[den > 0])
    return torch.cat([p.flatten() for p in parts])


def key_shift_residual(dk: torch.Tensor) -> float:
    """‖Σ_j dK_j‖ / ‖Σ_j |dK_j|‖ for ``dk (B, Hkv, Sk, D)``, pooled over batch and heads."""
    dk = dk.double()
    return float(dk.sum(dim=-2).norm() / dk.abs().sum(dim=-2).norm())


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref).norm() / ref.norm())


def sink_grad_error(dsinks: torch.Tensor, q, k, v, dout, *, scale: float | None = None, mask: MaskSpec | None = None,
                    softcap: float | None = None, sinks: torch.Tensor) -> float:
    """Σ_h |dσ_h − dσ_h^exact| / Σ_h Σ_i |P_i,sink D_i| (exact, float64): the error of ``dsinks (Hq,)``
    against the natural size of its terms (see :data:`SINK_GRAD_BUDGET`). Inputs as for
    :func:`hf_fp8_attention.fp8_attention`."""
    mods = dict(scale=scale, mask=mask, softcap=softcap, sinks=sinks)
    out, *_, exact = exact_attention_grads(q, k, v, dout, **mods)
    # Each row's probability mass on the keys is the output for values of ones: P_sink = 1 − that.
    p_sink = 1 - exact_attention(q, k, torch.ones_like(v), **mods)[..., 0]
    delta = (dout.double() * out).sum(dim=-1)
    return float((dsinks.double() - exact).abs().sum() / (p_sink * delta).abs().sum())


def diagnose(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    *,
    config: FP8AttentionConfig | None = None,
    causal: bool = False,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> DiagnosticsReport:
    """Run the emulated FP8 forward and backward once and measure them.

    Args:
        q: ``(B, Hq, S, D)``; k, v: ``(B, Hkv, S, D)``; dout: like q. Any float dtype and device
            (the emulation runs wherever the tensors are; its memory is O(B·(Hq/Hkv)·Sq·Sk): one kv
            head's group at a time).
        softcap, sinks ``(Hq,)``: the logit modifiers of :func:`hf_fp8_attention.fp8_attention`;
            with sinks ``rel_err`` also has ``"dsinks"``, measured by :func:`sink_grad_error`.
    """
    config = config or FP8AttentionConfig()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mask = MaskSpec(causal=causal, window=window)
    # One kv head's group of query heads at a time: every recipe's scales, shifts and rotations are
    # per head, so the split changes no number and bounds the O(Hq·Sq·Sk) memory by one group's
    # (the sinks' gradient error, measured over all heads at once, aside).
    hkv = k.shape[1]
    group = q.shape[1] // hkv
    approx, exact, rows, dsinks = [], [], [], []  # per group: (out, dq, dk, dv), their exact twins
    for h in range(hkv):
        heads = slice(h * group, (h + 1) * group)
        qh, kh, vh, dh = q[:, heads], k[:, h:h + 1], v[:, h:h + 1], dout[:, heads]
        mods = dict(softcap=softcap, sinks=None if sinks is None else sinks[heads].float())
        out, lse = reference.emulated_forward(qh, kh, vh, scale=scale, mask=mask, config=config, **mods)
        grads, internals = reference.emulated_backward(
            qh, kh, vh, out, lse, dh, scale=scale, mask=mask, config=config, return_internals=True, **mods
        )
        approx.append((out, *grads[:3]))
        exact.append(exact_attention_grads(qh, kh, vh, dh, scale=scale, mask=mask, **mods)[:4])
        rows.append(row_sum_residual(internals))
        if sinks is not None:
            dsinks.append(grads[3])
        del internals  # the group's S x S tensors, freed before the next group allocates its own
    approx = [torch.cat(t, dim=1) for t in zip(*approx)]
    exact = [torch.cat(t, dim=1) for t in zip(*exact)]
    rel = {name: _rel_err(x, ref) for name, x, ref in zip(("out", "dq", "dk", "dv"), approx, exact)}
    if sinks is not None:
        rel["dsinks"] = sink_grad_error(torch.cat(dsinks), q, k, v, dout, scale=scale, mask=mask, softcap=softcap,
                                        sinks=sinks.float())
    return DiagnosticsReport(
        row_sum_residual=torch.cat(rows), key_shift_residual=key_shift_residual(approx[2]),
        rel_err=rel
    )
