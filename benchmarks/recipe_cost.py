"""What each recipe option costs: forward and forward+backward time of fp8_delta with one option
changed at a time (transforms off, per-tile channel scales, ...), at one shape, in one run.

    python benchmarks/recipe_cost.py --seq 8192 --batch 2 --causal 1
    python benchmarks/recipe_cost.py --kernels fp8_delta,fp8_delta_fast   # where each recipe's time goes

``--kernels``: for the named variants (or named recipes, ``RECIPES``), the GPU time of every kernel
of one forward and of one forward+backward (torch.profiler, mean over 10 calls after warm-up),
SDPA's cuDNN backend beside. The variant ``fast`` is ``fp8_delta_fast``, ``token`` is
``fp8_delta_token``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_fp8_attention import RECIPES, fp8_attention  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_names import add_schedule_options, apply_schedule_options, fresh_memory_peak  # noqa: E402

VARIANTS = {
    "fp8_delta": {},
    "no_hadamard": {"hadamard": False},
    "no_smooth_k": {"smooth_k": False},
    "no_transforms": {"hadamard": False, "smooth_k": False},
    "kv_per_token": {"kv_scales": "token"},
    "p_ds_per_tile": {"p_scales": "tile", "ds_scales": "tile"},
    "token": {"kv_scales": "token", "p_scales": "tile", "ds_scales": "tile"},  # fp8_delta_token
    "tile_channels_no_transforms": {"kv_scales": "token", "p_scales": "tile", "ds_scales": "tile",
                                    "hadamard": False, "smooth_k": False, "channel_scales": "tile"},
    "fast": {"qdo_scales": "head", "channel_scales": "head"},  # fp8_delta_fast
    "fast_no_transforms": {"qdo_scales": "head", "channel_scales": "head", "hadamard": False, "smooth_k": False},
}


def _bench(fn) -> float:
    """Median ms of ``fn`` from a fresh memory peak (:func:`recipe_names.fresh_memory_peak`)."""
    fresh_memory_peak()
    return triton.testing.do_bench(fn, warmup=25, rep=100)


def kernel_times(fn, calls: int = 10) -> list[tuple[str, float, float]]:
    """(kernel name, us per call, launches per call) of ``fn``'s CUDA kernels, longest first (from
    a fresh memory peak, as :func:`_bench`)."""
    fresh_memory_peak()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.count and us > 0 and getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
            rows.append((e.key, us / calls, e.count / calls))
    return sorted(rows, key=lambda r: -r[1])


def print_kernels(label: str, fn) -> None:
    rows = kernel_times(fn)
    total = sum(r[1] for r in rows)
    print(f"\n{label}: {total:8.1f} us of kernels, {sum(r[2] for r in rows):.0f} launches per call")
    for name, us, n in rows:
        print(f"  {us:8.1f} us  x{n:<4.0f} {100 * us / total:5.1f}%  {name[:110]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA; default: --heads)")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--causal", type=int, default=1)
    p.add_argument("--kernels", default="", help="comma-separated variants: per-kernel GPU time instead")
    add_schedule_options(p)
    a = p.parse_args()
    schedule = apply_schedule_options(p, a)
    hkv = a.kv_heads or a.heads
    q, k, v, do = (torch.randn((a.batch, h, a.seq, a.dim), device="cuda", dtype=torch.bfloat16)
                   for h in (a.heads, hkv, hkv, a.heads))
    print(f"B={a.batch} H={a.heads} Hkv={hkv} S={a.seq} D={a.dim} causal={bool(a.causal)}"
          f"{' ' + schedule if schedule else ''}  (ms, median of do_bench)")
    if a.kernels:
        profile_kernels(a, q, k, v, do)
        return
    for name, change in VARIANTS.items():
        cfg = RECIPES["fp8_delta"].replace(**change)
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        fwd = _bench(lambda: fp8_attention(q, k, v, causal=bool(a.causal), config=cfg))

        def step():
            out = fp8_attention(qg, kg, vg, causal=bool(a.causal), config=cfg)
            torch.autograd.grad(out, (qg, kg, vg), do)

        both = _bench(step)
        print(f"{name:<30} fwd {fwd:7.3f}  fwd+bwd {both:7.3f}", flush=True)


def profile_kernels(a, q, k, v, do) -> None:
    causal = bool(a.causal)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def sdpa_step():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal,
                                                                     enable_gqa=kg.shape[1] != qg.shape[1])
            torch.autograd.grad(out, (qg, kg, vg), do)

    print_kernels("sdpa_cudnn fwd+bwd", sdpa_step)
    print(f"sdpa_cudnn fwd+bwd wall: {1000 * _bench(sdpa_step):.1f} us")
    for name in a.kernels.split(","):
        cfg = RECIPES[name] if name in RECIPES else RECIPES["fp8_delta"].replace(**VARIANTS[name])

        def step(cfg=cfg):
            out = fp8_attention(qg, kg, vg, causal=causal, config=cfg)
            torch.autograd.grad(out, (qg, kg, vg), do)

        print_kernels(f"{name} fwd", lambda cfg=cfg: fp8_attention(q, k, v, causal=causal, config=cfg))
        print_kernels(f"{name} fwd+bwd", step)
        # Kernel sums hide host gaps and device syncs: the whole call timed as the benchmarks do.
        print(f"{name} fwd+bwd wall: {1000 * _bench(step):.1f} us")


if __name__ == "__main__":
    main()
