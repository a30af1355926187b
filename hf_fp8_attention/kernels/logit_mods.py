"""Logit soft-capping and attention sinks in the kernels (docs/design.md §1, "Soft-capping and
attention sinks"; the emulation in :mod:`hf_fp8_attention.reference` defines the numerics).

The kernels work in log2 units (τ·log2 e folded into the logits), so every modifier is passed in
them: the cap c₂ = c·log2 e (c·tanh(s/c) in natural units is c₂·tanh(s₂/c₂) in log2 units), the
sinks σ₂ = σ·log2 e, and K-smoothing's row constant τ q_i·μ·log2 e, added back to the logits where
a cap or a sink needs it (:func:`hf_fp8_attention.reference.smoothing_shift`). Each is a constexpr
flag of the kernels: without it the kernels compile to the code they had before.

- :class:`LogitMods` and :func:`logit_mods`: the host side (one place for the forward and the
  backward launchers, so both add back the same row constants);
- :func:`soft_cap`, :func:`cap_slope`: the device side of the cap;
- :func:`sink_entries`, :func:`sink_grad`: dσ_h = −Σ_i P_i,sink D_i from the backward's per-row
  statistics, in PyTorch (a fixed-order reduction: deterministic).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..config import FP8AttentionConfig
from ..masking import MaskSpec
from ..transforms import query_key_means
from .constants import LOG2E, LOG2E_C


class LogitMods(NamedTuple):
    """A call's logit modifiers in the kernels' log2 units.

    ``softcap2``: c·log2 e, or None; ``shift2``: ``(B, Hq, Sq)`` fp32 contiguous τ q_i·μ·log2 e,
    or None (no smoothing, or neither a cap nor sinks); ``sinks2``: ``(Hq,)`` fp32 σ·log2 e, or None.
    """

    softcap2: float | None
    shift2: torch.Tensor | None
    sinks2: torch.Tensor | None

    def meta(self) -> dict:
        """The kernels' constexprs SOFTCAP, ROW_SHIFT and SINK."""
        return dict(SOFTCAP=self.softcap2 is not None, ROW_SHIFT=self.shift2 is not None,
                    SINK=self.sinks2 is not None)

    def args(self, dummy: torch.Tensor) -> tuple:
        """The kernels' runtime arguments ``(shift2, sinks2, softcap2)``; ``dummy`` (any tensor on the
        device) where a modifier is absent (never read: its constexpr is off)."""
        return (dummy if self.shift2 is None else self.shift2, dummy if self.sinks2 is None else self.sinks2,
                1.0 if self.softcap2 is None else self.softcap2)


NO_MODS = LogitMods(None, None, None)


def logit_mods(q: torch.Tensor, k: torch.Tensor, scale: float, mask: MaskSpec, config: FP8AttentionConfig,
               softcap: float | None, sinks: torch.Tensor | None, *, smoothed: bool = True) -> LogitMods:
    """The :class:`LogitMods` of one call (q ``(B, Hq, Sq, D)``, k ``(B, Hkv, Sk, D)``, sinks ``(Hq,)``).

    ``smoothed``: whether the kernel's QKᵀ operands are K-smoothed (the FP8 forward and backward
    with ``config.smooth_k``; the hybrid backward's bf16 logits are not)."""
    if softcap is None and sinks is None:
        return NO_MODS
    shift2 = None
    if smoothed and config.smooth_k:
        shift2 = (query_key_means(q, k, mask.cu_seqlens_q, mask.cu_seqlens_k) * (float(scale) * LOG2E)).contiguous()
    sinks2 = None if sinks is None else (sinks.float() * LOG2E).contiguous()
    return LogitMods(None if softcap is None else float(softcap) * LOG2E, shift2, sinks2)


