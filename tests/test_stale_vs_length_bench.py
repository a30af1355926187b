"""``benchmarks/stale_vs_length.py`` on the committed fixture slice (CPU emulation)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import stale_vs_length  # noqa: E402


def test_stale_delta_contribution_by_length(tmp_path):
    assert stale_vs_length.main(["--tokens", "64,128", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "stale_vs_length.json").read_text())
    assert (tmp_path / "stale_vs_length.png").stat().st_size > 0
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


def test_rejects_lengths_beyond_the_fixture():
    with pytest.raises(SystemExit):
        stale_vs_length.main(["--tokens", "4096"])
