"""The attention op's GPU time with kernel switches on and off, in alternating rounds of one process,
beside SDPA cuDNN's bf16 op; every time by CUDA graph (``triton.testing.do_bench_cudagraph``: the
GPU's time, no host launch cost, which moves whole-op timings by more than these changes).

``--switch``: booleans of the package's kernel modules flipped together (``module.NAME``, joined by
``+``), e.g. ``forward_gluon.QUANTIZE_Q`` (Q's codes made by the Gluon forward or by a quantization
launch), ``forward_gluon.PERSISTENT`` (the persistent forward), or
``backward_dq_gluon.PERSISTENT+backward_stats_gluon.PERSISTENT``; ``--set`` fixes others for both
arms; ``--op`` times the forward, the backward (from the forward's O and LSE) or both, the kernels'
entry points called as they are; ``fwdbwd_saved``: both as autograd runs them (``ops.run_forward`` /
``run_backward``), what the forward computes for the backward handed over (statistics, and with
``forward.HAND_OVER_KV_COPIES`` K's and V's copies).

    python benchmarks/switch_ab.py --switch forward_gluon.QUANTIZE_Q --seqlens 8192,16384 --tag h100_quantize_q_ab
    python benchmarks/switch_ab.py --switch forward_gluon.PERSISTENT --set forward_gluon.QUANTIZE_Q_NONCAUSAL=1
    python benchmarks/switch_ab.py --op bwd --switch backward_dq_gluon.PERSISTENT+backward_stats_gluon.PERSISTENT

Shapes: ``--tokens`` per batch (B = tokens // S), H heads, head dim ``--dim`` (128; 64 times the Triton
kernels, e.g. ``--dim 64 --switch forward.P_IN_PLACE_TRITON``), bf16, causal and not. Before
timing, each recipe's outputs with the switches on and off are compared bit for bit (the switches
change speed only). Writes ``TAG.md`` and ``TAG.json``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import platform
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_fp8_attention import ops  # noqa: E402
from hf_fp8_attention.kernels import backward, forward  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from quantize_bench import _time_us as _graph_time_us  # noqa: E402  (CUDA-graph median, us)
from recipe_names import recipe_config  # noqa: E402  (benchmarks/ is on the path as the script's folder)

OPS = ("fwd", "bwd", "fwdbwd", "fwdbwd_saved")


def _time_us(fn, rep: int) -> float:
    fn()  # compiles, autotunes and builds the cached operands outside the capture
    torch.cuda.synchronize()
    return _graph_time_us(fn, rep=rep)


def _switch(name: str) -> tuple[object, str]:
    """(module, attribute) of ``module.NAME``, a boolean of a module of hf_fp8_attention.kernels."""
    mod_name, _, attr = name.partition(".")
    try:
        module = importlib.import_module(f"hf_fp8_attention.kernels.{mod_name}")
    except ImportError:
        module = None
    if module is None or not isinstance(getattr(module, attr, None), bool):
        raise SystemExit(f"{name!r} is not module.NAME for a boolean of a module of hf_fp8_attention.kernels")
    return module, attr


def switches(text: str) -> list[tuple[object, str]]:
    """``--switch``'s "module.NAME+module.NAME..." as [(module, attribute)]."""
    return [_switch(name) for name in text.split("+")]


def fixed(text: str) -> dict[tuple[object, str], bool]:
    """``--set``'s "module.NAME=0|1,..." as {(module, attribute): bool}."""
    out = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if value not in ("0", "1"):
            raise SystemExit(f"--set: {item!r} is not module.NAME=0|1")
        out[_switch(name)] = value == "1"
    return out


def _flipped(flip: list, on: bool, fn):
    def run():
        for module, attr in flip:
            setattr(module, attr, on)
        return fn()
    return run


def _op(name: str, q, k, v, do, causal: bool, config):
    """The FP8 op to time (``fwd``, ``bwd`` from a forward's O and LSE computed once, ``fwdbwd`` or
    ``fwdbwd_saved``): a function returning its outputs."""
    kw = dict(scale=q.shape[-1] ** -0.5, mask=MaskSpec(causal=causal), config=config)
    if name == "fwd":
        return lambda: forward.triton_forward(q, k, v, **kw)
    if name == "bwd":
        out, lse = forward.triton_forward(q, k, v, **kw)
        return lambda: backward.triton_backward(q, k, v, out, lse, do, **kw)

    def fwdbwd():
        out, lse = forward.triton_forward(q, k, v, **kw)
        return (out, lse) + tuple(backward.triton_backward(q, k, v, out, lse, do, **kw))

    def fwdbwd_saved():  # as autograd runs them: what the forward computes for the backward handed over
        saved = {}
        out, lse = ops.run_forward(q, k, v, kw["scale"], kw["mask"], config, for_backward=saved)
        return (out, lse) + tuple(ops.run_backward(q, k, v, out, lse, do, kw["scale"], kw["mask"], config,
                                                   saved=saved))
    return fwdbwd_saved if name == "fwdbwd_saved" else fwdbwd


