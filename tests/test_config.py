"""FP8AttentionConfig: defaults, named recipes, validation."""
import dataclasses

import pytest
import torch

from hf_fp8_attention import RECIPES, BackwardPrecision, DeltaMode, FP8AttentionConfig, FP8Format


def test_defaults_are_the_product_recipe():
    cfg = FP8AttentionConfig()
    assert cfg.delta is DeltaMode.MATCHED and cfg.backward is BackwardPrecision.FP8
    assert (cfg.q_format, cfg.k_format, cfg.v_format, cfg.p_format) == (FP8Format.E4M3,) * 4
    assert cfg.do_format is FP8Format.E4M3 and cfg.ds_format is FP8Format.E4M3
    assert (cfg.block_q, cfg.block_k) == (128, 128)
    assert cfg == RECIPES["fp8_delta"]


def test_formats_know_their_range():
    assert FP8Format.E4M3.max == 448.0 and FP8Format.E4M3.dtype is torch.float8_e4m3fn
    assert FP8Format.E5M2.max == 57344.0 and FP8Format.E5M2.dtype is torch.float8_e5m2


def test_strings_are_coerced_and_config_is_frozen_and_hashable():
    cfg = FP8AttentionConfig(delta="stale", backward="bf16", do_format="e5m2", ds_format="e5m2")
    assert cfg.delta is DeltaMode.STALE and cfg.backward is BackwardPrecision.BF16
    assert cfg.do_format is FP8Format.E5M2
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.delta = DeltaMode.MATCHED
    assert len({cfg, FP8AttentionConfig(delta="stale", backward="bf16", do_format="e5m2", ds_format="e5m2")}) == 1


def test_named_recipes():
    assert FP8AttentionConfig.from_recipe("fp8_stale").delta is DeltaMode.STALE
    hybrid = FP8AttentionConfig.from_recipe("hybrid_delta")
    assert hybrid.backward is BackwardPrecision.BF16 and hybrid.delta is DeltaMode.MATCHED
    assert FP8AttentionConfig.from_recipe("fp8_delta", block_k=64).block_k == 64
    with pytest.raises(ValueError, match="unknown FP8 attention recipe 'nope'"):
        FP8AttentionConfig.from_recipe("nope")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"delta": "fresh"}, "delta='fresh' is not one of"),
        ({"backward": "fp16"}, "backward='fp16' is not one of"),
        ({"do_format": "e3m4"}, "do_format='e3m4' is not one of"),
        ({"q_format": "e5m2"}, "q_format must be 'e4m3'"),
        ({"p_format": FP8Format.E5M2}, "p_format must be 'e4m3'"),
        ({"block_q": 100}, "block_q=100 must be one of"),
        ({"block_k": 128.0}, "block_k=128.0 must be one of"),
        ({"block_k": True}, "block_k=True must be one of"),
        ({"pow2_scales": "yes"}, "pow2_scales must be a bool"),
        ({"backend": "cuda"}, "backend='cuda' is not one of"),
    ],
)
def test_invalid_values_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FP8AttentionConfig(**kwargs)
