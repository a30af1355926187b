"""benchmarks/pytest_gpu_resume.py, the plugin that lets the GPU suite run in parts: passes are
reused only from a log of the same sources, and failures are logged as they happen."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = '''
import pytest

@pytest.mark.parametrize("i", range(4))
def test_case(i):
    assert i != 2, ("two", i)
'''


def _run(project: Path, log: Path, **env) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "benchmarks"), **env)
    env.pop("PYTEST_ADDOPTS", None)
    result = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "pytest_gpu_resume", "-p", "no:cacheprovider",
                             "tests"], cwd=project, env=env, capture_output=True, text=True)
    log.write_text(result.stdout + result.stderr)
    return result.stdout + result.stderr


def test_passes_are_reused_only_on_the_same_sources(tmp_path):
    (tmp_path / "hf_fp8_attention").mkdir()
    (tmp_path / "hf_fp8_attention" / "__init__.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sample.py").write_text(TESTS)
    first = _run(tmp_path, tmp_path / "part1.log", FAILURE_LOG=str(tmp_path / "failures.log"))
    assert "source digest: " in first and "3 passed" in first and "1 failed" in first
    failures = (tmp_path / "failures.log").read_text()
    assert failures.count("==== tests/test_sample.py::test_case[2] (call)") == 1
    assert "('two', 2)" in failures

    second = _run(tmp_path, tmp_path / "part2.log", RESUME_LOGS=str(tmp_path / "part1.log"))
    assert "1 failed, 3 deselected" in second  # only the failure runs again

    (tmp_path / "hf_fp8_attention" / "__init__.py").write_text("CHANGED = True\n")
    third = _run(tmp_path, tmp_path / "part3.log", RESUME_LOGS=str(tmp_path / "part1.log"))
    assert "3 passed" in third and "tested other sources" in third
