"""What each recipe option costs: forward and forward+backward time of fp8_delta with one option
changed at a time (transforms off, per-tile channel scales, ...), at one shape, in one run.

    python benchmarks/recipe_cost.py --seq 8192 --batch 2 --causal 1
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_fp8_attention import RECIPES, fp8_attention  # noqa: E402

VARIANTS = {
    "fp8_delta": {},
    "no_hadamard": {"hadamard": False},
    "no_smooth_k": {"smooth_k": False},
    "no_transforms": {"hadamard": False, "smooth_k": False},
    "tile_channels_no_transforms": {"hadamard": False, "smooth_k": False, "channel_scales": "tile"},
    "fast": {"qdo_scales": "head", "kv_scales": "head", "channel_scales": "head", "p_scales": "fixed"},
    "fast_no_transforms": {"qdo_scales": "head", "kv_scales": "head", "channel_scales": "head", "p_scales": "fixed",
                           "hadamard": False, "smooth_k": False},
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--causal", type=int, default=1)
    a = p.parse_args()
    shape = (a.batch, a.heads, a.seq, a.dim)
    q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    print(f"B={a.batch} H={a.heads} S={a.seq} D={a.dim} causal={bool(a.causal)}  (ms, median of do_bench)")
    for name, change in VARIANTS.items():
        cfg = RECIPES["fp8_delta"].replace(**change)
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        fwd = triton.testing.do_bench(lambda: fp8_attention(q, k, v, causal=bool(a.causal), config=cfg), warmup=25, rep=100)

        def step():
            out = fp8_attention(qg, kg, vg, causal=bool(a.causal), config=cfg)
            torch.autograd.grad(out, (qg, kg, vg), do)

        both = triton.testing.do_bench(step, warmup=25, rep=100)
        print(f"{name:<30} fwd {fwd:7.3f}  fwd+bwd {both:7.3f}", flush=True)


if __name__ == "__main__":
    main()
