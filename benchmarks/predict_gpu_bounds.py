"""Predict on the CPU whether the GPU kernel tests' bounds hold: each case's emulation under a model
of Hopper's FP8 accumulation (tests/hopper_accumulator.py) against the plain emulation, as a ratio
to the bound the GPU test applies.

A ratio near or above 1 marks a case likely to fail on the GPU before any GPU time is spent; the
model is a model (its docstring gives how it compares with H200 measurements), so a ratio is a
prediction, not a test result. The bounds are the noise model's without its ``accumulator_model``
scaling (which takes this same model's differences and would pass them by construction): what the
GPU tests applied before that scaling, so the tables also check the model against those runs.

  python benchmarks/predict_gpu_bounds.py --suite softcap_sinks [--only fp8_stale-window_d96-sinks]
  python benchmarks/predict_gpu_bounds.py --suite recipes
  python benchmarks/predict_gpu_bounds.py --suite kernel_matrix --limit 40

Writes ``benchmarks/results/cpu_predicted_<suite>.md`` (``--out`` to change) and prints each case as
it ends.
"""
from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import hopper_accumulator  # noqa: E402
from hopper_accumulator import modelled_differences  # noqa: E402
import kernel_matrix  # noqa: E402
import noise_model  # noqa: E402
from helpers import make_qkv  # noqa: E402

from hf_fp8_attention import RECIPES  # noqa: E402

QUANTITIES = ("lse", "o", "dq", "dk", "dv")


def load_gpu_test_module(name: str):
    """tests/gpu/<name>.py as a module (its cases, shapes and bounds), without running it."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def softcap_sinks_cases(only):
    """(id, inputs, bounds) of tests/gpu/test_softcap_sinks_kernel.py's feature cases."""
    t = load_gpu_test_module("test_softcap_sinks_kernel")
    for recipe in t.RECIPES_RUN:
        for shape in sorted(t.SHAPES):
            for mods_name in t.MODS:
                case_id = f"{recipe}-{shape}-{mods_name}"
                if only and case_id not in only:
                    continue
                dims, causal, window, cu = t.SHAPES[shape]
                q, k, v, dout = make_qkv(*dims, dtype=torch.float32, seed=11, outliers=True)
                mods, mask, config = t._mods(mods_name, dims[1], "cpu"), t._mask(causal, window, cu, "cpu"), RECIPES[recipe]
                scale = dims[-1] ** -0.5
                bounds = noise_model.noise_bounds(q, k, v, dout, mask, config, scale=scale, o_rel=t.O_REL,
                                                  lse_abs=t.lse_bound(dims[-1]), grad_rel=t.GRAD_REL, **mods)
                yield case_id, (q, k, v, dout, mask, config, scale, mods), bounds


def recipes_cases(only):
    """(id, inputs, bounds) of tests/gpu/test_recipes_kernel.py's cases (fixed bounds there)."""
    t = load_gpu_test_module("test_recipes_kernel")
    lse_bound = load_gpu_test_module("test_forward_kernel").lse_bound
    for recipe, shape in t.CASES:
        case_id = f"{recipe}-{shape}"
        if only and case_id not in only:
            continue
        dims, causal, window, cu = t.SHAPES[shape]
        q, k, v, dout = make_qkv(*dims, dtype=torch.float32, seed=7)
        bounds = {"lse": lse_bound(dims[-1]), "o": t.O_REL, "dq": t.GRAD_REL, "dk": t.GRAD_REL, "dv": t.GRAD_REL}
        yield case_id, (q, k, v, dout, t._mask(causal, window, cu, "cpu"), RECIPES[recipe], dims[-1] ** -0.5, {}), bounds


def kernel_matrix_cases(only, limit):
    """(id, inputs, bounds) of tests/gpu/test_kernel_matrix.py's cases (fp32 bounds: the model runs
    in fp32, so the 16-bit cases' output rounding is left out on both sides)."""
    t = load_gpu_test_module("test_kernel_matrix")
    for case in t.CASES[:limit]:
        if only and case.id not in only:
            continue
        config = case.config()
        if min(config.block_q, config.block_k) < t.MIN_KERNEL_BLOCK:
            continue
        q, k, v, dout, mask = kernel_matrix.build(case)
        q, k, v, dout = (x.float() for x in (q, k, v, dout))
        bounds = kernel_matrix.noise_bounds(case, q, k, v, dout, mask, t.O_REL, t.LSE_ABS, t.GRAD_REL)
        yield case.id, (q, k, v, dout, mask, config, case.d**-0.5, {}), bounds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", choices=("softcap_sinks", "recipes", "kernel_matrix"), required=True)
    parser.add_argument("--only", nargs="*", help="case ids")
    parser.add_argument("--limit", type=int, help="first N kernel-matrix cases")
    parser.add_argument("--guard-bits", type=int, default=hopper_accumulator.GUARD_BITS,
                        help="the model's guard bits (tests/hopper_accumulator.py)")
    parser.add_argument("--out", type=Path, help="results file (default benchmarks/results/cpu_predicted_<suite>.md)")
    args = parser.parse_args(argv)
    hopper_accumulator.GUARD_BITS = args.guard_bits
    cases = {"softcap_sinks": lambda: softcap_sinks_cases(args.only), "recipes": lambda: recipes_cases(args.only),
             "kernel_matrix": lambda: kernel_matrix_cases(args.only, args.limit)}[args.suite]()
    rows, start = [], time.time()
    for i, (case_id, inputs, bounds) in enumerate(cases):
        diff = modelled_differences(*inputs)
        ratios = {n: diff[n] / bounds[n] for n in QUANTITIES}
        worst = max(ratios, key=ratios.get)
        rows.append((case_id, diff, bounds, ratios, worst))
        print(f"[{i + 1}] {case_id}: worst {worst} {ratios[worst]:.2f} of its bound "
              f"({diff[worst]:.3g} / {bounds[worst]:.3g}), {time.time() - start:.0f} s", flush=True)
    out = args.out or ROOT / "benchmarks" / "results" / f"cpu_predicted_{args.suite}.md"
    lines = [f"# Predicted kernel-vs-emulation differences: {args.suite}", "",
             f"`python benchmarks/predict_gpu_bounds.py --suite {args.suite} --guard-bits {args.guard_bits}`; torch {torch.__version__}, "
             f"{platform.processor() or platform.machine()}; model: tests/hopper_accumulator.py "
             f"(`--guard-bits {hopper_accumulator.GUARD_BITS}`). Each cell: modelled difference / GPU test bound.", "",
             "| case | " + " | ".join(QUANTITIES) + " | worst ratio |", "|---|" + "---|" * (len(QUANTITIES) + 1)]
    for case_id, diff, bounds, ratios, worst in sorted(rows, key=lambda r: -r[3][r[4]]):
        cells = " | ".join(f"{diff[n]:.3g} / {bounds[n]:.3g}" for n in QUANTITIES)
        lines.append(f"| {case_id} | {cells} | {worst} {ratios[worst]:.2f} |")
    above = [r[0] for r in rows if r[3][r[4]] > 1]
    lines += ["", f"{len(rows)} cases, {len(above)} above a bound: {', '.join(above) or 'none'}."]
    out.write_text("\n".join(lines) + "\n")
    print(f"{len(rows)} cases, {len(above)} above a bound; wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
