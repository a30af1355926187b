"""The parity ladder across sizes (hf_fp8_attention.training.ladder_summary), on run records built by
hand: gaps pair runs by seed, sizes sort by parameters, a diverged run stays visible, and the
PNG is written."""
from __future__ import annotations

import math

import pytest

from hf_fp8_attention.training.ladder_summary import ladder_gaps, ladder_table, mean_gap, plot_ladder_gaps

MODES = ("sdpa", "fp8_delta", "fp8_stale", "hybrid_stale")


def _run(size, params, mode, seed, loss):
    return {"spec": {"phase": "ladder", "size": size, "params": params, "mode": mode, "seed": seed},
            "done": None if loss is None else {"final_eval_loss": loss}}


RUNS = [
    _run("120m", 116_000_000, "sdpa", 0, 3.20), _run("120m", 116_000_000, "fp8_delta", 0, 3.21),
    _run("120m", 116_000_000, "fp8_stale", 0, 5.44),
    _run("120m", 116_000_000, "hybrid_stale", 0, float("nan")),  # diverged: NaN weights
    _run("30m", 29_000_000, "sdpa", 0, 2.70), _run("30m", 29_000_000, "sdpa", 1, 2.60),
    _run("30m", 29_000_000, "fp8_delta", 0, 2.66), _run("30m", 29_000_000, "fp8_delta", 1, 2.64),
    _run("30m", 29_000_000, "fp8_stale", 1, 2.55),  # seed 0 not finished: no partner for the mean
    _run("30m", 29_000_000, "fp8_stale", 0, None),
    _run("30m", 29_000_000, "hybrid_stale", 0, float("nan")), _run("30m", 29_000_000, "hybrid_stale", 1, 3.86),
]


def test_gaps_pair_seeds_and_sort_by_parameters():
    rows = ladder_gaps(RUNS, MODES)
    assert [r["size"] for r in rows] == ["30m", "120m"]
    small, large = rows
    assert small["reference"] == pytest.approx(2.65) and small["reference_spread"] == pytest.approx(0.05)
    # fp8_delta: seed 0 2.66 - 2.70, seed 1 2.64 - 2.60; mean 0
    assert small["gaps"]["fp8_delta"] == {0: pytest.approx(-0.04), 1: pytest.approx(0.04)}
    assert mean_gap(small["gaps"]["fp8_delta"]) == pytest.approx(0.0, abs=1e-12)
    assert small["gaps"]["fp8_stale"] == {1: pytest.approx(-0.05)}  # the finished seed only
    assert math.isnan(small["gaps"]["hybrid_stale"][0]) and small["gaps"]["hybrid_stale"][1] == pytest.approx(1.26)
    assert large["reference_spread"] is None  # one seed
    assert large["gaps"]["fp8_stale"] == {0: pytest.approx(2.24)}
    assert math.isnan(mean_gap(large["gaps"]["hybrid_stale"]))  # kept, not dropped


def test_table_shows_missing_as_dash_and_a_non_finite_seed_beside_the_others():
    lines = ladder_table(ladder_gaps(RUNS, MODES), MODES)
    assert lines[0] == "| size | parameters | sdpa held-out loss | Δ fp8_delta | Δ fp8_stale | Δ hybrid_stale |"
    assert lines[2] == "| 30m | 29.0M | 2.6500 ± 0.0500 | +0.0000 (2 seeds) | -0.0500 | +nan / +1.2600 (seeds 0 / 1) |"
    assert lines[3] == "| 120m | 116.0M | 3.2000 | +0.0100 | +2.2400 | +nan |"


def test_plot_is_written(tmp_path):
    path = plot_ladder_gaps(ladder_gaps(RUNS, MODES), tmp_path / "gap.png")
    assert path.exists() and path.stat().st_size > 5000
