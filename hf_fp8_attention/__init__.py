"""hf_fp8_attention: trainable block-scaled FP8 attention with a delta-matched backward.

``import hf_fp8_attention`` exposes :func:`fp8_attention` and :class:`FP8AttentionConfig`.
"""
from .config import RECIPES, Backend, BackwardPrecision, DeltaMode, FP8AttentionConfig, FP8Format
from .functional import SUPPORTED_HEAD_DIMS, fp8_attention

__all__ = [
    "RECIPES",
    "SUPPORTED_HEAD_DIMS",
    "Backend",
    "BackwardPrecision",
    "DeltaMode",
    "FP8AttentionConfig",
    "FP8Format",
    "fp8_attention",
]
__version__ = "0.1.0"
