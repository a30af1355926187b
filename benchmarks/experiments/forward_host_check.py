"""Is the public forward host-bound at short sequences? (v17 kernels, `results/h200_v17_host_check.log`)

Per shape (16k tokens, H = 16, d = 128, causal and not), three rounds of: the do_bench median of
``fp8_attention`` under no_grad, the same of ``triton_forward`` called directly, and the host issue
time per ``fp8_attention`` call (20 calls, the GPU not awaited). When the issue time nears the kernel
time, the GPU waits for the host and a forward-only timing measures the host.

    HF_FP8_ATTENTION_FWD_CONFIG=64,4,3 PYTHONPATH=. python benchmarks/experiments/forward_host_check.py
"""
import time

import torch
from triton.testing import do_bench

from hf_fp8_attention import FP8AttentionConfig, fp8_attention
from hf_fp8_attention.kernels.forward import triton_forward
from hf_fp8_attention.masking import MaskSpec

CALLS = 20


def main() -> None:
    cfg, d, h = FP8AttentionConfig(), 128, 16
    for s in (1024, 2048, 4096):
        b = 16384 // s
        q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (True, False):
            mask = MaskSpec(causal=causal)

            def public():
                return fp8_attention(q, k, v, causal=causal, config=cfg)

            def kernel():
                return triton_forward(q, k, v, scale=d**-0.5, mask=mask, config=cfg)

            with torch.no_grad():
                for r in range(3):
                    pub_ms = do_bench(public, warmup=25, rep=100, return_mode="median")
                    ker_ms = do_bench(kernel, warmup=25, rep=100, return_mode="median")
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(CALLS):
                        public()
                    host_ms = (time.perf_counter() - t0) / CALLS * 1e3
                    torch.cuda.synchronize()
                    print(f"S={s} causal={causal} round {r}: fp8_attention {pub_ms:.4f} ms, triton_forward "
                          f"{ker_ms:.4f} ms, host issue per fp8_attention call {host_ms:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
