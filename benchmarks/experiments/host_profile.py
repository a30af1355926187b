"""Host time of one ``fp8_attention`` fwd+bwd at one shape, per recipe: whether it syncs the device
(``torch.cuda.set_sync_debug_mode``), the host's time per call against the wall time of the same
loop (host-bound when they are equal), and a cProfile of 20 calls (by own time, then cumulative).

Defaults: the SmolLM2-135M attention shape (9 query / 3 kv heads, head dim 64), causal, bf16.

    python benchmarks/experiments/host_profile.py --seq 8192
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
import warnings

import torch

from hf_fp8_attention import RECIPES, fp8_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--recipes", default="fp8_delta,fp8_stale,fp8_delta_fast")
    p.add_argument("--calls", type=int, default=20)
    a = p.parse_args()
    q, k, v, do = (torch.randn((1, h, a.seq, a.dim), device="cuda", dtype=torch.bfloat16)
                   for h in (a.heads, a.kv_heads, a.kv_heads, a.heads))
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def step(cfg):
        out = fp8_attention(qg, kg, vg, causal=True, config=cfg)
        torch.autograd.grad(out, (qg, kg, vg), do)

    for name in a.recipes.split(","):
        cfg = RECIPES[name]
        for _ in range(3):
            step(cfg)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(cfg)
        torch.cuda.set_sync_debug_mode(0)
        print(f"{name}: {len(caught)} sync warnings", [str(w.message)[:120] for w in caught[:5]])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.calls):
            step(cfg)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"{name}: host {1e6 * (t1 - t0) / a.calls:.0f} us/call, wall {1e6 * (t2 - t0) / a.calls:.0f} us/call")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            step(cfg)
        prof.disable()
        torch.cuda.synchronize()
        for order, lines in (("tottime", 25), ("cumulative", 40)):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(lines)
            print(text.getvalue())


if __name__ == "__main__":
    main()
