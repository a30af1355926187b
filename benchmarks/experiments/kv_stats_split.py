"""GPU time of the forward's K/V statistics launch, the pair as the forward runs it against K and V
each alone, under variants of ``sequence_stats.ROTATED_PARTIALS``: which operand the launch waits on,
and whether two launches (K on the rotating table, V on the plain 4-warp one) would beat one.

    python benchmarks/experiments/kv_stats_split.py

Shape: (2, 16, 8192, 128) bf16, Gaussian; statistics as ``fp8_delta`` and ``fp8_delta_fast`` ask them
(K: rotated, smoothed extremes, mean and channel amax; V: amax and channel amax), with the backward's
statistics computed beside them as the forward does. K alone takes the rotating table; V alone (no
rotation) the 4-warp unrotated launch. CUDA-graph medians (``triton.testing.do_bench_cudagraph``).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_fp8_attention.kernels import sequence_stats as ss  # noqa: E402
from hf_fp8_attention.kernels.operands import backward_kv_copies, copies_for, operand_needs  # noqa: E402
from quantize_bench import _time_us  # noqa: E402
from recipe_names import recipe_config  # noqa: E402

# (label, ROTATED_PARTIALS entries over the default)
VARIANTS = (("default", {}), ("sub16", {"sub": 16}), ("sub16+ew", {"sub": 16, "elementwise_smoothed": True}),
            ("ew", {"elementwise_smoothed": True}), ("4 warps sub64", {"sub": 64, "num_warps": 4}))


def main():
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · shape (2, 16, 8192, 128) bf16")
    base = dict(ss.ROTATED_PARTIALS)
    for recipe in ("fp8_delta", "fp8_delta_fast"):
        cfg = recipe_config(recipe)
        k, v = (torch.randn(2, 16, 8192, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kc, vc = copies_for("k", cfg, row=True, col=False), copies_for("v", cfg, row=False, col=True)
        nk, nv = operand_needs((kc, vc), backward_kv_copies(cfg))
        print(recipe, "K needs", nk, "V needs", nv)
        try:
            for label, entries in VARIANTS:
                ss.ROTATED_PARTIALS = {**base, **entries}
                t_pair = _time_us(lambda: ss.sequence_stats((k, v), (nk, nv)), rep=50)
                t_k = _time_us(lambda: ss.sequence_stats((k,), (nk,)), rep=50)
                t_v = _time_us(lambda: ss.sequence_stats((v,), (nv,)), rep=50)
                print(f"  {recipe:15s} {label:14s} pair {t_pair:6.1f} us  K alone {t_k:6.1f}  V alone {t_v:6.1f}",
                      flush=True)
        finally:
            ss.ROTATED_PARTIALS = base


if __name__ == "__main__":
    main()
