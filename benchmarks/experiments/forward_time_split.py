"""EXPERIMENT (not used by the package): how the Triton forward's time splits between its MMAs and
its elementwise work, and what perfect overlap of the two could give.

Needs ``experiments/forward_time_split.diff`` applied to ``hf_fp8_attention/kernels/forward.py``
(it adds a ``mode`` argument to ``triton_forward``; mode 0 is the package's kernel). The launch is
pinned to (64 rows, 4 warps, 3 stages), the autotuner's choice at these shapes. Modes, each the
full loop minus something:

    0 full
    1 no QKᵀ MMA           logits taken from the accumulator (same MMA layout), P·V kept
    2 no P·V MMA           the accumulator update without its product; the P cast is dead code then
    3 MMAs only            P codes cast straight from the logits: no max, exp2, sums or rescaling
    4 no MMA, no P cast    one MMA before the loop only gives the accumulator its MMA layout

max(mode 3, mode 4) bounds any schedule that overlaps the MMAs with the elementwise work perfectly
(ninth session: results/h200_v14_forward_time_split.log, benchmarks/NOTES.md).

    git apply benchmarks/experiments/forward_time_split.diff
    python benchmarks/experiments/forward_time_split.py        # on a Hopper GPU
    python benchmarks/experiments/forward_time_split.py --l2   # modes 0 and 3 per launch shape, K/V bytes from L2

``--l2`` (results/h200_v14_forward_l2_probe.log) times modes 0 and 3 at B = 2, H = 16, S = 8192 for
several pinned launches and divides the K and Vᵀ code bytes the CTAs read (visited key tiles x
32 KB) by the time: whether streaming K/V from L2 could be what limits the forward.
"""
from __future__ import annotations

import inspect
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ["HF_FP8_ATTENTION_FWD_CONFIG"] = "64,4,3"

MODES = {0: "full", 1: "no QK MMA", 2: "no PV MMA, no P cast", 3: "MMAs only", 4: "no MMA, no P cast"}


def main() -> int:
    import torch
    from triton.testing import do_bench

    from hf_fp8_attention import FP8AttentionConfig
    from hf_fp8_attention.kernels.forward import triton_forward
    from hf_fp8_attention.masking import MaskSpec

    if "mode" not in inspect.signature(triton_forward).parameters:
        print("apply benchmarks/experiments/forward_time_split.diff first")
        return 2
    if not torch.cuda.is_available():
        print("needs a CUDA GPU with FP8 tensor cores")
        return 2
    cfg = FP8AttentionConfig()
    gen = torch.Generator(device="cuda").manual_seed(0)
    if "--l2" in sys.argv[1:]:
        return l2_probe(triton_forward, cfg, gen)
    for causal in (True, False):
        for s in (8192, 16384):
            b, h, d = 16384 // s, 16, 128
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
            mask = MaskSpec(causal=causal)
            ms: dict[int, float] = {}
            for _ in range(2):  # two rounds, best median of each mode
                for mode in MODES:
                    def run(mode=mode):
                        return triton_forward(q, k, v, scale=d**-0.5, mask=mask, config=cfg, mode=mode)
                    run()
                    ms[mode] = min(ms.get(mode, float("inf")), do_bench(run, warmup=25, rep=100, return_mode="median"))
            flops = 4 * b * h * s * s * d / (2 if causal else 1)
            print(f"causal={causal} S={s}: " + ", ".join(f"{MODES[m]} {ms[m]:.3f} ms ({ms[m] / ms[0]:.2f})" for m in MODES)
                  + f"; full {flops / ms[0] / 1e9:.0f} TFLOP/s, perfect-overlap bound max(MMAs only, no MMA) "
                  f"{flops / max(ms[3], ms[4]) / 1e9:.0f} TFLOP/s", flush=True)
    return 0


def l2_probe(triton_forward, cfg, gen) -> int:
    """Modes 0 and 3 per pinned launch; the K/V code bytes the CTAs stream from L2 per ms."""
    import torch
    from triton.testing import do_bench

    from hf_fp8_attention.masking import MaskSpec

    b, h, s, d = 2, 16, 8192, 128
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    for causal in (False, True):
        mask = MaskSpec(causal=causal)
        for launch in ("64,4,3", "64,4,2", "128,8,3", "128,8,2", "128,4,2"):
            os.environ["HF_FP8_ATTENTION_FWD_CONFIG"] = launch
            bm = int(launch.split(",")[0])
            # key tiles (128 keys, 16 KB of K codes + 16 KB of Vᵀ codes) visited per query tile
            tiles = sum(((qt + 1) * bm + 127) // 128 if causal else s // 128 for qt in range(s // bm))
            kv_bytes = tiles * b * h * 2 * 128 * 128
            out = []
            for mode in (0, 3):
                def run(mode=mode):
                    return triton_forward(q, k, v, scale=d**-0.5, mask=mask, config=cfg, mode=mode)
                run()
                ms = do_bench(run, warmup=25, rep=100, return_mode="median")
                out.append(f"mode {mode} {ms:.3f} ms, K/V from L2 {kv_bytes / ms / 1e9:.2f} TB/s")
            print(f"causal={causal} launch {launch}: K/V bytes {kv_bytes / 1e9:.2f} GB; " + "; ".join(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
