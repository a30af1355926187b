"""The optional packages (the ``train``/``dev`` extras) are never required to collect the tests.

``pytest -m gpu`` on a machine without, say, ``datasets`` must run the GPU tests rather than stop
at collection: a test module may import an optional package at module level only through
``pytest.importorskip`` (then the module skips), or import it inside the tests that need it.
This runs pytest's collection in a subprocess in which the optional packages cannot be imported.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("datasets", "peft", "accelerate", "matplotlib", "nbformat", "nbclient", "gguf")

# sys.modules[name] = None makes `import name` raise ImportError and find_spec(name) return None,
# so Transformers also sees the package as absent.
_RUN = """
import sys
for name in {optional!r}:
    sys.modules[name] = None
import pytest
sys.exit(pytest.main({args!r}))
"""


def _pytest_without_optional(*args: str) -> subprocess.CompletedProcess:
    code = _RUN.format(optional=OPTIONAL, args=["-p", "no:cacheprovider", *args])
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_collection_needs_no_optional_package():
    proc = _pytest_without_optional("--collect-only", "-q", "tests")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "error" not in proc.stdout.lower().splitlines()[-1], proc.stdout[-3000:]


def test_training_tests_without_datasets_run_what_they_can():
    proc = _pytest_without_optional(
        "-q", "-rs", "tests/test_integration_training.py", "-k", "save_pretrained or peft or trainer_steps"
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "1 passed" in out and "4 skipped" in out, out[-3000:]
