"""benchmarks/experiments/textbook_attention.py: its kernels compute attention and its gradients.

The script's speed comparison means something only if its kernels are right, so its own float64
checks (forward output, dQ, dK, dV; every RECIPE level of the forward and dQ kernels) run here on a
few launch shapes, including query tiles shorter and longer than key tiles under a causal mask.
FP8 only: the interpreter's bf16 arithmetic is not meaningful. The bound (1.5e-1) is the script's:
per-tensor E4M3 operands and unscaled P give relative errors of 4.5-6.6e-2 at S = 1024 on the H200,
and up to 1.0e-1 here (S = 256, Gaussian data, and the interpreter's fp8 casts truncate instead of
rounding). The inputs are seeded, so the run is deterministic; a dropped causal mask gave 3.4 and a
dropped channel scale 1e2.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "experiments" / "textbook_attention.py"


@pytest.fixture(scope="module")
def textbook():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the textbook kernels load through TMA descriptors (sm_90 or newer, or the interpreter)")
    spec = importlib.util.spec_from_file_location("textbook_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.FWD_CONFIGS = [(64, 64, 4, 3), (64, 128, 4, 3)]
    module.DKDV_CONFIGS = [(64, 64, 4, 2), (32, 128, 8, 2)]
    module.DQ_CONFIGS = [(64, 64, 4, 2), (128, 32, 8, 2), (64, 128, 4, 2)]
    return module


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_textbook_fp8_kernels_match_float64(textbook, causal):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    textbook.check(True, causal, device, s=256)
    textbook.check_ladder(causal, device, s=256)
