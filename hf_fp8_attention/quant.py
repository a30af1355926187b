"""Block-scaled FP8 quantization in PyTorch: the recipe's ground truth.

A tensor is cut into blocks of ``block`` consecutive elements along one axis (the last block may
be shorter); each block gets one fp32 scale ``amax(|block|) / FMT_MAX`` (optionally rounded up to a
power of two) and its elements are stored as ``fp8(x / scale)``, saturated to ±FMT_MAX.

- amax = 0 gives scale 1 (codes are all zero), never a division by zero; a non-zero amax so small
  that amax / FMT_MAX underflows gets the smallest normal fp32 scale.
- NaN and ±Inf are never turned into finite values: a block holding one gets a non-finite scale,
  so every element of that block dequantizes to NaN/Inf. (PyTorch's own cast maps Inf to 448 in
  E4M3; we never let it see one.)
"""
from __future__ import annotations

import torch

from .config import FP8Format


def _blocked_view(x: torch.Tensor, dim: int, block: int | None) -> tuple[torch.Tensor, int]:
    """View ``x`` with axis ``dim`` split into (n_blocks, block), zero-padding the tail block.

    Returns the padded, split tensor and the original length along ``dim``.
    """
    dim = dim % x.dim()
    length = x.shape[dim]
    if block is None or block >= length:
        block = max(length, 1)
    if not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive int or None, got {block!r}")
    n_blocks = -(-length // block)
    pad = n_blocks * block - length
    if pad:
        pad_spec = [0, 0] * (x.dim() - 1 - dim) + [0, pad]
        x = torch.nn.functional.pad(x, pad_spec)
    shape = list(x.shape)
    return x.reshape(shape[:dim] + [n_blocks, block] + shape[dim + 1 :]), length


_FP32_TINY = torch.finfo(torch.float32).tiny


def compute_scales(amax: torch.Tensor, fmt: FP8Format, pow2: bool) -> torch.Tensor:
    """fp32 scales from block maxima: amax / FMT_MAX, 1 where amax == 0, NaN/Inf kept.

    A tiny but non-zero amax (below FMT_MAX · 2^-126, e.g. a far-tail dS block) would underflow the
    scale to 0 and turn the block into NaN; the scale is floored at the smallest normal fp32 instead.
    """
    # Divide by a tensor, not a Python float: CUDA turns `x / float` into a multiply by the rounded
    # reciprocal, which would make the emulation's scales differ between CPU and GPU.
    fmax = torch.tensor(fmt.max, dtype=torch.float32, device=amax.device)
    scale = (amax.float() / fmax).clamp_min(_FP32_TINY)  # clamp_min keeps NaN
    if pow2:
        # Round up so that amax / scale <= FMT_MAX still holds; exp2(ceil(log2(inf))) stays inf.
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def quantize(
    x: torch.Tensor, *, dim: int, block: int | None, fmt: FP8Format = FP8Format.E4M3, pow2: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` with one scale per ``block`` elements along ``dim``.

    Args:
        x: any float tensor, shape ``(..., L, ...)`` with ``L = x.shape[dim]``.
        dim: the axis the blocks run along (the contraction axis of the consuming matmul).
        block: block length along ``dim``; ``None`` means the whole axis.
    Returns:
        codes: ``fmt.dtype`` tensor of the shape of ``x``.
        scales: fp32 tensor, the shape of ``x`` with axis ``dim`` replaced by ``ceil(L / block)``.
    """
    if not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got {x.dtype}")
    dim = dim % x.dim()
    blocks, length = _blocked_view(x.float(), dim, block)
    amax = blocks.abs().amax(dim=dim + 1, keepdim=True)  # NaN propagates through amax
    scale = compute_scales(amax, fmt, pow2)
    scaled = (blocks / scale).clamp(-fmt.max, fmt.max)  # clamp keeps NaN
    codes = scaled.to(fmt.dtype).flatten(dim, dim + 1).narrow(dim, 0, length)
    return codes, scale.squeeze(dim + 1)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, *, dim: int, block: int | None) -> torch.Tensor:
    """Inverse of :func:`quantize`: fp32 ``codes * scale`` with the scales broadcast over their blocks."""
    dim = dim % codes.dim()
    length = codes.shape[dim]
    block = length if block is None or block >= length else block
    expanded = scales.repeat_interleave(block, dim=dim).narrow(dim, 0, length) if length else scales
    return codes.float() * expanded


def fake_quantize(
    x: torch.Tensor, *, dim: int, block: int | None, fmt: FP8Format = FP8Format.E4M3, pow2: bool = False
) -> torch.Tensor:
    """fp32 ``dequantize(quantize(x))``: the value an FP8 matmul sees for ``x`` (same shape)."""
    codes, scales = quantize(x, dim=dim, block=block, fmt=fmt, pow2=pow2)
    return dequantize(codes, scales, dim=dim, block=block)
