"""GPU timing of the FP8 quantization kernel against the memory bandwidth a plain copy reaches.

``python benchmarks/quantize_bench.py [--out DIR] [--sweep]``

Per shape ``(B, H, S, D)`` bf16 with B·S = 16384 tokens and per mode (row-wise copy: K in the
forward; channel-wise copy: V in the forward; both: Q, K, dO in the backward) it prints the kernel
time (``triton.testing.do_bench_cudagraph``: a CUDA graph, so the Python launch cost is not
counted, as when the GPU runs ahead of the host in training), the bytes the kernel must move
(read x once; write the codes and scales) per second, and that rate over the rate of
``torch.clone`` on the same tensor in the same run (read + write: a practical bandwidth ceiling).
``--sweep`` first times every (row_chunk, col_group, num_warps) in ``SWEEP`` per mode and keeps the
fastest in total (the three modes summed) in the head dim's table (``QUANT_LAUNCH``, at 256
``QUANT_LAUNCH_D256``: ``quantize.quant_launch``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform

import torch
import triton
from triton.testing import do_bench_cudagraph

from hf_fp8_attention.kernels.quantize import padded_head_dim, quant_launch, quantize_operand

MODES = {"row": (True, False), "col": (False, True), "row+col": (True, True)}
SWEEP = [(chunk, group, warps) for chunk in (16, 32, 64) for group in (16, 32, 64) for warps in (2, 4, 8)]
BLOCK = 128  # the recipe's token block (channel-wise tiles)


def _bytes_moved(x: torch.Tensor, row: bool, col: bool) -> int:
    """Compulsory traffic: x read once, each copy's fp8 codes and fp32 scales written once."""
    b, h, s, d = x.shape
    dp = padded_head_dim(d)
    moved = x.numel() * x.element_size()
    if row:
        moved += b * h * s * (dp + 4)
    if col:
        moved += b * h * dp * s + b * h * triton.cdiv(s, BLOCK) * dp * 4
    return moved


def _time_us(fn, rep=100) -> float:
    return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


def _quant_fn(x, row, col):
    return lambda: quantize_operand(x, row=row, col=col, block=BLOCK)


def sweep(x: torch.Tensor) -> dict:
    """Time every launch of SWEEP per mode on x; set x's launch table to the fastest in total."""
    table = quant_launch(False, padded_head_dim(x.shape[-1]))
    saved = dict(table)
    totals = {}
    print(f"sweep on {tuple(x.shape)} (us per call):")
    try:
        for chunk, group, warps in SWEEP:
            table.update(row_chunk=chunk, col_group=group, num_warps=warps)
            times = {mode: _time_us(_quant_fn(x, *flags), rep=40) for mode, flags in MODES.items()}
            totals[(chunk, group, warps)] = sum(times.values())
            print(f"  row_chunk={chunk:3d} col_group={group:3d} warps={warps}  "
                  + "  ".join(f"{m} {t:7.1f}" for m, t in times.items())
                  + f"  total {totals[(chunk, group, warps)]:7.1f}", flush=True)
    finally:
        table.update(saved)
    best = dict(zip(("row_chunk", "col_group", "num_warps"), min(totals, key=totals.get)))
    table.update(best)
    print(f"fastest: {best}")
    return best


def run(seqs, heads, head_dim, tokens, out_dir, do_sweep):
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version()}
    print(" · ".join(f"{k} {v}" for k, v in env.items()))
    gen = torch.Generator(device="cuda").manual_seed(0)
    if do_sweep:
        x = torch.randn(tokens // 8192, heads, 8192, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        env["sweep_best"] = sweep(x)
    launch = quant_launch(False, padded_head_dim(head_dim))
    env["launch"] = dict(launch)
    rows = []
    header = "| S | B | mode | us | TB/s | clone TB/s | x clone |"
    lines = [f"launch {launch}, H={heads}, D={head_dim}, bf16, {tokens} tokens per batch", "", header,
             "|---|---|---|---|---|---|---|"]
    for s in seqs:
        b = max(tokens // s, 1)
        x = torch.randn(b, heads, s, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        clone_us = _time_us(lambda: x.clone())
        clone_tbs = 2 * x.numel() * x.element_size() / clone_us / 1e6
        for mode, (row, col) in MODES.items():
            us = _time_us(_quant_fn(x, row, col))
            tbs = _bytes_moved(x, row, col) / us / 1e6
            rows.append({"S": s, "B": b, "mode": mode, "us": us, "tbs": tbs, "clone_tbs": clone_tbs})
            lines.append(f"| {s} | {b} | {mode} | {us:.1f} | {tbs:.2f} | {clone_tbs:.2f} | {tbs / clone_tbs:.2f} |")
    text = "\n".join(lines)
    print(text, flush=True)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "quantize_bench.md"), "w") as f:
            f.write(" · ".join(f"{k} {v}" for k, v in env.items()) + "\n\n" + text + "\n")
        with open(os.path.join(out_dir, "quantize_bench.json"), "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="4096,8192,16384")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per batch (B = tokens // S)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--sweep", action="store_true",
                    help="first sweep the launch (row_chunk, col_group, num_warps) and keep the fastest")
    a = ap.parse_args()
    run([int(x) for x in a.seqs.split(",")], a.heads, a.head_dim, a.tokens, a.out, a.sweep)
