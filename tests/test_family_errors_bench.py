"""``benchmarks/family_errors.py`` on CPU: a family's row is measured, a rejected family is listed
with its reason, and the noise probe runs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import family_errors  # noqa: E402
from test_integration_models import FP8_GRAD_BUDGET, FP8_LOGITS_BUDGET  # noqa: E402


def test_family_table_rows(tmp_path, capsys, monkeypatch):
    out = tmp_path / "families.json"
    # A head dim the package rejects: the row says why instead of giving a number.
    monkeypatch.setitem(family_errors.FAMILIES, "llama_d48", {"model_type": "llama", "head_dim": 48, "hidden_size": 96})
    rc = family_errors.main(["--families", "llama", "llama_d48", "--seeds", "1", "--recipes", "fp8_delta",
                             "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    llama = data["llama"]
    assert 0 < llama["fp8_delta"]["logits"][0] < FP8_LOGITS_BUDGET
    assert 0 < llama["fp8_delta"]["grads"][0] < FP8_GRAD_BUDGET
    assert 0 < llama["noise"]["logits"][0] < FP8_LOGITS_BUDGET
    assert "head_dim 48" in data["llama_d48"]["error"]
    assert "llama_d48    not run" in capsys.readouterr().out