def _cudnn(name: str, q, k, v, do, causal: bool):
    """SDPA cuDNN's bf16 forward (``fwd``) or forward and backward (``bwd``, ``fwdbwd``; the backward
    through autograd), as a function."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qg, kg, vg = (t.detach().requires_grad_(name != "fwd") for t in (q, k, v))

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        if name != "fwd":
            torch.autograd.grad(out, (qg, kg, vg), do)
        return out
    return run


def _cudnn_us(fn, rep: int) -> float:
    """cuDNN's time by CUDA graph, or, where its autograd backward cannot be captured, by
    ``triton.testing.do_bench`` (then with its launch cost: the row's cuDNN ratio is approximate)."""
    try:
        return _time_us(fn, rep)
    except RuntimeError as err:
        print(f"cuDNN not captured in a CUDA graph ({str(err).splitlines()[0]}): timed by do_bench", flush=True)
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, rep=rep, return_mode="median") * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--switch", default="forward_gluon.QUANTIZE_Q", help="module.NAME[+module.NAME...]")
    p.add_argument("--set", default="", help="module.NAME=0|1,...: other switches, for both arms")
    p.add_argument("--op", default="fwd", choices=OPS)
    p.add_argument("--seqlens", default="8192,16384")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128, help="head dim")
    p.add_argument("--configs", default="fp8_delta,fp8_delta_fast")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep", type=int, default=100, help="do_bench_cudagraph repetitions, ms")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--tag", default="switch_ab")
    args = p.parse_args(argv)
    flip, keep = switches(args.switch), fixed(args.set)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")

    defaults = {key: getattr(*key) for key in (*flip, *keep)}
    for (module, attr), value in keep.items():
        setattr(module, attr, value)
    d = args.dim
    rows = []
    gpu = torch.cuda.get_device_name()
    label = "+".join(f"{m.__name__.rsplit('.', 1)[-1]}.{a}" for m, a in flip)
    head = (f"{gpu} · torch {torch.__version__} · triton {triton.__version__} · "
            f"python {platform.python_version()} · {args.tokens} tokens per batch, H = {args.heads}, d = {d}, "
            f"bf16 · op {args.op}{' (cuDNN: its fwd+bwd less its forward)' if args.op == 'bwd' else ''} · "
            f"CUDA-graph medians, {args.rounds} rounds alternating {label} on / off"
            + "".join(f" · {m.__name__.rsplit('.', 1)[-1]}.{a} = {v}" for (m, a), v in keep.items()))
    print(head, flush=True)
    try:
        for s in map(int, args.seqlens.split(",")):
            b = max(args.tokens // s, 1)
            for causal in (True, False):
                g = torch.Generator(device="cuda").manual_seed(s + causal)
                q, k, v, do = (torch.randn(b, args.heads, s, d, device="cuda", generator=g, dtype=torch.bfloat16)
                               for _ in range(4))
                flop = 4.0 * b * args.heads * s * s * d * (0.5 if causal else 1.0)
                flop *= {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5, "fwdbwd_saved": 3.5}[args.op]
                cudnn_us = _cudnn_us(_cudnn(args.op, q, k, v, do, causal), args.rep)
                if args.op == "bwd":  # its backward alone: fwd+bwd less the forward
                    cudnn_us -= _cudnn_us(_cudnn("fwd", q, k, v, do, causal), args.rep)
                for name in args.configs.split(","):
                    fn = _op(args.op, q, k, v, do, causal, recipe_config(name))
                    on, off = _flipped(flip, True, fn)(), _flipped(flip, False, fn)()
                    same = all(torch.equal(torch.nan_to_num(a), torch.nan_to_num(c)) for a, c in zip(on, off))
                    times = {True: [], False: []}
                    for _ in range(args.rounds):
                        for switch in (True, False):
                            times[switch].append(_time_us(_flipped(flip, switch, fn), args.rep))
                    t_on, t_off = statistics.median(times[True]), statistics.median(times[False])
                    rows.append(dict(S=s, B=b, causal=causal, recipe=name, on_us=times[True], off_us=times[False],
                                     cudnn_us=cudnn_us, same_bits=same, on_over_off=t_on / t_off,
                                     x_cudnn_on=cudnn_us / t_on, x_cudnn_off=cudnn_us / t_off,
                                     tflops_on=flop / t_on / 1e6, tflops_off=flop / t_off / 1e6))
                    print(f"S={s} causal={causal} {name}: on {t_on:.1f} us, off {t_off:.1f} us "
                          f"({t_on / t_off:.3f}x), cuDNN {cudnn_us:.1f} us: x cudnn {cudnn_us / t_on:.3f} "
                          f"(off {cudnn_us / t_off:.3f}); same bits: {same}", flush=True)
    finally:
        for (module, attr), value in defaults.items():
            setattr(module, attr, value)
    lines = [f"# {label}, on / off ({args.op}) — {gpu}", "", head, "",
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
