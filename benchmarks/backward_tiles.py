"""Tile shapes of the block-free backward: one launch varied at a time, the whole backward timed.

A recipe whose backward no block binds (channel scales per sequence or head, P on the fixed grid,
dS per head: :func:`hf_fp8_attention.kernels.operands.backward_block_free`) may tile each launch
freely (``LAUNCH["block_free"]`` in ``hf_fp8_attention/kernels/backward.py``). This script starts
from the launch table as it is, tries each variant of one launch with the others left alone, keeps
the faster one (coordinate descent, one pass), for the dK/dV side both the split pair and the
fused launch, and keeps the faster schedule. Gradients are compared with the starting table's (tiles change only the fp32 summation
order; a difference beyond 1e-2 relative is flagged).

    python benchmarks/backward_tiles.py --recipe fp8_delta_fast --seq 8192 --batch 2 [--out DIR]
    python benchmarks/backward_tiles.py --recipe fp8_delta_fast+dq_in_stats   # the one-sweep dQ launch

(``recipe+flag`` switches a boolean config option on; with ``dq_in_stats`` the dQ side is the one
``dq_sweep`` launch instead of ``dq_stats`` and ``dq``.)

Prints one line per variant (ms of the backward, TFLOP/s counting the causal backward as
2.5 x 2·B·H·S²·D) and the chosen table; ``--out`` writes them as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_fp8_attention.kernels.backward import LAUNCH, triton_backward  # noqa: E402
from hf_fp8_attention.kernels.forward import triton_forward  # noqa: E402
from hf_fp8_attention.kernels.operands import backward_block_free  # noqa: E402
from hf_fp8_attention.kernels.quantize import padded_head_dim  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_names import fresh_memory_peak, recipe_config  # noqa: E402

# (BLOCK_Q, BLOCK_K, num_warps, num_stages) per launch. The dK/dV launches hold (BLOCK_K, BLOCK_Q)
# tiles and a (BLOCK_K, D) accumulator each: 128 keys need 8 warps at D = 128.
VARIANTS = {
    "dq_stats": [(64, 128, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2)],
    "dq": [(64, 128, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 4)],
    # Two (BLOCK_Q, D) fp32 accumulators: offline (Triton 3.9, sm_90a, D = 128) 64 x 64 on 4 warps
    # spills 60 B at 2 stages and 208 B at 3; 64 x 32 and 8 warps spill nothing.
    "dq_sweep": [(64, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2), (64, 64, 4, 3)],
    "dk": [(128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2), (32, 64, 4, 3)],
    "dv": [(128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2), (128, 128, 8, 2)],
}
FUSED = [(64, 64, 4, 3), (32, 64, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2)]


def _set(launch: str, variant) -> None:
    tq, tk, warps, stages = variant
    LAUNCH["block_free"][launch] = (tq, tk)
    LAUNCH[launch] = {"num_warps": warps, "num_stages": stages}


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="fp8_delta_fast")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", type=int, default=1)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    a = ap.parse_args(argv)
    cfg = recipe_config(a.recipe)
    dq_side = ("dq_sweep",) if cfg.dq_in_stats else ("dq_stats", "dq")
    if not backward_block_free(cfg):
        raise SystemExit(f"{a.recipe}: its backward is bound to its blocks; nothing to tile freely")
    b, h, s, d = a.batch, a.heads, a.seq, a.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, s, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(4))
    mask = MaskSpec(causal=bool(a.causal))
    scale = d**-0.5
    out, lse = triton_forward(q, k, v, scale=scale, mask=mask, config=cfg)
    o_arg = out if cfg.delta.value == "stale" else None
    flops = 2.5 * 4 * b * h * s * s * d / (2 if a.causal else 1)

    def run():
        return triton_backward(q, k, v, o_arg, lse, do, scale=scale, mask=mask, config=cfg)

    def timed(label):
        try:
            grads = run()
            fresh_memory_peak()  # a lone call's path, whatever ran before
            ms = do_bench(run, warmup=25, rep=100, return_mode="median")
        except Exception as err:  # noqa: BLE001 (a variant that does not compile or fit is reported)
            print(f"{label}: {type(err).__name__}: {str(err)[:160]}", flush=True)
            return None
        diff = max(_rel(x, r) for x, r in zip(grads, reference))
        flag = "  <- gradients differ" if diff > 1e-2 else ""
        print(f"{label}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, max rel. diff to the start {diff:.1e}{flag}",
              flush=True)
        rows.append({"label": label, "ms": ms, "diff": diff})
        return ms

    free = LAUNCH["block_free"]
    if padded_head_dim(d) <= 64:  # the small-head-dim shapes in place, so that ``free`` names what runs
        free.update(LAUNCH["block_free_d64"])
    LAUNCH["block_free_d64"] = {}
    for launch in VARIANTS:
        if launch in ("dq_stats", "dq", "dq_sweep") and launch not in dq_side:
            continue
        if free.get(launch) is None:
            _set(launch, VARIANTS[launch][0])
    fused_start = not free.get("split_dkdv", LAUNCH["split_dkdv"])
    print(f"{a.recipe} S={s} B={b} H={h} D={d} causal={bool(a.causal)}; {torch.cuda.get_device_name()}, "
          f"torch {torch.__version__}", flush=True)
    rows: list[dict] = []
    reference = run()
    start = timed("start " + json.dumps(free))

    def descend(launches, best):
        """Each variant of each launch in turn, the others left alone; keeps the fastest."""
        for launch in launches:
            keep = (free[launch], dict(LAUNCH[launch]))
            for variant in (VARIANTS.get(launch) or FUSED):
                if (tuple(free[launch]), LAUNCH[launch]["num_warps"], LAUNCH[launch]["num_stages"]) == \
                        (variant[:2], variant[2], variant[3]):
                    continue  # the shape in place: its time is ``best``
                _set(launch, variant)
                ms = timed(f"{launch}={variant}")
                if ms is not None and (best is None or ms < best):
                    best, keep = ms, (free[launch], dict(LAUNCH[launch]))
            free[launch], LAUNCH[launch] = keep[0], keep[1]
        return best

    best = descend(dq_side, start)
    # dK and dV: the split pair, then the fused launch, each from its best; the faster schedule stays.
    free["split_dkdv"] = True
    split_best = timed("split dK/dV") if fused_start else best
    split_best = descend(("dk", "dv"), split_best)
    free["split_dkdv"] = False
    fused_best = descend(("dkdv",), timed("fused dK/dV") if not fused_start else best)
    free["split_dkdv"] = fused_best is None or (split_best is not None and split_best <= fused_best)
    best = split_best if free["split_dkdv"] else fused_best
    chosen = {key: LAUNCH[key] for key in ("block_free", *dq_side, "dk", "dv", "dkdv")}
    print(f"chosen ({best:.3f} ms): {json.dumps(chosen)}", flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"backward_tiles_{a.recipe.replace('+', '_')}_s{s}.json"), "w") as f:
            json.dump({"recipe": a.recipe, "S": s, "B": b, "H": h, "D": d, "causal": bool(a.causal),
                       "rows": rows, "chosen": chosen, "best_ms": best}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
