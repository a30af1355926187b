"""``benchmarks/recipe_names.recipe_config``: named recipes with boolean flags and field=value parts."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from recipe_names import recipe_config  # noqa: E402

from hf_fp8_attention import RECIPES  # noqa: E402
from hf_fp8_attention.config import Granularity  # noqa: E402


def test_parts_set_flags_and_fields():
    assert recipe_config("fp8_delta") == RECIPES["fp8_delta"]
    assert recipe_config("fp8_delta_fast+dq_in_stats") == RECIPES["fp8_delta_fast"].replace(dq_in_stats=True)
    config = recipe_config("fp8_delta+ds_scales=tile+block_k=64+hadamard=false")
    assert config == RECIPES["fp8_delta"].replace(ds_scales=Granularity.TILE, block_k=64, hadamard=False)


@pytest.mark.parametrize("name, message", [
    ("fp8_nope", "unknown FP8 attention recipe"),
    ("fp8_delta+bogus", r"unknown option\(s\) \['bogus'\]"),
    ("fp8_delta+no_field=1", r"unknown option\(s\) \['no_field'\]"),
    ("fp8_delta+ds_scales=row", "ds_scales='row' is not one of"),
    ("fp8_delta+hadamard=yes", "hadamard='yes': true or false"),
    ("fp8_delta+block_k=wide", "invalid literal"),
])
def test_bad_parts_are_named(name, message):
    with pytest.raises(ValueError, match=message):
        recipe_config(name)
