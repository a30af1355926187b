"""Extreme inputs through the Triton kernels (CUDA), beside SDPA: the cases behind the hardening work.

1. q = k = a·1 (head dim 64), v = 1, causal, a = 100 / 1000 / 3000 (logits 8e4 / 8e6 / 7e7): the
   exact output is 1 everywhere. Printed: the range of the forward's outputs.
2. q = k = v = 6e4 in fp16, causal (logits 2.9e10): the output is 6e4. Printed: how many outputs are
   not finite, and the largest |out − 6e4|.
3. Queries that see a single key (length-1 sequences, dense and packed): P = 1, so dS = 0 and the
   exact dQ and dK are 0. Printed: max |dQ| and max |dK| over the scale of a gradient of that size
   (τ · max|dP| · max|K|, resp. · max|Q|), with the kernels' FP fusion on and off (off: no FMA
   contraction anywhere, which tells a fused multiply-add's residual from any other source).

Recipes without K-smoothing see the huge logits of 1-2 (smoothing subtracts the keys' mean, which
is every key here, and leaves logits of 0), so 1-2 run the tile recipe and fp8_delta with the
transforms off. Run the same script against another checkout with ``PYTHONPATH=<checkout>``.

    python benchmarks/experiments/extreme_inputs.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_fp8_attention import RECIPES, fp8_attention
from hf_fp8_attention.kernels import quantize

LARGE_LOGIT_CONFIGS = {
    "fp8_delta_tile": RECIPES["fp8_delta_tile"],
    "fp8_delta (no transforms)": RECIPES["fp8_delta"].replace(smooth_k=False, hadamard=False),
    "fp8_delta_fast (no transforms)": RECIPES["fp8_delta_fast"].replace(smooth_k=False, hadamard=False),
}
SINGLE_KEY_RECIPES = ("fp8_delta", "fp8_stale", "fp8_delta_fast", "fp8_delta_tile", "hybrid_delta")


def _triton(config):
    return config.replace(backend="triton")


def large_logits() -> None:
    print("1. q = k = a·1 (d 64), v = 1, causal: exact output 1")
    for a in (100.0, 1000.0, 3000.0):
        q = torch.full((1, 2, 300, 64), a, device="cuda")
        v = torch.ones_like(q)
        sdpa = F.scaled_dot_product_attention(q, q, v, is_causal=True)
        print(f"  a={a:6.0f}  sdpa fp32 [{sdpa.min().item():.6f}, {sdpa.max().item():.6f}]")
        for name, config in LARGE_LOGIT_CONFIGS.items():
            out = fp8_attention(q, q, v, causal=True, config=_triton(config))
            print(f"  a={a:6.0f}  {name:32s} [{out.min().item():.6f}, {out.max().item():.6f}]")


def fp16_top_of_range() -> None:
    print("2. q = k = v = 6e4 fp16, causal: exact output 6e4")
    x = torch.full((1, 2, 256, 64), 6e4, dtype=torch.float16, device="cuda")
    sdpa = F.scaled_dot_product_attention(x, x, x, is_causal=True)
    print(f"  sdpa: non-finite {(~torch.isfinite(sdpa)).sum().item()} of {sdpa.numel()}")
    for name, config in {**LARGE_LOGIT_CONFIGS, "fp8_delta": RECIPES["fp8_delta"]}.items():
        out = fp8_attention(x, x, x, causal=True, config=_triton(config))
        bad = (~torch.isfinite(out)).sum().item()
        err = (out.float() - 6e4).abs().nan_to_num(float("inf")).max().item()
        print(f"  {name:32s} non-finite {bad} of {out.numel()}, max |out - 6e4| {err:.3g}")


def _single_key_problems():
    """(label, q, k, v, kwargs): every query sees exactly one key."""
    g = torch.Generator(device="cuda").manual_seed(0)
    dense = [torch.randn(2, 4, 1, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3)]
    n = 300  # 300 packed sequences of one token each
    packed = [torch.randn(1, 4, n, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3)]
    cu = torch.arange(n + 1, dtype=torch.int32, device="cuda")
    return [("dense Sq=Sk=1", *dense, {}),
            ("packed 300 x 1 token", *packed, {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "causal": True})]


def single_key() -> None:
    print("3. every query sees one key: exact dQ = dK = 0 (ratios to the scale of such a gradient)")
    for label, q, k, v, kwargs in _single_key_problems():
        dout = torch.randn_like(q)
        scale = q.shape[-1] ** -0.5
        dp_max = (dout.float().abs().sum(-1).max() * v.float().abs().max()).item()  # bound on |dP|
        for name in SINGLE_KEY_RECIPES:
            row = []
            for fusion in (True, False):
                quantize.COMPILE_OPTIONS["enable_fp_fusion"] = fusion
                qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
                out = fp8_attention(qq, kk, vv, config=_triton(RECIPES[name]), **kwargs)
                dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), dout)
                rq = dq.float().abs().max().item() / (scale * dp_max * k.float().abs().max().item())
                rk = dk.float().abs().max().item() / (scale * dp_max * q.float().abs().max().item())
                row.append(f"fusion {'on ' if fusion else 'off'}: dq {rq:.2e} dk {rk:.2e} "
                           f"(zero: {not dq.any()}/{not dk.any()})")
            quantize.COMPILE_OPTIONS["enable_fp_fusion"] = True
            print(f"  {label:22s} {name:15s} " + " | ".join(row))


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("extreme_inputs.py needs a CUDA GPU (the Triton kernels)")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    large_logits()
    fp16_top_of_range()
    single_key()


if __name__ == "__main__":
    main()
