"""pytest plugin for GPU runs under a wall-clock limit (``-p pytest_gpu_resume``, benchmarks/ on the path).

The GPU suite takes longer than one call to the GPU machine may run, so it runs in parts:
- The header line ``source digest: <sha256>`` names the sources the run tested: every ``*.py`` under
  ``hf_fp8_attention/`` and ``tests/`` (the checkout's git metadata may lag its files).
- ``$RESUME_LOGS`` (paths of earlier ``pytest -v`` logs, space-separated): tests that PASSED there are
  deselected, but only from logs whose source digest is this run's. A log of other sources is
  ignored with a warning: its passes say nothing about the code under test now.
- ``$FAILURE_LOG``: each failure's id, assertion message and traceback tail, appended as it happens,
  so a run cut at its limit (which loses pytest's summary) keeps them.
"""
from __future__ import annotations

import hashlib
import os
import re
import warnings
from pathlib import Path

DIGEST_LINE = "source digest: "
# "[gw3] [ 12%] PASSED <id>" under pytest-xdist, "<id> PASSED [ 12%]" without it
PASSED = re.compile(r"PASSED (\S+::\S+)|^(\S+::\S+) PASSED", re.MULTILINE)
_config = None  # this process's pytest config (the report hook is not handed it)


def source_digest(root: Path) -> str:
    """sha256 over the relative paths and contents of the package's and the tests' Python files."""
    h = hashlib.sha256()
    for path in sorted(p for d in ("hf_fp8_attention", "tests") for p in (root / d).rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def passed_in(log: Path, digest: str) -> set[str] | None:
    """Node ids PASSED in ``log``, or None when the log tested other sources (or names none)."""
    text = log.read_text(errors="replace")
    if f"{DIGEST_LINE}{digest}" not in text:
        return None
    return {a or b for a, b in PASSED.findall(text)}


def pytest_configure(config):
    global _config
    _config = config
    config._source_digest = source_digest(Path(config.rootpath))


def pytest_report_header(config):
    return f"{DIGEST_LINE}{config._source_digest}"


def pytest_collection_modifyitems(session, config, items):
    logs = os.environ.get("RESUME_LOGS", "").split()
    done: set[str] = set()
    for name in logs:
        found = passed_in(Path(name), config._source_digest)
        if found is None:
            warnings.warn(f"RESUME_LOGS: {name} tested other sources (or has no source digest); its passes are not reused")
        else:
            done |= found
    if done:
        skipped = [item for item in items if item.nodeid in done]
        items[:] = [item for item in items if item.nodeid not in done]
        config.hook.pytest_deselected(items=skipped)


def pytest_runtest_logreport(report):
    log = os.environ.get("FAILURE_LOG")
    # pytest-xdist workers hand their reports to the controller, which logs them once
    if not log or not report.failed or hasattr(_config, "workerinput"):
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message[:600] if crash is not None else ""
    with open(log, "a") as f:
        f.write(f"==== {report.nodeid} ({report.when})\n{message}\n{report.longreprtext[-1500:]}\n")
