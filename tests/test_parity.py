"""examples/parity.py end to end in its tiny CPU setting: every phase, the resume, the skip, the report.

The resume check: a run stopped after 2 of 4 steps and re-run with the same command continues from
its checkpoint at step 2; the log's records of steps 1-2 are the first process's (not recomputed,
not duplicated) and steps 3-4 come from the second process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("datasets")
pytest.importorskip("peft")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--tiny", "--no-progress", "--eval-every", "2", "--probe-every", "2", "--save-every", "2"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return {**os.environ, "HF_FP8_ATTENTION_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "",
            "TOKENIZERS_PARALLELISM": "false"}


def parity(args, env, timeout=180):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "parity.py"), *args], env=env, cwd=ROOT,
                          text=True, capture_output=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc.stdout


def log(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "log.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("parity")


def test_finetune_stops_resumes_and_skips(out, env):
    cmd = ["finetune", *TINY, "--modes", "sdpa,fp8_delta", "--max-steps", "4", "--stop-after", "2",
           "--out-dir", str(out)]
    first = parity(cmd, env)
    assert "0/2 runs finished" in first and "re-run the same command" in first
    run = out / "finetune" / "tiny-full" / "fp8_delta-seed0"
    before = log(run)
    assert [r["step"] for r in before if r["type"] == "train"] == [1, 2]
    assert not (run / "done.json").exists()

    second = parity(cmd, env)
    assert "2/2 runs finished; all runs finished" in second
    after = log(run)
    train = [r for r in after if r["type"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert after[:len(before)] == before  # steps 1-2 kept as logged, not recomputed
    starts = [r["step"] for r in after if r["type"] == "session"]
    assert starts == [0, 2]  # the second process began at the step-2 checkpoint
    probes = [r for r in after if r["type"] == "probe"]
    assert [p["step"] for p in probes] == [0, 2, 4]
    for p in probes:
        assert 0.99 < p["grad_cos"] <= 1.0 + 1e-9
        assert len(p["row_sum_per_layer"]) == len(p["key_shift_per_layer"]) == 2
        assert max(p["row_sum_per_layer"]) < 1e-5  # delta-matched: fp32 rounding
    assert [r for r in after if r["type"] == "eval"] and [r for r in after if r["type"] == "final_eval"]
    assert json.loads((run / "done.json").read_text())["steps"] == 4
    # each run records the recipe its mode named when it ran (a name can change recipes between versions)
    recipe = json.loads((run / "run.json").read_text())["recipe"]
    assert recipe["delta"] == "matched" and recipe["kv_scales"] == "head" and recipe["backward"] == "fp8"
    assert json.loads((out / "finetune" / "tiny-full" / "sdpa-seed0" / "run.json").read_text())["recipe"] is None

    third = parity(cmd, env)
    assert third.count("already finished") == 2


def test_extend_and_ladder(out, env):
    parity(["extend", *TINY, "--modes", "fp8_stale", "--max-steps", "2", "--out-dir", str(out)], env)
    ext = out / "extend" / "tiny-full" / "fp8_stale-seed0"
    assert (ext / "done.json").exists()
    probe = [r for r in log(ext) if r["type"] == "probe"][-1]
    assert probe["row_sum_median"] > 1e-4  # the stale delta's residual
    spec = json.loads((ext / "run.json").read_text())
    assert spec["settings"]["seq_len"] == 128 and spec["settings"]["rope_type"] == "yarn"

    parity(["ladder", *TINY, "--sizes", "30m", "--modes", "sdpa,hybrid_delta", "--max-steps", "2",
            "--out-dir", str(out)], env)
    for name in ("sdpa-seed0", "sdpa-seed1", "hybrid_delta-seed0", "hybrid_delta-seed1"):
        assert (out / "ladder" / "30m-full" / name / "done.json").exists(), name


def test_report(out, env):
    report_dir = out / "report"
    stdout = parity(["report", "--tiny", "--out-dir", str(out), "--report-dir", str(report_dir)], env)
    md = (report_dir / "report.md").read_text()
    assert "## finetune — tiny-full" in md and "## ladder — 30m-full" in md and "## extend — tiny-full" in md
    assert "| fp8_delta | 0 |" in md
    # each run's command: the phase's own flags, less the selectors and time limits, plus the run's
    assert (f"python examples/parity.py finetune --tiny --eval-every 2 --probe-every 2 --save-every 2 --max-steps 4 "
            f"--out-dir {out} --modes fp8_delta --variants full --seeds 0") in md
    assert "±" in md  # two seeds at the smallest ladder size: a spread
    # the ladder across sizes: sdpa's two seeds (mean ± spread), hybrid_delta's gap paired by seed
    across = md[md.index("## ladder — across sizes"):]
    assert "| size | parameters | sdpa held-out loss | Δ hybrid_delta |" in across
    assert "| 30m |" in across and "(2 seeds) |" in across and "![ladder_gap_vs_params]" in across
    pngs = sorted(p.name for p in report_dir.glob("*.png"))
    assert "finetune_tiny-full_loss_diff_train.png" in pngs and "ladder_30m-full_row_sum_residual.png" in pngs
    assert "ladder_gap_vs_params.png" in pngs
    assert all((report_dir / p).stat().st_size > 1000 for p in pngs)
    assert "=== report ===" in stdout


def _synthetic_run(root: Path, mode: str, *, steps: int, norms: list[float], done: bool,
                   final: float = 4.25) -> None:
    run = root / "ladder" / "30m-full" / f"{mode}-seed0"
    run.mkdir(parents=True)
    spec = {"phase": "ladder", "group": "30m-full", "mode": mode, "seed": 0, "variant": "full", "size": "30m",
            "settings": {"seq_len": 128, "max_steps": 10, "batch_size": 2, "grad_accum": 1, "lr": 1e-3},
            "command": f"python examples/parity.py ladder --modes {mode}"}
    (run / "run.json").write_text(json.dumps(spec))
    records = [{"type": "train", "step": i + 1, "loss": 5.0, "grad_norm": g} for i, g in enumerate(norms[:steps])]
    records.append({"type": "eval", "step": steps, "eval_loss": 4.25})
    (run / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))  # inf as Infinity, as logged
    if done:
        (run / "done.json").write_text(json.dumps({"final_eval_loss": final, "steps": steps}))  # NaN as NaN


def test_report_shows_unfinished_runs_and_non_finite_gradient_norms(tmp_path, env):
    _synthetic_run(tmp_path, "sdpa", steps=10, norms=[1.0] * 10, done=True)
    _synthetic_run(tmp_path, "hybrid_stale", steps=6, norms=[1.0, 2.0, 1e9, float("inf"), float("nan"), 3.0],
                   done=False)
    _synthetic_run(tmp_path, "fp8_delta_token", steps=10, norms=[1.0] * 10, done=True)  # a recipe outside MODES
    report_dir = tmp_path / "report"
    parity(["report", "--out-dir", str(tmp_path), "--report-dir", str(report_dir)], env)
    md = (report_dir / "report.md").read_text()
    assert any(line.startswith("| fp8_delta_token | 0 | 4.2500 |") for line in md.splitlines()), md
    row = next(line for line in md.splitlines() if line.startswith("| hybrid_stale |"))
    assert "0/1 done; s0 stopped at step 6/10, held-out 4.2500 at step 6" in row
    assert (report_dir / "ladder_30m-full_grad_norm.png").stat().st_size > 1000


def test_report_prints_a_diverged_run_as_nan(tmp_path, env):
    _synthetic_run(tmp_path, "sdpa", steps=10, norms=[1.0] * 10, done=True)
    _synthetic_run(tmp_path, "hybrid_stale", steps=10, norms=[1.0, float("nan")] * 5, done=True, final=float("nan"))
    report_dir = tmp_path / "report"
    parity(["report", "--out-dir", str(tmp_path), "--report-dir", str(report_dir)], env)
    row = next(line for line in (report_dir / "report.md").read_text().splitlines()
               if line.startswith("| hybrid_stale |"))
    assert row.startswith("| hybrid_stale | 0 | nan |") and "+nan" in row, row
    assert "held-out loss not finite (diverged)" in row
