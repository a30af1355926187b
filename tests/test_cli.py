"""``python -m hf_fp8_attention check | bench | demo`` on CPU (subprocesses, offline)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MATCHED_MAX, STALE_MIN = 1e-5, 1e-4  # fp32 rounding vs the stale delta's ~1e-2 (see cli.py)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    return {**os.environ, "HF_FP8_ATTENTION_CACHE": str(tmp_path_factory.mktemp("cache")), "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}


def cli(args: list[str], env: dict, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hf_fp8_attention", *args], env=env, cwd=ROOT, text=True,
                          capture_output=True, timeout=timeout)


def test_check_reports_environment_path_and_passes_self_test(env):
    proc = cli(["check"], env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "torch " in out and "transformers " in out and "triton " in out
    assert "GPU: none" in out and "path used on cpu: emulation" in out
    assert "fp8_delta" in out and "fp8_stale" in out and "self-test: PASS" in out


def test_demo_tiny_trains_three_backends_side_by_side(env, tmp_path):
    proc = cli(["demo", "--tiny", "--no-progress", "--steps", "8", "--batch-size", "4", "--corpus-bytes", "300000",
                "--out-dir", str(tmp_path)], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    table = proc.stdout.split("attention")[1]
    for attn in ("sdpa", "fp8_stale", "fp8_delta"):
        assert f"\n{attn} " in table
    s = json.loads((tmp_path / "summary.json").read_text())
    assert (tmp_path / "loss_curves.png").stat().st_size > 1000
    r = s["results"]
    assert list(r) == ["sdpa", "fp8_stale", "fp8_delta"]
    for attn, row in r.items():
        curve = s["curves"][attn]
        assert len(curve) == 8 and sum(curve[-2:]) < sum(curve[:2]) - 0.2, (attn, curve)
        assert row["tokens_per_s"] > 0
    assert r["sdpa"]["row_sum_residual_median"] is None
    assert r["fp8_delta"]["row_sum_residual_median"] < MATCHED_MAX < STALE_MIN < r["fp8_stale"]["row_sum_residual_median"]
    # Same init, same batches: FP8 attention changes the loss by FP8 rounding, not by a different run.
    assert abs(r["fp8_delta"]["eval_loss"] - r["sdpa"]["eval_loss"]) < 0.05


def test_bench_without_gpu_is_a_one_line_error(env):
    proc = cli(["bench", "--help-me"], env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: bench needs a CUDA GPU (none found); the emulation is not worth timing"]


def test_demo_rejects_bad_values_in_one_line(env):
    proc = cli(["demo", "--tiny", "--steps", "0"], env, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --steps must be positive, got 0"
