"""Host time of one ``fp8_attention`` fwd+bwd with the direct launch path off and on, and where it goes.

Per shape (``llama8k``: the 0.89B Llama layer, q (1, 16, 8192, 128), k / v (1, 8, 8192, 128);
``smollm2_2k``: the SmolLM2-135M layer, 9 / 3 heads, head dim 64, 2048 tokens; causal, bf16,
token-major): SDPA's fwd+bwd host time (repeated K / V heads); per recipe (fast, ``fp8_delta``) and
direct path off / on, the host time of the forward, of the backward alone and of the fwd+bwd
(median of 100 calls, a device sync every 10, not timed); then, for the fast recipe with the direct
path on, a cProfile of 100 fwd+bwd (by own time, then cumulative) and torch.profiler's host-side
operator table of 20 (kernel launches, allocations, syncs).

    PYTHONPATH=. python benchmarks/experiments/direct_launch_host_split.py [llama8k] [smollm2_2k]
"""
import cProfile
import io
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.profiler import ProfilerActivity, profile

from hf_fp8_attention import RECIPES, fp8_attention
from hf_fp8_attention.kernels import launch

SHAPES = {"llama8k": (8192, 16, 8, 128), "smollm2_2k": (2048, 9, 3, 64)}  # tokens, q heads, kv heads, dim


def median_us(timed, n: int = 100, every: int = 10) -> float:
    """Median of the seconds ``timed()`` reports over ``n`` calls, in µs, the device synced (untimed)
    every ``every``."""
    times = []
    for i in range(n):
        if i % every == 0:
            torch.cuda.synchronize()
        times.append(timed())
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def host_us(fn, n: int = 100) -> float:
    """Median host µs of ``fn()`` over ``n`` calls (:func:`median_us`)."""
    def timed():
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return median_us(timed, n)


def backward_host_us(q, k, v, dout, cfg) -> float:
    """Median host µs of ``.backward`` alone (its forward untimed)."""
    def timed():
        out = fp8_attention(q, k, v, causal=True, config=cfg)
        t = time.perf_counter()
        out.backward(dout)
        return time.perf_counter() - t
    return median_us(timed)


def profiles(fwd_bwd) -> None:
    """cProfile of 100 calls (own time, then cumulative), torch.profiler's host table of 20."""
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for i in range(100):
        if i % 10 == 0:
            torch.cuda.synchronize()
        fwd_bwd()
    prof.disable()
    torch.cuda.synchronize()
    for key in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(45)
        print(text.getvalue()[-9000:])
    with profile(activities=[ProfilerActivity.CPU]) as ops_prof:
        for i in range(20):
            if i % 10 == 0:
                torch.cuda.synchronize()
            fwd_bwd()
        torch.cuda.synchronize()
    print(ops_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


def main() -> None:
    print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(), flush=True)
    for name in sys.argv[1:] or list(SHAPES):
        seq, hq, hkv, dim = SHAPES[name]
        q, k, v = (torch.randn(1, seq, h, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
                   for h in (hq, hkv, hkv))
        dout = torch.randn_like(q)
        k_rep, v_rep = (t.detach().repeat_interleave(hq // hkv, 1).requires_grad_() for t in (k, v))

        def sdpa():
            F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True).backward(dout)

        for _ in range(3):
            sdpa()
        print(f"== {name}: sdpa fwd+bwd host {host_us(sdpa):.1f} us", flush=True)
        for recipe in ("fp8_delta_fast", "fp8_delta"):
            cfg = RECIPES[recipe]

            def forward(cfg=cfg):
                return fp8_attention(q, k, v, causal=True, config=cfg)

            def fwd_bwd(cfg=cfg):
                fp8_attention(q, k, v, causal=True, config=cfg).backward(dout)

            for direct in (False, True):
                launch.DIRECT_LAUNCH = direct
                for _ in range(3):
                    fwd_bwd()
                torch.cuda.synchronize()
                print(f"{name} {recipe} direct={direct}: forward host {host_us(forward):.1f} us, backward host "
                      f"{backward_host_us(q, k, v, dout, cfg):.1f} us, fwd+bwd host {host_us(fwd_bwd):.1f} us",
                      flush=True)
        launch.DIRECT_LAUNCH = True
        profiles(lambda: fp8_attention(q, k, v, causal=True, config=RECIPES["fp8_delta_fast"]).backward(dout))
        launch.DIRECT_LAUNCH = None


if __name__ == "__main__":
    main()
