"""How many bytes can a few SMs move while the persistent Gluon forward computes on the others?

The fast recipe's forward at 2 x 8k causal (H = 16, d = 128) spends ~187 µs on its preparation (Q,
K and V's statistics, then K and V's FP8 copies, ~400 MB on all SMs) before a ~660 µs attention
kernel. A design that runs the preparation beside the kernel, on R SMs the persistent kernel leaves
free, with the kernel waiting per (sequence, head) for its operands, needs those R SMs to move the
preparation's bytes within the kernel's time. This script prices it before anything is built:

1. *alone*: a persistent streaming kernel on R programs reads a bf16 tensor (the statistics' pass:
   an amax) or reads it and writes FP8 codes (the copies' pass), for several R; GB/s in all and per
   program;
2. *beside the kernel*: the forward's own Gluon launch (its arguments captured from one
   ``triton_forward`` call) on SMs - R programs and, on a second stream of the same CUDA graph, the
   preparation's bytes (one read-only pass over Q, K, V's size, one read-and-write pass over K, V's)
   on R programs: the pair's time against each alone.

Times are CUDA-graph medians (``triton.testing.do_bench_cudagraph``). Nothing here changes a value
the package computes.

    python benchmarks/experiments/sm_bandwidth.py --reserve 4,8,16 --seq 8192 --batch 2
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_fp8_attention.kernels import forward, forward_gluon  # noqa: E402
from hf_fp8_attention.kernels.tiles import sm_count  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from prep_overlap import reserved_sms  # noqa: E402
from recipe_names import recipe_config  # noqa: E402

ROWS, D = 64, 128  # one program's tile of the streamed tensor: (ROWS, D) bf16, 16 KB


@triton.jit
def _stream_kernel(x_ptr, out_ptr, amax_ptr, n_tiles, ROWS: tl.constexpr, D: tl.constexpr, WRITE: tl.constexpr,
                   STAGES: tl.constexpr):
    """Program p of R visits tiles p, p + R, ...: the running amax of x (ROWS, D) tiles and, with
    WRITE, their FP8 codes (x / 2) to out. Writes its amax to amax_ptr[p]."""
    pid = tl.program_id(0)
    offs = tl.arange(0, ROWS)[:, None] * D + tl.arange(0, D)[None, :]
    acc = tl.zeros((ROWS, D), tl.float32)
    for t in tl.range(pid, n_tiles, tl.num_programs(0), num_stages=STAGES):
        x = tl.load(x_ptr + t * (ROWS * D) + offs).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
        if WRITE:
            tl.store(out_ptr + t * (ROWS * D) + offs, (x * 0.5).to(tl.float8e4nv))
    tl.store(amax_ptr + pid, tl.max(tl.max(acc, 1), 0))


def stream(x: torch.Tensor, out: torch.Tensor | None, programs: int, warps: int, stages: int) -> torch.Tensor:
    """Launch :func:`_stream_kernel` on ``programs`` programs over ``x`` (n, D) bf16; returns the
    per-program amax (programs,) fp32."""
    n_tiles = x.numel() // (ROWS * D)
    amax = torch.empty(programs, device=x.device, dtype=torch.float32)
    _stream_kernel[(programs,)](x, out if out is not None else x, amax, n_tiles, ROWS=ROWS, D=D,
                                WRITE=out is not None, STAGES=stages, num_warps=warps)
    return amax


def captured_gluon_call(q, k, v, kw):
    """The (args, kwargs) of the Gluon kernel's call inside one ``triton_forward`` (its operands kept
    alive by the returned tuple), so that the attention launch can be replayed alone."""
    seen = {}
    original = forward_gluon.gluon_forward

    def record(*args, **kwargs):
        seen["call"] = (args, kwargs)
        return original(*args, **kwargs)

    forward_gluon.gluon_forward = record
    try:
        forward.triton_forward(q, k, v, **kw)
    finally:
        forward_gluon.gluon_forward = original
    if "call" not in seen:
        raise SystemExit("the forward did not run the Gluon kernel at this shape and recipe")
    return seen["call"]


def graph_us(fn, rep: int) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=rep) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reserve", default="4,8,16", help="SMs left to the streaming kernel")
    p.add_argument("--alone", default="4,8,16,32,132", help="program counts of the streaming kernel alone")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--recipe", default="fp8_delta_fast")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--causal", type=int, default=1)
    p.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph's rep, ms")
    args = p.parse_args()
    dev = torch.device("cuda")
    sms = sm_count(dev.index)
    b, h, s = args.batch, args.heads, args.seq
    print(f"{torch.cuda.get_device_name()} · {sms} SMs · torch {torch.__version__} · triton {triton.__version__} · "
          f"B={b} H={h} S={s} d={D} · {args.recipe} · causal={bool(args.causal)}")
    qkv = torch.randn(3 * b * h * s, D, device=dev, dtype=torch.bfloat16)  # the statistics' pass
    kv = qkv[: 2 * b * h * s]  # the copies' pass reads K, V again
    codes = torch.empty(kv.shape, device=dev, dtype=torch.float8_e4m3fn)

    print("\n## Streaming alone\n\n| programs | warps | pass | MB | µs | GB/s | GB/s a program |\n"
          "|---|---|---|---|---|---|---|")
    for warps in (int(w) for w in args.warps.split(",")):
        for programs in (int(r) for r in args.alone.split(",")):
            for name, x, out in (("read", qkv, None), ("read+write", kv, codes)):
                moved = x.numel() * 2 + (out.numel() if out is not None else 0)
                t = graph_us(lambda: stream(x, out, programs, warps, args.stages), args.rep)
                print(f"| {programs} | {warps} | {name} | {moved / 1e6:.0f} | {t:.1f} | {moved / t / 1e3:.0f} | "
                      f"{moved / t / 1e3 / programs:.1f} |", flush=True)

    q, k, v = (x.view(b, h, s, D) for x in torch.randn(3, b * h * s, D, device=dev, dtype=torch.bfloat16))
    kw = dict(scale=D ** -0.5, mask=MaskSpec(causal=bool(args.causal)), config=recipe_config(args.recipe))
    call_args, call_kw = captured_gluon_call(q, k, v, kw)
    side = torch.cuda.Stream()
    warps = int(args.warps.split(",")[-1])
    t_forward = graph_us(lambda: forward.triton_forward(q, k, v, **kw), args.rep)
    t_full = graph_us(lambda: forward_gluon.gluon_forward(*call_args, **call_kw), args.rep)
    print(f"\n## Beside the attention kernel\n\nwhole forward (preparation + kernel, all SMs) {t_forward:.1f} µs; "
          f"the Gluon kernel alone on {sms} programs {t_full:.1f} µs\n")
    print("| reserved SMs | kernel alone µs | preparation's bytes alone µs | both µs | both − kernel alone µs | "
          "x whole forward |\n|---|---|---|---|---|---|")
    for reserve in (int(r) for r in args.reserve.split(",")):
        def kernel():
            undo = reserved_sms(reserve)
            try:
                forward_gluon.gluon_forward(*call_args, **call_kw)
            finally:
                undo()

        def prep():
            stream(qkv, None, reserve, warps, args.stages)
            stream(kv, codes, reserve, warps, args.stages)

        def both():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                prep()
            kernel()
            torch.cuda.current_stream().wait_stream(side)

        t_kernel, t_prep, t_both = (graph_us(fn, args.rep) for fn in (kernel, prep, both))
        print(f"| {reserve} | {t_kernel:.1f} | {t_prep:.1f} | {t_both:.1f} | {t_both - t_kernel:+.1f} | "
              f"{t_forward / t_both:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
