"""``benchmarks/train_step.py --tiny`` on CPU (a subprocess, offline): it runs and writes its rows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_step_tiny_on_cpu_writes_rows(tmp_path):
    env = {**os.environ, "HF_FP8_ATTENTION_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "benchmarks/train_step.py", "--tiny", "--attn", "sdpa,fp8_delta", "--modes", "eager",
           "--steps", "1", "--warmup", "1", "--models", "smollm2", "--tag", "tiny_test", "--out-dir", str(tmp_path),
           "--head-group", "2"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, text=True, capture_output=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "on CPU in fp32" in proc.stdout

    data = json.loads((tmp_path / "tiny_test.json").read_text())
    assert data["env"]["device"] == "cpu" and data["env"]["transformers"]
    rows = {(r["model"], r["mode"], r["attn"], r["context"]): r for r in data["rows"]}
    assert set(rows) == {("smollm2", "eager", "sdpa", 256), ("smollm2", "eager", "fp8_delta", 256)}
    for row in rows.values():
        assert row["status"] == "ok", row
        assert row["tokens_per_s"] > 0 and row["step_ms"] > 0
    assert rows[("smollm2", "eager", "sdpa", 256)]["x_sdpa"] == 1.0
    assert rows[("smollm2", "eager", "fp8_delta", 256)]["x_sdpa"] > 0

    table = (tmp_path / "tiny_test.md").read_text()
    assert "| eager | 256 | fp8_delta |" in table and "transformers" in table
    assert "launch schedule set for this run: head_group=2" in table
    assert table in proc.stdout


def test_train_step_resumes_a_grid_across_runs(tmp_path):
    """--max-minutes stops before the next model build; --resume measures only what is missing,
    keeps the earlier rows and computes the ratio to their sdpa row."""
    env = {**os.environ, "HF_FP8_ATTENTION_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    base = [sys.executable, "benchmarks/train_step.py", "--tiny", "--modes", "eager", "--steps", "1", "--warmup",
            "1", "--models", "smollm2", "--tag", "grid", "--out-dir", str(tmp_path)]

    def run(*extra):
        proc = subprocess.run(base + list(extra), env=env, cwd=ROOT, text=True, capture_output=True, timeout=180)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        return proc.stdout, json.loads((tmp_path / "grid.json").read_text())["rows"]

    out, rows = run("--attn", "sdpa,fp8_delta", "--max-minutes", "0.0001")  # the first build only
    assert [(r["attn"], r["status"]) for r in rows] == [("sdpa", "ok")]
    assert "1 configuration(s) left" in out
    first = rows[0]
    out, rows = run("--attn", "sdpa,fp8_delta", "--resume")
    assert "sdpa            measured in an earlier run" in out
    assert [r["attn"] for r in rows] == ["sdpa", "fp8_delta"]
    assert rows[0] == {**first, "x_sdpa": 1.0}  # kept as it was
    assert rows[1]["x_sdpa"] == rows[1]["tokens_per_s"] / first["tokens_per_s"]
    out, again = run("--attn", "sdpa,fp8_delta", "--resume")  # nothing left: nothing measured
    assert again == rows


def test_each_mode_runs_the_model_as_named(monkeypatch):
    """``step_forward``: eager is the model itself; ``compile`` and ``cudagraphs`` compile it, the
    latter with ``mode="reduce-overhead"`` and a new CUDA-graph step marked before every forward
    (torch.compile stubbed: the plumbing only)."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import train_step

    calls = []

    def fake_compile(model, **kwargs):
        calls.append(("compile", kwargs))
        return lambda **inputs: calls.append(("forward", inputs)) or "out"

    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: calls.append(("step",)))
    model = object()
    assert train_step.step_forward(model, "eager") is model
    train_step.step_forward(model, "compile")
    assert calls == [("compile", {"dynamic": False})]
    calls.clear()
    forward = train_step.step_forward(model, "cudagraphs")
    assert forward(input_ids=1) == "out" and forward(input_ids=2) == "out"
    assert calls == [("compile", {"dynamic": False, "mode": "reduce-overhead"}), ("step",),
                     ("forward", {"input_ids": 1}), ("step",), ("forward", {"input_ids": 2})]
    assert set(train_step.MODES) == {"eager", "compile", "cudagraphs"}
