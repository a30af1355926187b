"""Transformers integration: the ``"fp8_delta"`` / ``"fp8_stale"`` attention backends.

``import hf_fp8_attention`` registers both; :func:`register_fp8_attention` adds a backend with a
custom :class:`~hf_fp8_attention.FP8AttentionConfig`.
"""
from .transformers_backend import (
    DEFAULT_BACKENDS,
    fp8_attention_forward,
    fp8_padding_mask,
    register_default_backends,
    register_fp8_attention,
    registered_fp8_config,
)

__all__ = [
    "DEFAULT_BACKENDS",
    "fp8_attention_forward",
    "fp8_padding_mask",
    "register_default_backends",
    "register_fp8_attention",
    "registered_fp8_config",
]
