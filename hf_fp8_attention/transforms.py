"""The exact transforms of the QKᵀ operands: K-smoothing and the Hadamard rotation (PyTorch).

Both leave softmax(τ QKᵀ) unchanged and only move the quantization error (docs/design.md):

- K-smoothing subtracts μ, the keys' channel mean over one (sequence, kv head), from every key
  before K is quantized for QKᵀ: row i of S shifts by the constant τ q_i·μ. The backward treats μ
  as a constant; its exact gradient Σ_i (Σ_j dS_ij) q_i is zero when the rows of dS sum to zero,
  as the matched delta makes them (to fp32 rounding).
- The rotation multiplies Q and K along the head dim by H, block-diagonal with ±1 Sylvester
  Hadamard blocks of :func:`hadamard_block` channels: H Hᵀ = block · I, so QKᵀ = (QH)(KH)ᵀ / block
  (the 1/block joins the softmax scale; a ±1 matrix keeps the rotated values exact sums).

With a logit soft-cap or attention sinks the row constant τ q_i·μ is not invisible to the softmax
and is added back (:func:`query_key_means`, shared by the emulation and the kernels' launchers).
"""
from __future__ import annotations

import functools

import torch


def hadamard_block(head_dim: int) -> int:
    """Channels per Hadamard block: the largest power of two dividing ``head_dim``, at most 128
    (64 -> 64, 96 -> 32, 128 -> 128, 256 -> 128: two blocks)."""
    if head_dim < 1:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    return min(head_dim & -head_dim, 128)


@functools.lru_cache(maxsize=16)
def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_matrix(head_dim: int, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """``(head_dim, head_dim)`` block-diagonal ±1 Hadamard matrix (blocks of :func:`hadamard_block`)."""
    block = hadamard_block(head_dim)
    h = torch.block_diag(*([_sylvester(block)] * (head_dim // block)))
    return h.to(dtype=dtype, device=device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """fp32 ``x @ H`` along the last axis (any leading shape)."""
    return x.float() @ hadamard_matrix(x.shape[-1], device=x.device)


def key_mean(k: torch.Tensor) -> torch.Tensor:
    """fp32 channel mean of the keys ``(B, Hkv, S, D)`` over the sequence: ``(B, Hkv, 1, D)``
    (zeros for an empty sequence)."""
    if k.shape[-2] == 0:
        return torch.zeros(*k.shape[:-2], 1, k.shape[-1], dtype=torch.float32, device=k.device)
    return k.float().mean(dim=-2, keepdim=True)


def query_key_means(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor | None = None,
                    cu_seqlens_k: torch.Tensor | None = None) -> torch.Tensor:
    """q_i·μ ``(B, Hq, Sq)`` fp32: each query's dot with the channel mean μ of the keys of its own
    sequence and kv head (what K-smoothing takes off row i of QKᵀ).

    ``q (B, Hq, Sq, D)``, ``k (B, Hkv, Sk, D)``; with ``cu_seqlens_q/k`` (int ``(n + 1,)``) a packed
    batch (B = 1): per sequence, by a segment reduction (no host read, a fixed summation order).
    An empty key sequence has μ = 0; queries outside every sequence get an unspecified value.
    """
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    qg = q.float().reshape(b, hkv, hq // hkv, sq, d)
    if cu_seqlens_q is None:
        return (qg * key_mean(k)[:, :, None]).sum(dim=-1).reshape(b, hq, sq)
    cu_k, cu_q = cu_seqlens_k.long(), cu_seqlens_q.long()
    n = cu_k.numel() - 1
    # One more segment for the keys after the last sequence, so the lengths cover every token.
    lengths = torch.cat([cu_k[1:] - cu_k[:-1], (sk - cu_k[-1:]).clamp(min=0)])
    means = torch.segment_reduce(k[0].float().transpose(0, 1), "mean", lengths=lengths, axis=0, initial=0.0)
    seq_of_query = torch.searchsorted(cu_q[1:], torch.arange(sq, device=q.device), right=True).clamp(max=max(n - 1, 0))
    mu = means[:n].transpose(0, 1)[:, seq_of_query] if n > 0 else torch.zeros(hkv, sq, d, device=q.device)
    return (qg[0] * mu[:, None]).sum(dim=-1).reshape(1, hq, sq)
