"""Exact attention in float64, forward and backward: the reference for error budgets in tests.

Same conventions as :mod:`hf_fp8_attention.masking` (causal diagonal aligned to the end, windows,
varlen via ``MaskSpec``) and the same shapes as :func:`hf_fp8_attention.fp8_attention`, with the
same logit modifiers: ``softcap`` c (each logit s becomes c·tanh(s / c)) and ``sinks`` ``(Hq,)``
(one logit per query head in each row's normaliser only). Rows with no visible key output 0. GQA
is handled by repeating k/v here: this is a test oracle, not a path that must be frugal with memory.
"""
from __future__ import annotations

import torch

from .masking import MaskSpec, dense_mask


def _dense_probs(q, k, scale, causal, window, softcap=None, sinks=None):
    """P ``(B, Hq, Sq, Sk)`` of one dense problem (k with Hkv heads; rows without keys are 0; with
    ``sinks (Hq,)`` each row's P sums to 1 minus its sink's share)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    mask = dense_mask(q.shape[-2], k.shape[-2], causal=causal, window=window, device=q.device)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    if sinks is None:
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    else:
        sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
        lse = torch.logsumexp(torch.cat([logits, sink], dim=-1), dim=-1, keepdim=True)
    return torch.where(logits == float("-inf"), 0.0, torch.exp(logits - lse))


def _dense_exact(q, k, v, scale, causal, window, softcap=None, sinks=None):
    p = _dense_probs(q, k, scale, causal, window, softcap, sinks)
    return p @ v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)


def exact_softmax_terms(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *, scale: float | None = None,
    mask: MaskSpec | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """float64 ``(P, dS)`` of each sequence (one pair for a dense call; per packed sequence in
    varlen), both ``(B, Hq, Sq_seq, Sk_seq)``: P = softmax(S), dS = P ∘ (dP − D) for upstream ``dout``."""
    mask = mask or MaskSpec()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v, dout = q.double(), k.double(), v.double(), dout.double()
    spans = [(0, q.shape[2], 0, k.shape[2])] if not mask.is_varlen else mask.sequence_bounds()
    terms = []
    for qs, qe, ks, ke in spans:
        p = _dense_probs(q[:, :, qs:qe], k[:, :, ks:ke], scale, mask.causal, mask.window)
        dp = dout[:, :, qs:qe] @ v[:, :, ks:ke].repeat_interleave(q.shape[1] // k.shape[1], dim=1).transpose(-1, -2)
        terms.append((p, p * (dp - (p * dp).sum(-1, keepdim=True))))
    return terms


def exact_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    mask: MaskSpec | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 attention ``(B, Hq, Sq, D)``; differentiable (autograd runs in float64 too, also
    into ``sinks (Hq,)``)."""
    mask = mask or MaskSpec()
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = q.double(), k.double(), v.double()
    mods = dict(softcap=softcap, sinks=None if sinks is None else sinks.double())
    if not mask.is_varlen:
        return _dense_exact(q, k, v, scale, mask.causal, mask.window, **mods)
    # Tokens outside every sequence (before the first, between or after them) output 0; built by
    # concatenation rather than in-place writes so that autograd runs through it.
    bounds = mask.sequence_bounds()
    starts = [qs for qs, _, _, _ in bounds[1:]] + [q.shape[2]]
    pieces = [torch.zeros_like(q[:, :, : bounds[0][0]])]
    for (qs, qe, ks, ke), next_start in zip(bounds, starts):
        pieces.append(_dense_exact(q[:, :, qs:qe], k[:, :, ks:ke], v[:, :, ks:ke], scale, mask.causal, mask.window,
                                   **mods))
        pieces.append(torch.zeros_like(q[:, :, qe:next_start]))
    return torch.cat(pieces, dim=2)


def exact_attention_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    *,
    scale: float | None = None,
    mask: MaskSpec | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """float64 ``(out, dq, dk, dv)`` for upstream gradient ``dout`` (shapes as the inputs), followed
    with ``sinks`` by ``dsinks (Hq,)``."""
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    inputs = [q64, k64, v64]
    s64 = None
    if sinks is not None:
        s64 = sinks.detach().double().requires_grad_(True)
        inputs.append(s64)
    out = exact_attention(q64, k64, v64, scale=scale, mask=mask, softcap=softcap, sinks=s64)
    grads = torch.autograd.grad(out, inputs, dout.double())
    return (out.detach(), *grads)
