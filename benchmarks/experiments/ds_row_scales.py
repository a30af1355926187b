"""dQ's error on real activations with dS scaled once per query row instead of per row within each
key tile: the numerics a dQ kernel that accumulates its MMA in place would have (the per-tile dS
scale is what keeps today's dQ loop from it; benchmarks/NOTES.md, "Recipe v2").

    PYTHONPATH=. python benchmarks/experiments/ds_row_scales.py [--recipes fp8_delta fp8_delta_fast]

On the fixture slice (tests/data), CPU emulation, fp8_delta's own P, dP, D and dS; dQ = τ·fq(dS)·fq(K)
with fq(K) the recipe's, and fq(dS) one of:
- ``tile``: per row within each key tile (the shipped recipe: equals the emulation's dQ);
- ``row``: one scale per query row from the row's exact amax (needs the whole row first);
- ``row_bound``: one scale per row from a bound the statistics pass can form before any dS exists,
  max_j P_ij |dP_ij| + |D_i| · max_j P_ij  (≥ max_j |dS_ij|, since |dS| ≤ P·|dP| + P·|D|);
- ``head``: one scale per (sequence, head).
Relative errors against float64 attention, all heads at once.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from recipe_errors import DEFAULT_FIXTURE, SCALE, emulate, load_layers, rel  # noqa: E402

from hf_fp8_attention import RECIPES  # noqa: E402
from hf_fp8_attention.exact import exact_attention_grads  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from hf_fp8_attention.config import FP8Format  # noqa: E402
from hf_fp8_attention.quant import compute_scales, fake_quantize  # noqa: E402
from hf_fp8_attention.reference import _fq_col, _rows_times  # noqa: E402


def with_scale(x: torch.Tensor, amax: torch.Tensor, fmt: FP8Format = FP8Format.E4M3) -> torch.Tensor:
    """fp32 x quantized with the recipe's scale for ``amax`` (broadcast against x), dequantized."""
    s = compute_scales(amax, fmt, pow2=False)
    return (x / s).clamp(-fmt.max, fmt.max).to(fmt.dtype).float() * s


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=["fp8_delta", "fp8_delta_fast"])
    a = p.parse_args(argv)
    mask = MaskSpec(causal=True)
    print(f"{'layer':>5} {'recipe':<15} {'tile':>7} {'row':>7} {'row_bound':>9} {'head':>7}   (dQ relative error)")
    for layer, (q, k, v, do) in load_layers(DEFAULT_FIXTURE, 1024).items():
        exact_dq = exact_attention_grads(q, k, v, do, scale=SCALE, mask=mask)[1]
        for name in a.recipes:
            # dS per tile, the recipes' scaling when this was measured (fp8_delta_fast has since
            # taken ds_scales="head"): the "tile" column is then the emulation's own dQ.
            config = RECIPES[name].replace(backend="emulation", ds_scales="tile")
            _, (dq_emul, _, _), internals = emulate(q, k, v, do, config)
            ds, pr, dp, delta = internals.ds, internals.p, internals.dp, internals.delta
            ks = _fq_col(k.float(), config.k_format, config.block_k, config)
            bound = (pr * dp.abs()).amax(-1, keepdim=True) + delta.abs()[..., None] * pr.amax(-1, keepdim=True)
            variants = {
                "tile": fake_quantize(ds, dim=-1, block=config.block_k, fmt=config.ds_format),
                "row": with_scale(ds, ds.abs().amax(-1, keepdim=True)),
                "row_bound": with_scale(ds, bound),
                "head": with_scale(ds, ds.abs().amax((-1, -2), keepdim=True)),
            }
            errs = {}
            for key, dsq in variants.items():
                dq = (_rows_times(dsq, ks) * SCALE).reshape(q.shape)
                errs[key] = rel(dq, exact_dq)
            # Guards the script: the "tile" variant is the emulation's own dQ.
            assert abs(rel(dq_emul, exact_dq) - errs["tile"]) < 1e-6, (rel(dq_emul, exact_dq), errs["tile"])
            print(f"{layer:>5} {name:<15} " + " ".join(f"{100 * errs[k]:6.2f}%" for k in ("tile", "row"))
                  + f" {100 * errs['row_bound']:8.2f}% {100 * errs['head']:6.2f}%", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