@triton.jit
def _tanh(x):
    """tanh of fp32 ``x`` to within 2 fp32 ulps (±inf give ±1, NaN stays NaN), the same formula on
    the GPU and under the interpreter (which has no tanh). Below |x| = 0.55 an odd polynomial,
    x + x³·R(x²) (R fitted to (tanh x − x)/x³ there: under 1 ulp); above it 1 − 2/(e^(2|x|) + 1),
    whose subtraction is exact there. (That formula alone loses the relative accuracy near 0: 1e6
    ulps at |x| ~ 1e-5, which moved P codes against the emulation's.)"""
    z = x * x
    r = -0.006356495898216963
    r = r * z + 0.021127240732312202
    r = r * z - 0.05386507883667946
    r = r * z + 0.13332699239253998
    r = r * z - 0.33333319425582886
    small = x + x * z * r
    big = 1.0 - 2.0 / (tl.math.exp2(tl.abs(x) * (2.0 * LOG2E_C)) + 1.0)
    big = tl.where(x < 0.0, -big, big)
    return tl.where(tl.abs(x) < 0.55, small, big)


@triton.jit
def soft_cap(s, cap):
    """``cap · tanh(s / cap)`` elementwise (fp32; ±inf give ±cap, NaN stays NaN)."""
    return _tanh(s / cap) * cap


@triton.jit
def modify_logits(s, shift, cap, ROW_SHIFT: tl.constexpr, SOFTCAP: tl.constexpr, QUERY_AXIS: tl.constexpr):
    """Logits ``s`` (log2 units, a tile with its queries along ``QUERY_AXIS``) with K-smoothing's row
    constant added back (``shift``: one value per query, ROW_SHIFT) and then capped (SOFTCAP, at
    ``cap``). Call it before the mask sets invisible pairs to -inf (the cap would bound them)."""
    if ROW_SHIFT:
        if QUERY_AXIS == 0:
            s = s + shift[:, None]
        else:
            s = s + shift[None, :]
    if SOFTCAP:
        s = soft_cap(s, cap)
    return s


@triton.jit
def cap_slope(s_capped, cap):
    """d s̃ / d s = 1 − (s̃ / cap)² of capped logits ``s_capped`` (the factor from dS̃ to dS)."""
    t = s_capped / cap
    return 1.0 - t * t


def sink_entries(sinks2: torch.Tensor, lse2: torch.Tensor, delta: torch.Tensor, mask: MaskSpec, b: int,
                 sq: int) -> torch.Tensor:
    """Each row's sink entry of dS, −P_i,sink D_i ``(B, Hq, Sq)`` fp32, from the backward's per-row
    statistics; their sum over the batch and the rows of a head is dσ_h (:func:`sink_grad`).

    ``lse2``, ``delta``: ``(B·Hq, Sq)`` fp32, a normaliser (log2 units) and a delta whose product
    2^(σ₂ − lse2)·delta is P_sink·D: LSE' and D, or LSE'^do and D' (dO's row scale cancels). Rows
    outside every packed sequence (never written) give 0."""
    hq = sinks2.shape[0]
    sink = sinks2.reshape(1, hq, 1)
    # A sink of -inf has no weight, also on rows whose normaliser is -inf (no key: -inf − -inf).
    p_sink = torch.where(sink == float("-inf"), 0.0, torch.exp2(sink - lse2.reshape(b, hq, sq)))
    entries = -p_sink * delta.reshape(b, hq, sq)
    if mask.is_varlen:  # the sequences cover tokens [0, cu_seqlens_q[-1])
        inside = torch.arange(sq, device=entries.device) < mask.cu_seqlens_q[-1]
        entries = torch.where(inside, entries, 0.0)
    return entries


def sink_grad(entries: torch.Tensor) -> torch.Tensor:
    """dσ_h ``(Hq,)`` fp32: the sum of :func:`sink_entries` ``(B, Hq, Sq)`` over the batch and rows
    (PyTorch's fixed-order reduction: deterministic)."""
    return entries.sum(dim=(0, 2))
