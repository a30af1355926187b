"""A slice of the kernel matrix (tests/kernel_matrix.py) under the Triton interpreter, on the CPU.

Eight tiny cases (sequence lengths <= 40, 16-token tiles via ``block_q = block_k = 16``: several
tiles and partial ones) through the same case builder as the GPU matrix
(tests/gpu/test_kernel_matrix.py): dense, left/right padded and packed layouts, head dims
64/96/128/256, causal and not, windows, decode-shaped queries, recipes and delta modes. The Triton
forward and backward against the emulation, with the interpreter tests' bounds
(tests/test_kernels_interpreter.py, tests/test_backward_interpreter.py: fp32 summation order only,
the FP8 codes are identical): forward ``‖ΔO‖/‖O‖ <= 2e-5`` and ``|ΔLSE| / max(1, |LSE|) <= 2e-5``
with the same rows without keys; backward ``‖Δ‖/‖ref‖ <= 1e-4``.

The interpreter must be on before Triton decorates the kernels, so the cases run once in a
subprocess (``TRITON_INTERPRET=1``); measured on a 2-core machine: ~35 s for the eight.
Also here (CPU, no kernels): the GPU matrix's case list covers every axis.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_matrix  # noqa: E402

# Eight generated cases: the four layouts and the four head dims, padded and packed rows at d = 96 /
# 128 / 256 with the sequence-statistics recipes among them.
SLICE = list(kernel_matrix.generate(8, seed=7, lengths=kernel_matrix.SLICE_LENGTHS, dtypes=("float32",),
                                    max_batch=2, grouped=False))
TILES = dict(block_q=16, block_k=16)
FWD_REL, LSE_REL, GRAD_REL = 2e-5, 2e-5, 1e-4
GPU_MATRIX = dict(n=320, seed=20261201)  # as tests/gpu/test_kernel_matrix.py


def _run_case(case) -> dict:
    import torch

    from hf_fp8_attention.kernels.backward import triton_backward
    from hf_fp8_attention.kernels.forward import triton_forward
    from hf_fp8_attention.reference import emulated_backward, emulated_forward

    config = case.config(**TILES)
    q, k, v, dout, mask = kernel_matrix.build(case)
    scale = case.d**-0.5
    out, lse = triton_forward(q, k, v, scale=scale, mask=mask, config=config, block_m=16)
    ref, ref_lse = emulated_forward(q, k, v, scale=scale, mask=mask, config=config)
    fin = torch.isfinite(ref_lse)
    result = {
        "fwd_rel": float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)),
        "lse_rel": float(((lse[fin] - ref_lse[fin]).abs() / ref_lse[fin].abs().clamp(min=1.0)).max()) if fin.any() else 0.0,
        "lse_inf_same": bool(torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))),
        "finite": bool(torch.isfinite(out).all()),
    }
    got = triton_backward(q, k, v, ref, ref_lse, dout, scale=scale, mask=mask, config=config)
    want = emulated_backward(q, k, v, ref, ref_lse, dout, scale=scale, mask=mask, config=config)
    for name, x, r in zip(("dq", "dk", "dv"), got, want):
        if r.norm() == 0:
            result[name] = 0.0 if not x.any() else float("inf")
        else:
            result[name] = float((x.double() - r.double()).norm() / r.double().norm())
        result[f"{name}_finite"] = bool(torch.isfinite(x).all())
    return result


def _run_all(part: int = 0, parts: int = 1) -> dict:
    """The slice's cases whose index is ``part`` modulo ``parts`` (all of them by default)."""
    return {case.id: _run_case(case) for i, case in enumerate(SLICE) if i % parts == part}


@pytest.fixture(scope="module")
def slice_results():
    pytest.importorskip("triton")
    from helpers import interpreter_results

    results = interpreter_results(__file__)  # one process per CPU core
    assert len(results) == len(SLICE)
    return results


@pytest.mark.parametrize("case", SLICE, ids=lambda c: c.id)
def test_slice_kernels_match_emulation(slice_results, case):
    r = slice_results[case.id]
    assert r["finite"] and r["lse_inf_same"], r
    assert r["fwd_rel"] <= FWD_REL and r["lse_rel"] <= LSE_REL, r
    for name in ("dq", "dk", "dv"):
        assert r[f"{name}_finite"] and r[name] <= GRAD_REL, (name, r)


