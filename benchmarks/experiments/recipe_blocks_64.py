"""fp8_delta with 64-token recipe blocks (block_q = block_k = 64) against the default 128: accuracy
against float64 (B = 1, H = 4, S = 2048), then speed (fwd and fwd+bwd, 16k tokens, H = 16, d = 128,
the two configs alternating, two rounds). Measured: results/h200_v18_blocks64.log.

    PYTHONPATH=. python benchmarks/experiments/recipe_blocks_64.py
"""
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_attention as ba  # noqa: E402  (puts the repository on sys.path)
from hf_fp8_attention import FP8AttentionConfig, fp8_attention  # noqa: E402

CONFIGS = {"b128": FP8AttentionConfig(), "b64": FP8AttentionConfig(block_q=64, block_k=64)}
D, H = 128, 16


def accuracy() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for causal in (True, False):
        q, k, v, do = (torch.randn(1, 4, 2048, D, device="cuda", dtype=torch.bfloat16, generator=gen)
                       for _ in range(4))
        qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
        ref = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal)
        ref.backward(do.double())
        for name, cfg in CONFIGS.items():
            qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
            out = fp8_attention(qg, kg, vg, causal=causal, config=cfg)
            out.backward(do)
            pairs = ((out, ref), (qg.grad, qd.grad), (kg.grad, kd.grad), (vg.grad, vd.grad))
            errs = [((a.double() - b).norm() / b.norm()).item() for a, b in pairs]
            print(f"accuracy causal={causal} {name}: rel err O {errs[0]:.3e} dQ {errs[1]:.3e} "
                  f"dK {errs[2]:.3e} dV {errs[3]:.3e}", flush=True)


def speed() -> None:
    for s in (2048, 4096, 8192, 16384):
        b = 16384 // s
        gen = torch.Generator(device="cuda").manual_seed(s)
        q, k, v = (torch.randn(b, H, s, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        for causal in (True, False):
            f, fb = (ba.flops(mode, b, H, s, D, causal) for mode in ("fwd", "fwdbwd"))
            for r in range(2):
                for name in (("b128", "b64") if r == 0 else ("b64", "b128")):
                    def impl(q, k, v, cfg=CONFIGS[name], causal=causal):
                        return fp8_attention(q, k, v, causal=causal, config=cfg)
                    fwd = ba._time(impl, "fwd", q, k, v, 25, 100)
                    fwdbwd = ba._time(impl, "fwdbwd", q, k, v, 25, 100)
                    print(f"S={s} causal={causal} round {r} {name}: fwd {fwd:.4f} ms {f / fwd / 1e9:.0f} TFLOP/s, "
                          f"fwd+bwd {fwdbwd:.4f} ms {fb / fwdbwd / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    accuracy()
    speed()
