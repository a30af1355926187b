"""The forward's GPU time with Q's codes made by the Gluon forward itself and by a quantization
launch before it (``kernels.forward_gluon.QUANTIZE_Q`` on / off), in alternating rounds of one
process, beside SDPA cuDNN's bf16 forward; every time by CUDA graph (``triton.testing.do_bench_cudagraph``:
the GPU's time, no host launch cost, which moves whole-op timings by more than this change).

    python benchmarks/quantize_q_ab.py --seqlens 8192,16384 --rounds 3 --out-dir results --tag h100_quantize_q_ab

Shapes: ``--tokens`` per batch (B = tokens // S), H heads, head dim 128, bf16, causal and not. Before
timing, each recipe's outputs with the switch on and off are compared bit for bit (the kernel's codes
are the launch's). Writes ``TAG.md`` and ``TAG.json``.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_fp8_attention.kernels import forward, forward_gluon  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from quantize_bench import _time_us as _graph_time_us  # noqa: E402  (CUDA-graph median, us)
from recipe_names import recipe_config  # noqa: E402  (benchmarks/ is on the path as the script's folder)


def _time_us(fn, rep: int) -> float:
    fn()  # compiles, autotunes and builds the cached Hadamard matrix outside the capture
    torch.cuda.synchronize()
    return _graph_time_us(fn, rep=rep)


def _switched(on: bool, fn):
    def run():
        forward_gluon.QUANTIZE_Q = on
        return fn()
    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", default="8192,16384")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--configs", default="fp8_delta,fp8_delta_fast")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph repetitions, ms")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--tag", default="quantize_q_ab")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    default = forward_gluon.QUANTIZE_Q
    d = 128
    rows = []
    gpu = torch.cuda.get_device_name()
    head = (f"{gpu} · torch {torch.__version__} · triton {triton.__version__} · "
            f"python {platform.python_version()} · {args.tokens} tokens per batch, H = {args.heads}, d = {d}, "
            f"bf16 · CUDA-graph medians, {args.rounds} rounds alternating on / off")
    print(head, flush=True)
    try:
        for s in map(int, args.seqlens.split(",")):
            b = max(args.tokens // s, 1)
            for causal in (True, False):
                g = torch.Generator(device="cuda").manual_seed(s + causal)
                q, k, v = (torch.randn(b, args.heads, s, d, device="cuda", generator=g, dtype=torch.bfloat16)
                           for _ in range(3))
                flop = 4.0 * b * args.heads * s * s * d * (0.5 if causal else 1.0)
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    cudnn_us = _time_us(lambda: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=causal), args.rep)
                for name in args.configs.split(","):
                    config = recipe_config(name)

                    def fwd():
                        return forward.triton_forward(q, k, v, scale=d**-0.5, mask=MaskSpec(causal=causal),
                                                      config=config)
                    on, off = _switched(True, fwd)(), _switched(False, fwd)()
                    same = all(torch.equal(a, c) for a, c in zip(on, off))
                    times = {True: [], False: []}
                    for _ in range(args.rounds):
                        for switch in (True, False):
                            times[switch].append(_time_us(_switched(switch, fwd), args.rep))
                    t_on, t_off = statistics.median(times[True]), statistics.median(times[False])
                    row = dict(S=s, B=b, causal=causal, recipe=name, on_us=times[True], off_us=times[False],
                               cudnn_us=cudnn_us, same_bits=same, on_over_off=t_on / t_off,
                               x_cudnn_on=cudnn_us / t_on, x_cudnn_off=cudnn_us / t_off,
                               tflops_on=flop / t_on / 1e6, tflops_off=flop / t_off / 1e6)
                    rows.append(row)
                    print(f"S={s} causal={causal} {name}: on {t_on:.1f} us, off {t_off:.1f} us "
                          f"({t_on / t_off:.3f}x), cuDNN {cudnn_us:.1f} us: x cudnn {cudnn_us / t_on:.3f} "
                          f"(off {cudnn_us / t_off:.3f}); same bits: {same}", flush=True)
    finally:
        forward_gluon.QUANTIZE_Q = default
    lines = [f"# In-kernel Q quantization of the Gluon forward, on / off — {gpu}", "", head, "",
             "| S | B | causal | recipe | on µs | off µs | on / off | cuDNN µs | x cuDNN on | x cuDNN off "
             "| same bits |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['S']} | {r['B']} | {r['causal']} | {r['recipe']} | "
                     f"{statistics.median(r['on_us']):.1f} | "
                     f"{statistics.median(r['off_us']):.1f} | {r['on_over_off']:.3f} | {r['cudnn_us']:.1f} | "
                     f"{r['x_cudnn_on']:.3f} | {r['x_cudnn_off']:.3f} | {r['same_bits']} |")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.tag}.md").write_text("\n".join(lines) + "\n")
    (args.out_dir / f"{args.tag}.json").write_text(json.dumps(dict(header=head, rows=rows), indent=1))
    return 0 if all(r["same_bits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
