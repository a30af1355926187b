"""``benchmarks/stale_vs_length.py`` on the committed fixture slice (CPU emulation)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from hf_fp8_attention.reference import BackwardInternals

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import stale_vs_length  # noqa: E402


def test_stale_delta_contribution_by_length(tmp_path):
    assert stale_vs_length.main(["--tokens", "64,128", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "stale_vs_length.json").read_text())
    assert (tmp_path / "stale_vs_length.png").stat().st_size > 0
    assert (tmp_path / "stale_vs_length_direction.png").stat().st_size > 0
    assert data["tokens"] == [64, 128]
    rows = [row for per_length in data["results"].values() for row in per_length.values()]
    assert len(rows) == 2 * len(stale_vs_length.load_layers(stale_vs_length.DEFAULT_FIXTURE, 64)) * 2
    for row in rows:
        # The matched and stale twins share every code and differ only in D: what the stale one adds
        # is its dS rows' non-zero sums (residual ~1e-2 on this model, "docs/parity.md"), several
        # percent of the gradient, far above the fp32 rounding a wrong pairing of two matched runs
        # would show.
        assert row["residual"] > 1e-3, row
        assert row["stale_added_dQ"] > 1e-2 and row["stale_added_dK"] > 1e-3, row
        assert all(math.isfinite(row[key]) for key in ("stale_added_cos_dQ", "stale_added_cos_dK", "matched_cos_dQ",
                                                       "matched_cos_dK", "delta_sign", "delta_slope")), row


def test_rejects_lengths_beyond_the_fixture():
    with pytest.raises(SystemExit):
        stale_vs_length.main(["--tokens", "4096"])


def test_delta_error_stats_skip_keyless_rows_and_measure_the_part_that_rescales_d():
    """ε = 0.1·D on the rows that see a key (so slope 0.1 and sign Σ D / Σ |D| = 2/6), and a
    keyless row whose huge ε must not count."""
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.2, 0.8], [0.0, 0.0]]).view(1, 1, 1, 4, 2)
    d = torch.tensor([1.0, -2.0, 3.0, 100.0]).view(1, 1, 1, 4)
    eps = torch.tensor([0.1, -0.2, 0.3, 999.0]).view(1, 1, 1, 4)

    def internals(delta):
        return BackwardInternals(p=p, dp=torch.zeros_like(p), delta=delta, ds=torch.zeros_like(p))

    stats = stale_vs_length.delta_error_stats(internals(d), internals(d + eps))
    assert stats["delta_slope"] == pytest.approx(0.1)
    assert stats["delta_sign"] == pytest.approx(2 / 6)
