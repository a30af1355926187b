"""The autograd Function behind :func:`fp8_attention`, and the choice of implementation.

``select_backend`` decides, per call, whether the Triton kernels or the PyTorch emulation run;
``FP8AttentionFunction`` saves what the backward needs (O only for the stale delta).
"""
from __future__ import annotations

import logging

import torch

from . import reference
from .config import Backend, DeltaMode, FP8AttentionConfig
from .masking import MaskSpec

logger = logging.getLogger(__name__)


def select_backend(device: torch.device, config: FP8AttentionConfig) -> Backend:
    """``Backend.TRITON`` or ``Backend.EMULATION`` for tensors on ``device``.

    The Triton kernels are not part of this build yet, so every device runs the emulation; a
    request for ``backend="triton"`` raises instead of silently running something else.
    """
    if config.backend is Backend.TRITON:
        raise RuntimeError(
            "FP8AttentionConfig(backend='triton') was requested but the Triton FP8 kernels are not "
            "available in this build; use backend='emulation' (or 'auto'), or attn_implementation='sdpa'"
        )
    return Backend.EMULATION


class FP8AttentionFunction(torch.autograd.Function):
    """``out = attention(q, k, v)`` in FP8, with the configured backward (shapes: see reference.py)."""

    @staticmethod
    def forward(ctx, q, k, v, scale: float, mask: MaskSpec, config: FP8AttentionConfig):
        out, lse = reference.emulated_forward(q, k, v, scale=scale, mask=mask, config=config)
        keep_out = config.delta is DeltaMode.STALE  # matched mode never reads O in the backward
        ctx.save_for_backward(q, k, v, lse, out if keep_out else None)
        ctx.scale, ctx.mask, ctx.config = scale, mask, config
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, lse, out = ctx.saved_tensors
        dq, dk, dv = reference.emulated_backward(
            q, k, v, out, lse, dout.contiguous(), scale=ctx.scale, mask=ctx.mask, config=ctx.config
        )
        return dq, dk, dv, None, None, None
