"""The kernel matrix on the GPU: Triton forward and backward against the emulation on 320 fixed cases.

The cases (tests/kernel_matrix.py) are a seeded random sample over batch, heads (GQA), lengths
(1, odd, multiples of the 128-token tiles), head dims 64/96/128/256, bf16/fp16/fp32, causal, window,
dense / left-padded / right-padded / packed layouts, and every recipe of ``RECIPES`` with each
delta mode (recipes added later join automatically). Shapes stay small (<= 384 tokens per row); the time
is compilation (on an H200 with 8 pytest-xdist workers, ``-n 8``, a cold run covered ~130 cases in
290 s).

Bounds are those of the existing GPU tests, for the same reasons (see their docstrings):
forward ``‖ΔO‖/‖O‖ <= O_REL`` and ``|ΔLSE| <= LSE_ABS`` with the same rows without keys
(tests/gpu/test_forward_kernel.py: emulation on the CPU, exact division); backward
``GRAD_REL`` for fp32 gradients and ``BF16_REL`` for 16-bit ones (fp16 rounds finer than bf16)
against the emulation's backward on the emulation's forward (tests/gpu/test_backward_kernel.py).
Those bounds are the noise model's typical sizes on problems of hundreds of rows and keys; a
matrix case with a handful of terms (one query, a window of 2), or whose terms are a cancellation
residue, takes the same model at its own number of terms and its own sensitivity to the
accumulation noise (``kernel_matrix.noise_bounds``, tests/noise_model.py), which gives the base
bounds back over hundreds of keys per query. (The first full run on the H200 failed 4 of 320 cases on the base bounds alone, all
by under 1.3x and all small: 1 query over a window of 25 keys, 2 queries, 15-token rows, a
100-token causal row's LSE. A later run failed 3 on the count-only model: two stale-delta dQ with
one key per query, where the exact dS is zero and the emulation's is the FP8 error of O, and a dV
1.01x over a bound that took a flip's step as 2^-m / sqrt(3) instead of sqrt(1/2) · 2^-m.)
A gradient whose emulated value is exactly zero (a query that sees a single key) must be zero.

Kernel variants: the compiled axes (recipe and delta, head dim, dtype, causal, window, varlen) take
one combination per head dim and (recipe, delta) pair, 80 with four head dims and 20 pairs (see
``kernel_matrix.generate``), so a cold run compiles a bounded set of kernels.
The list's coverage is checked on the CPU (tests/test_kernel_matrix_interpreter.py), which also runs
an 8-case slice of the same builder under the Triton interpreter.

Run: ``python -m pytest -m gpu tests/gpu/test_kernel_matrix.py``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_matrix  # noqa: E402
from helpers import rel_err  # noqa: E402
from test_backward_kernel import BF16_REL, GRAD_REL  # noqa: E402
from test_forward_kernel import LSE_ABS, O_REL, _check_vs_emulation, _pinned_launch  # noqa: E402,F401  (autouse fixture)

from hf_fp8_attention.reference import emulated_backward, emulated_forward  # noqa: E402

pytestmark = pytest.mark.gpu

SEED = 20261201
CASES = kernel_matrix.generate(320, SEED)
MIN_KERNEL_BLOCK = 32  # FP8 MMAs contract over >= 32 tokens (smaller recipe blocks: emulation only)


def _grad_bound(base: float, dtype: torch.dtype) -> float:
    return base if dtype == torch.float32 else base + (BF16_REL - GRAD_REL)  # + one bf16 rounding


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_kernels_match_emulation(case):
    config = case.config()
    if min(config.block_q, config.block_k) < MIN_KERNEL_BLOCK:
        pytest.skip(f"recipe {case.recipe} has blocks below {MIN_KERNEL_BLOCK}: emulation only")
    from hf_fp8_attention.kernels.backward import triton_backward

    q, k, v, dout, mask = kernel_matrix.build(case, "cuda")
    scale = case.d**-0.5
    bounds = kernel_matrix.noise_bounds(case, q, k, v, dout, mask, O_REL, LSE_ABS, GRAD_REL)
    # forward: O and LSE bounds, rows without keys
    _check_vs_emulation(q, k, v, mask, config, o_rel=bounds["o"], lse_abs=bounds["lse"])

    # Backward alone, on the emulation's forward (as tests/gpu/test_backward_kernel.py).
    out, lse = emulated_forward(q, k, v, scale=scale, mask=mask, config=config)
    got = triton_backward(q, k, v, out, lse, dout, scale=scale, mask=mask, config=config)
    ref = emulated_backward(q, k, v, out, lse, dout, scale=scale, mask=mask, config=config)
    for label, x, r, like in zip(("dq", "dk", "dv"), got, ref, (q, k, v)):
        assert x.shape == like.shape and x.dtype == like.dtype, label
        assert torch.isfinite(x).all(), label
        if r.float().norm() == 0:
            assert not x.any(), f"{label} must be exactly zero"
        else:
            assert rel_err(x, r) <= _grad_bound(bounds[label], q.dtype), (label, rel_err(x, r))
