"""How much of the forward the K/V quantization launch takes, and that launch (K row-wise and V
channel-wise in one launch, as ``triton_forward`` runs it) against two single launches.

``PYTHONPATH=. python benchmarks/experiments/forward_quant_share.py`` on a GPU; H = 16, d = 128,
16k tokens per batch, CUDA-graph timing (no host cost). v15 kernels: results/h200_v15_forward_quant_share.log.
"""
import torch
from triton.testing import do_bench_cudagraph
from hf_fp8_attention import FP8AttentionConfig
from hf_fp8_attention.kernels.forward import triton_forward
from hf_fp8_attention.kernels.quantize import Copies, quantize_operands
from hf_fp8_attention.masking import MaskSpec

cfg = FP8AttentionConfig()
for s in (4096, 8192, 16384):
    b, h, d = 16384 // s, 16, 128
    gen = torch.Generator(device="cuda").manual_seed(s)
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    cp = (Copies(row=True, col=False, fmt=cfg.k_format), Copies(row=False, col=True, fmt=cfg.v_format))
    pair = lambda: quantize_operands((k, v), cp, block=cfg.block_k, pow2=cfg.pow2_scales)  # noqa: E731
    def singles():
        quantize_operands((k,), cp[:1], block=cfg.block_k, pow2=cfg.pow2_scales)
        quantize_operands((v,), cp[1:], block=cfg.block_k, pow2=cfg.pow2_scales)
    t_pair = do_bench_cudagraph(pair, rep=200) * 1e3
    t_single = do_bench_cudagraph(singles, rep=200) * 1e3
    for causal in (True, False):
        mask = MaskSpec(causal=causal)
        fwd = lambda: triton_forward(q, k, v, scale=d**-0.5, mask=mask, config=cfg)  # noqa: E731
        fwd()
        t_fwd = do_bench_cudagraph(fwd, rep=200) * 1e3
        print(f"S={s} causal={causal}: forward {t_fwd:.1f} us, K/V quantization pair launch {t_pair:.1f} us "
              f"({t_pair / t_fwd:.1%}), two single launches {t_single:.1f} us", flush=True)
