"""hf_fp8_attention: trainable block-scaled FP8 attention with a delta-matched backward.

``import hf_fp8_attention`` exposes :func:`fp8_attention` and :class:`FP8AttentionConfig`, and registers
the Transformers attention backends ``"fp8_delta"`` and ``"fp8_stale"`` (see :mod:`.integration`).
"""
from .config import RECIPES, Backend, BackwardPrecision, DeltaMode, FP8AttentionConfig, FP8Format
from .functional import SUPPORTED_HEAD_DIMS, fp8_attention
from .integration import register_default_backends as _register_default_backends
from .integration import register_fp8_attention, registered_fp8_config

__all__ = [
    "RECIPES",
    "SUPPORTED_HEAD_DIMS",
    "Backend",
    "BackwardPrecision",
    "DeltaMode",
    "FP8AttentionConfig",
    "FP8Format",
    "fp8_attention",
    "register_fp8_attention",
    "registered_fp8_config",
]
__version__ = "0.1.0"

# Transformers backends "fp8_delta" (the product) and "fp8_stale" (the ablation baseline).
_register_default_backends()
