"""pytest plugin (``-p pytest_kernel_switches``, benchmarks/ on the path): the tests with kernel switches
set, so that a switch that is still off can be tested on a GPU before it is turned on.

``$KERNEL_SWITCHES``: "module.NAME=0|1,..." (booleans of the modules of hf_fp8_attention.kernels, as
switch_ab.py's ``--set``), applied when pytest configures, in every pytest-xdist worker too (each
reads the variable); the header names them. A name that is not such a boolean stops the run.

    KERNEL_SWITCHES=forward_gluon.TREE_REDUCTIONS=1 python -m pytest -m gpu -p pytest_kernel_switches tests/gpu
"""
from __future__ import annotations

import os

ENV = "KERNEL_SWITCHES"


def pytest_configure(config):
    text = os.environ.get(ENV, "")
    if not text:
        return
    from switch_ab import fixed  # (imports the package: after conftest.py has chosen the interpreter)

    for (module, attr), value in fixed(text).items():
        setattr(module, attr, value)


def pytest_report_header(config):
    text = os.environ.get(ENV, "")
    return f"kernel switches ({ENV}): {text}" if text else None
