"""The exact transforms of the QKᵀ operands: K-smoothing and the Hadamard rotation (PyTorch).

Both leave softmax(τ QKᵀ) unchanged and only move the quantization error (docs/design.md):

- K-smoothing subtracts μ, the keys' channel mean over one (sequence, kv head), from every key
  before K is quantized for QKᵀ: row i of S shifts by the constant τ q_i·μ. The backward treats μ
  as a constant; its exact gradient Σ_i (Σ_j dS_ij) q_i is zero when the rows of dS sum to zero,
  as the matched delta makes them (to fp32 rounding).
- The rotation multiplies Q and K along the head dim by H, block-diagonal with ±1 Sylvester
  Hadamard blocks of :func:`hadamard_block` channels: H Hᵀ = block · I, so QKᵀ = (QH)(KH)ᵀ / block
  (the 1/block joins the softmax scale; a ±1 matrix keeps the rotated values exact sums).
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
