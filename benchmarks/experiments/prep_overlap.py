"""Can the forward's memory-bound preparation run under its compute-bound attention kernel?

Today the K/V statistics and copies (~155 µs at 2 x 8k tokens, H = 16, d = 128, on all SMs at about
2 TB/s) run before the attention kernel (~730 µs), one after the other. They are bound by bytes in
flight, not by SMs, so a few SMs might carry them while the others compute. This script measures
the upper bound of that overlap: the heads split into G groups (the statistics are per (sequence,
head), so no value changes), each group's preparation (``forward.stats_then_copies`` and, for the
fast recipe, Q's ``stats_for``) on a second, lower-priority stream, the attention kernel of each
group on the first stream once its group's preparation is done, and the persistent kernel on R
programs fewer than SMs so that the preparation finds SMs while it runs. Group g + 1 is prepared
while group g is computed; only group 0's preparation stays exposed.

Each variant's O and LSE are compared bit for bit with the one-call forward's. Times: CUDA-graph
medians (both streams captured into one graph, launch cost excluded: G groups cost G times the
launches, which eager calls pay on the host), SDPA cuDNN's bf16 forward timed the same way.

    python benchmarks/experiments/prep_overlap.py --recipes fp8_delta,fp8_delta_fast --groups 1,2,4 \
        --reserve 0,4,8,16
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hf_fp8_attention.kernels import forward, persistent_schedule  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from recipe_names import recipe_config  # noqa: E402


def tensors_in(obj) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` (tuples, lists, dataclasses), for keeping them alive."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors_in(getattr(obj, f.name))]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensors_in(x)]
    return []


class SideStreamPrep:
    """While active, the forward's preparation calls run on ``prep``; the calling stream waits for
    them before its next launch. Their outputs are kept until :meth:`release`, so that no block the
    compute stream still reads is handed to a later allocation (inside a graph capture too)."""

    NAMES = ("stats_then_copies", "stats_for")

    def __init__(self, prep: torch.cuda.Stream):
        self.prep, self.kept, self.saved = prep, [], {}

    def _wrap(self, fn):
        def run(*args, **kwargs):
            cur = torch.cuda.current_stream()
            with torch.cuda.stream(self.prep):
                out = fn(*args, **kwargs)
            self.kept.extend(tensors_in(out))
            cur.wait_stream(self.prep)
            return out
        return run

    def __enter__(self):
        for name in self.NAMES:
            self.saved[name] = getattr(forward, name)
            setattr(forward, name, self._wrap(self.saved[name]))
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(forward, name, fn)

    def release(self):
        self.kept.clear()


def reserved_sms(reserve: int):
    """Patches the persistent kernel's program count to the SMs less ``reserve``; returns the undo."""
    original = persistent_schedule.sm_count
    persistent_schedule.sm_count = lambda index: max(1, original(index) - reserve)
    return lambda: setattr(persistent_schedule, "sm_count", original)


def graph_us(fn, stream: torch.cuda.Stream, rep: int) -> float:
    """Median GPU time of one replay of ``fn`` captured on ``stream`` (µs)."""
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    times = []
    with torch.cuda.stream(stream):
        for _ in range(rep + 3):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times[3:])


def grouped_forward(groups, kw, side: SideStreamPrep | None):
    """The forward of each head group ``(q, k, v)`` in turn on the current stream, its preparation on
    ``side``'s stream where given; returns the groups' (O, LSE)."""
    if side is None:
        return [forward.triton_forward(q, k, v, **kw) for q, k, v in groups]
    cur = torch.cuda.current_stream()
    side.prep.wait_stream(cur)  # the inputs are written on the current stream
    with side:
        outs = [forward.triton_forward(q, k, v, **kw) for q, k, v in groups]
    cur.wait_stream(side.prep)
    return outs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", default="fp8_delta,fp8_delta_fast")
    p.add_argument("--groups", default="1,2,4", help="head groups (1: the one-call forward's launches)")
    p.add_argument("--reserve", default="0,4,8,16", help="SMs the persistent kernel leaves to the preparation")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--causal", type=int, default=1)
    p.add_argument("--rep", type=int, default=30)
    args = p.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    b, h, s, d = args.batch, args.heads, args.seq, 128
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    compute = torch.cuda.Stream(priority=-1)  # the attention kernels: first pick of freed SMs
    side = SideStreamPrep(torch.cuda.Stream(priority=0))
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · B={b} H={h} S={s} d={d} bf16 · "
          f"causal={bool(args.causal)} · CUDA-graph medians of {args.rep} replays")

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(args.causal))
    t_cudnn = graph_us(cudnn, compute, args.rep)
    print(f"SDPA cuDNN bf16 forward {t_cudnn:.1f} us")
    print("| recipe | groups | reserved SMs | side stream | us | x one call | x cuDNN | same bits |")
    print("|---|---|---|---|---|---|---|---|")
    for recipe in args.recipes.split(","):
        kw = dict(scale=d ** -0.5, mask=MaskSpec(causal=bool(args.causal)), config=recipe_config(recipe))
        ref_out, ref_lse = forward.triton_forward(q, k, v, **kw)
        t_ref = graph_us(lambda: forward.triton_forward(q, k, v, **kw), compute, args.rep)
        print(f"| {recipe} | one call | 0 | no | {t_ref:.1f} | 1.000 | {t_cudnn / t_ref:.3f} | True |", flush=True)
        for n_groups in (int(g) for g in args.groups.split(",")):
            if h % n_groups:
                continue
            step = h // n_groups
            groups = [tuple(x[:, i:i + step].contiguous() for x in (q, k, v)) for i in range(0, h, step)]
            for reserve in (int(r) for r in args.reserve.split(",")):
                for use_side in (False, True) if n_groups > 1 else (False,):
                    undo = reserved_sms(reserve)
                    try:
                        with torch.cuda.stream(compute):
                            outs = grouped_forward(groups, kw, side if use_side else None)
                        torch.cuda.synchronize()
                        side.release()
                        same = (torch.equal(torch.cat([o for o, _ in outs], 1), ref_out)
                                and torch.equal(torch.cat([lse for _, lse in outs], 1), ref_lse))
                        t = graph_us(lambda: grouped_forward(groups, kw, side if use_side else None), compute,
                                     args.rep)
                        side.release()
                    finally:
                        undo()
                    print(f"| {recipe} | {n_groups} | {reserve} | {'yes' if use_side else 'no'} | {t:.1f} | "
                          f"{t_ref / t:.3f} | {t_cudnn / t:.3f} | {same} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
