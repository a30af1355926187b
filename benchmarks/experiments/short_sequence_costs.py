"""Where short sequences lose: the forward kernel's cost per program outside its key-tile loop, and
the backward's launches at short and long S.

``HF_FP8_ATTENTION_FWD_CONFIG=64,4,3 PYTHONPATH=. python benchmarks/experiments/short_sequence_costs.py``
on a GPU. GPU time per kernel from torch.profiler (the K/V quantization launch apart from the
attention kernel), H = 16, d = 128:

1. Non-causal forward, B = 4, Sq = 1024 and 4096, Sk = 128 .. 8192: the kernel's time per wave of
   2·SMs programs (two CTAs per SM) fitted as a + b·(key tiles per program); a / b is the
   once-per-program cost (Q load and quantization, pipeline prologues, epilogue) in tiles.
2. Causal and non-causal forward at 16k tokens, S = 1k .. 16k: kernel and quantization times.
3. The backward's launches at S = 1k, 2k, 8k (``backward_bench.profile``).

Eleventh session: results/h200_v16_short_sequence_costs.log (before and after its changes).
"""
import os
import sys
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from hf_fp8_attention import FP8AttentionConfig
from hf_fp8_attention.kernels.forward import triton_forward
from hf_fp8_attention.masking import MaskSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: backward_bench.py
import backward_bench  # noqa: E402

CFG = FP8AttentionConfig()
SM = torch.cuda.get_device_properties(0).multi_processor_count


def kernel_us(fn, runs=20) -> dict:
    """Mean GPU time per call (us) of each kernel fn launches, by kernel name."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        t = e.self_cuda_time_total if t is None else t
        if t > 0:
            times[e.key] = t / runs
    return times


def forward_us(b, h, sq, sk, causal, d=128) -> tuple[float, float]:
    """(attention kernel us, K/V quantization us) of one triton_forward call."""
    gen = torch.Generator(device="cuda").manual_seed(sq + sk)
    q = torch.randn(b, h, sq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(b, h, sk, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    mask = MaskSpec(causal=causal)
    t = kernel_us(lambda: triton_forward(q, k, v, scale=d**-0.5, mask=mask, config=CFG))
    return (sum(v for n, v in t.items() if "_fwd_kernel" in n), sum(v for n, v in t.items() if "_quantize" in n))


def main():
    print(f"{torch.cuda.get_device_name()}, {SM} SMs; forward launch pinned: "
          f"{os.environ.get('HF_FP8_ATTENTION_FWD_CONFIG', 'no (autotuned)')}", flush=True)
    print("== non-causal forward kernel, B=4 H=16: time per wave of 2*SM programs against key tiles per program")
    for sq in (1024, 4096):
        tiles, per_wave = [], []
        for sk in (128, 256, 512, 1024, 2048, 4096, 8192):
            kern, quant = forward_us(4, 16, sq, sk, False)
            programs = 4 * 16 * sq // 64
            waves = programs / (2 * SM)
            tiles.append(sk // 128)
            per_wave.append(kern / waves)
            print(f"  Sq={sq} Sk={sk}: kernel {kern:8.1f} us, quant {quant:6.1f} us, programs {programs}, "
                  f"us per wave {kern / waves:7.2f}", flush=True)
        (a, b), *_ = np.linalg.lstsq(np.vstack([np.ones(len(tiles)), tiles]).T, np.array(per_wave), rcond=None)
        print(f"  fit Sq={sq}: us per wave = {a:.2f} + {b:.3f} * tiles  (once per program: {a / b:.1f} tiles)",
              flush=True)
    print("== forward at 16k tokens, H=16")
    for s in (1024, 2048, 4096, 8192, 16384):
        b = 16384 // s
        for causal in (True, False):
            kern, quant = forward_us(b, 16, s, s, causal)
            print(f"  S={s} causal={causal}: kernel {kern:8.1f} us, K/V quantization {quant:6.1f} us", flush=True)
    print("== backward per launch")
    for s, b in ((1024, 16), (2048, 8), (8192, 2)):
        backward_bench.profile(s, b, 16, 128)


if __name__ == "__main__":
    main()
