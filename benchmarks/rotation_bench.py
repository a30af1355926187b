"""Launch shapes of the rotated (Hadamard) copies: the quantization kernel's rotated row-wise copy
and the statistics kernel's rotated extremes, each against the same launch without rotation.

    python benchmarks/rotation_bench.py --seq 8192 --batch 2 --heads 16 --dim 128

Prints microseconds per launch (median of triton.testing.do_bench) for every (tokens per dot,
warps) in SHAPES, so ``quantize.ROTATED_LAUNCH`` and ``sequence_stats.ROTATED_PARTIALS`` (at head
dim 256 their ``_D256`` twins, which the runs below change) can be set to the fastest.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_fp8_attention.kernels import quantize, sequence_stats  # noqa: E402
from hf_fp8_attention.kernels.quantize import Copies, quantize_operands  # noqa: E402
from hf_fp8_attention.kernels.sequence_stats import StatsNeed  # noqa: E402

SHAPES = ((128, 8), (64, 4), (64, 8), (32, 4), (32, 2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    a = p.parse_args()
    x = torch.randn(a.batch, a.heads, a.seq, a.dim, device="cuda", dtype=torch.bfloat16)
    gb = x.numel() * x.element_size() / 1e9
    print(f"{torch.cuda.get_device_name()} · triton {triton.__version__} · x {tuple(x.shape)} bf16 ({gb:.3f} GB)")

    def us(fn) -> float:
        return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100)

    plain = us(lambda: quantize_operands((x,), (Copies(True, False),), block=128))
    print(f"quantize row copy, no rotation: {plain:7.1f} us ({gb / plain * 1e3:.2f} TB/s read)")
    rotated = quantize.quant_launch(True, quantize.padded_head_dim(a.dim))
    saved = dict(rotated)
    for chunk, warps in SHAPES:
        rotated.update(row_chunk=chunk, num_warps=warps)
        t = us(lambda: quantize_operands((x,), (Copies(True, False, rotate=True),), block=128))
        print(f"quantize row copy, rotated, {chunk:>3} tokens per dot, {warps} warps: {t:7.1f} us")
    rotated.update(saved)

    # The forward's K/V launch: K's rotated row-wise copy beside V's channel-wise copy, which then
    # runs on the rotated launch's warps.
    pair = (Copies(True, False, rotate=True), Copies(False, True))
    plain = us(lambda: quantize_operands((x, x), (Copies(True, False), Copies(False, True)), block=128))
    print(f"K rows + V columns, no rotation: {plain:7.1f} us")
    for group in (16, 32, 64):
        rotated.update(col_group=group)
        t = us(lambda: quantize_operands((x, x), pair, block=128))
        print(f"K rows rotated + V columns, {group:>2} channels per group: {t:7.1f} us")
    rotated.update(saved)
    split = us(lambda: (quantize_operands((x,), pair[:1], block=128), quantize_operands((x,), pair[1:], block=128)))
    print(f"K rows rotated, V columns, two launches: {split:7.1f} us")

    for need in (StatsNeed(smooth=True, row_amax=True), StatsNeed(row_amax=True), StatsNeed(col_amax=True)):
        plain = us(lambda: sequence_stats.sequence_stats((x,), (need,)))
        print(f"statistics, no rotation, {need}: {plain:7.1f} us")
    partials = sequence_stats.ROTATED_PARTIALS_D256 if a.dim > 128 else sequence_stats.ROTATED_PARTIALS
    saved = dict(partials)
    for sub, warps in SHAPES:
        partials.update(sub=sub, num_warps=warps)
        for need in (StatsNeed(rotate=True, smooth=True, row_amax=True), StatsNeed(rotate=True, row_amax=True)):
            t = us(lambda: sequence_stats.sequence_stats((x,), (need,)))
            print(f"statistics, rotated, {sub:>3} tokens per dot, {warps} warps, smooth={need.smooth}: {t:7.1f} us")
    partials.update(saved)


if __name__ == "__main__":
    main()
