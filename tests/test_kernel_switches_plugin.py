"""benchmarks/pytest_kernel_switches.py, the plugin that runs tests with kernel switches set
(``$KERNEL_SWITCHES``): set in every pytest-xdist worker, named in the header, and a name that is not
a switch stops the run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = '''
from hf_fp8_attention.kernels import forward, forward_gluon


def test_switches_are_set():
    assert forward_gluon.TREE_REDUCTIONS is True and forward.P_IN_PLACE_TRITON is False


def test_in_every_worker():
    assert forward_gluon.TREE_REDUCTIONS is True and forward.P_IN_PLACE_TRITON is False
'''


def _run(project: Path, switches: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(ROOT), str(ROOT / "benchmarks"))),
               KERNEL_SWITCHES=switches, TRITON_INTERPRET="1")
    env.pop("PYTEST_ADDOPTS", None)
    return subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "pytest_kernel_switches", "-p",
                           "no:cacheprovider", *args, "tests"], cwd=project, env=env, capture_output=True, text=True)


def test_switches_reach_every_worker_and_bad_names_stop_the_run(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sample.py").write_text(TESTS)
    ok = _run(tmp_path, "forward_gluon.TREE_REDUCTIONS=1,forward.P_IN_PLACE_TRITON=0", "-n", "2")
    out = ok.stdout + ok.stderr
    assert ok.returncode == 0, out
    assert "2 passed" in out and "kernel switches (KERNEL_SWITCHES): forward_gluon.TREE_REDUCTIONS=1" in out
    bad = _run(tmp_path, "backward.NO_SUCH_SWITCH=1")
    assert bad.returncode != 0 and "'backward.NO_SUCH_SWITCH' is not module.NAME" in bad.stdout + bad.stderr