def test_slice_covers_the_layouts_and_head_dims():
    cov = kernel_matrix.coverage(SLICE)
    assert cov["layout"] == set(kernel_matrix.LAYOUTS) and cov["d"] == set(kernel_matrix.HEAD_DIMS)
    assert cov["causal"] == {False, True} and cov["window"] == {False, True}
    assert max(max(c.sq, c.sk) for c in SLICE if c.layout != "packed") <= 40


def test_gpu_matrix_covers_every_axis():
    cases = kernel_matrix.generate(**GPU_MATRIX)
    cov = kernel_matrix.coverage(cases)
    assert len(cases) >= 300
    assert cov["recipe_delta"] == set(kernel_matrix.recipe_deltas())  # every recipe, each delta mode
    assert cov["layout"] == set(kernel_matrix.LAYOUTS) and cov["d"] == set(kernel_matrix.HEAD_DIMS)
    assert cov["dtype"] == set(kernel_matrix.DTYPES)
    assert cov["length_kinds"] == {"one", "odd", "tile_multiple"}
    for axis in ("causal", "window", "gqa", "decode", "empty_padded_row", "empty_sequence"):
        assert cov[axis] == {False, True}, axis
    # Every (recipe, delta) pair meets every head dim and dtype; compiled variants stay bounded.
    assert {(c.recipe, c.delta, c.d) for c in cases} == {(r, m, d) for r, m in kernel_matrix.recipe_deltas()
                                                         for d in kernel_matrix.HEAD_DIMS}
    assert {(c.recipe, c.delta, c.dtype) for c in cases} == {(r, m, t) for r, m in kernel_matrix.recipe_deltas()
                                                             for t in kernel_matrix.DTYPES}
    assert len(kernel_matrix.kernel_variants(cases)) == len(kernel_matrix.HEAD_DIMS) * len(kernel_matrix.recipe_deltas())


def test_new_recipes_join_the_matrix(monkeypatch):
    from hf_fp8_attention import RECIPES, FP8AttentionConfig

    monkeypatch.setitem(RECIPES, "zz_test_recipe", FP8AttentionConfig(pow2_scales=True))
    cases = kernel_matrix.generate(**GPU_MATRIX)
    assert {c.recipe for c in cases} >= {"zz_test_recipe"}


if __name__ == "__main__":
    print(json.dumps(_run_all(*map(int, sys.argv[1:3]))))


def test_noise_bounds_are_the_base_bounds_on_large_problems():
    """Over hundreds of keys per query the small-sample model gives the GPU tests' bounds back (it
    only widens bounds where the terms are few or a cancellation residue; under a causal mask the
    first rows' concentrated P already count as few)."""
    import torch

    case = kernel_matrix.Case(0, "dense", 1, 4, 2, 512, 512, 64, "float32", False, None, "fp8_delta", "matched")
    q, k, v, dout, mask = kernel_matrix.build(case)
    bounds = kernel_matrix.noise_bounds(case, q, k, v, dout, mask, 1e-2, 2e-3, 1e-2)
    assert bounds["o"] == bounds["dv"] == bounds["dq"] == bounds["dk"] == 1e-2, bounds
    assert torch.isfinite(torch.tensor(bounds["lse"]))


def test_noise_bounds_widen_for_a_stale_delta_over_one_key():
    """One key per query: the exact dS is zero, the stale emulation's is the FP8 error of O, so a
    code flip moves dQ by a large share; with the matched delta dS is exactly zero (the GPU test
    then asks for an exact zero) and the base bound stays."""
    stale = kernel_matrix.Case(0, "dense", 2, 2, 2, 31, 31, 96, "float32", True, 1, "fp8_delta", "stale")
    matched = kernel_matrix.Case(0, "dense", 2, 2, 2, 31, 31, 96, "float32", True, 1, "fp8_delta", "matched")
    for case, expect_wider in ((stale, True), (matched, False)):
        q, k, v, dout, mask = kernel_matrix.build(case)
        bounds = kernel_matrix.noise_bounds(case, q, k, v, dout, mask, 1e-2, 2e-3, 1e-2)
        assert (bounds["dq"] > 2e-2) is expect_wider, (case.delta, bounds)
