"""Python time of the kernel launch path, on any machine: every Triton launch stubbed out.

Runs ``fp8_attention`` forward + backward through the Triton launchers on CPU tensors, with
Triton's interpreter selected (so the launchers accept CPU tensors) and each kernel's ``run``
replaced by a stub that only records the kernel's name. What is timed is then the package's own
Python (argument checks, planning, tensor allocation, custom-op and autograd dispatch) plus the
CPU cost of the autograd engine's gradient handling at this shape, not the kernels and not Triton's
argument binding (tens of microseconds per launch on a GPU machine, ``benchmarks/NOTES.md``,
"Host time"). Prints the launches of one fwd+bwd in order, the PyTorch operators it runs besides
them (each one a device launch on a GPU unless it only makes a view), and the median wall time per
call, and with ``--profile`` the top of a cProfile of the package's functions. ``--packed N``: the
tokens as N packed sequences of near-equal length (cu_seqlens) instead of one.

``--hopper``: the launch path an H100 takes instead of the interpreter's (``hopper_host_sim.py``:
compiled Triton, the Gluon kernels, TMA, 132 multiprocessors; each launch recorded with the direct
launch path's key of its arguments), q, k and v laid out as an attention layer makes them (token-major,
``(B, S, H, D)`` transposed) with ``--kv-heads`` heads for K and V, the gradients taken with
``torch.autograd.grad`` (no accumulation into leaves).

    python benchmarks/host_python.py --recipes fp8_delta,fp8_delta_fast,fp8_delta_tile [--packed 3] [--profile]
    python benchmarks/host_python.py --hopper --seq 2048 --heads 9 --kv-heads 3 --head-dim 64
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

HOPPER = "--hopper" in sys.argv[1:]
if not HOPPER:  # before triton is imported: the launchers then take CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hopper_host_sim import kernel_name, simulated_hopper  # noqa: E402

from hf_fp8_attention import RECIPES, fp8_attention, ops  # noqa: E402
from hf_fp8_attention.config import Backend  # noqa: E402

LAUNCHES: list[str] = []


def _stub_run(self, *args, grid=None, **kwargs):
    LAUNCHES.append(kernel_name(self))


class _CountOps(TorchDispatchMode):
    """Counts the PyTorch operators run under it, views (``OpOverload.is_view``) apart."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.is_view:
            self.views += 1
        else:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def inputs(a) -> tuple:
    """``q, k, v, dout``: contiguous ``(1, H, S, D)`` leaves; with ``--hopper`` token-major views
    (``(1, S, H, D)`` leaves transposed) with ``--kv-heads`` heads for K and V."""
    if not a.hopper:
        shape = (1, a.heads, a.seq, a.head_dim)
        q, k, v = (torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        return q, k, v, torch.randn(shape, dtype=torch.bfloat16)
    q, k, v = (torch.randn(1, a.seq, h, a.head_dim, dtype=torch.bfloat16, requires_grad=True).transpose(1, 2)
               for h in (a.heads, a.kv_heads or a.heads, a.kv_heads or a.heads))
    return q, k, v, torch.randn_like(q)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", default="fp8_delta,fp8_delta_fast,fp8_delta_tile")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=0, help="K and V heads with --hopper (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--packed", type=int, default=0, help="pack the tokens as this many sequences (cu_seqlens)")
    ap.add_argument("--hopper", action="store_true", help="the H100's launch path (read before torch is imported)")
    a = ap.parse_args(argv)
    with contextlib.ExitStack() as stack:
        if a.hopper:
            recorded = stack.enter_context(simulated_hopper())
        else:
            interpreter.InterpretedFunction.run = _stub_run
            ops.select_backend = lambda device, config: Backend.TRITON  # CPU tensors through the kernel launchers
            recorded = LAUNCHES
        run(a, recorded)
    return 0


def run(a, recorded: list) -> None:
    """Times and lists each recipe's fwd+bwd (see the module docstring); ``recorded``: where the
    launches are appended (names, or ``hopper_host_sim.Launch`` records)."""
    q, k, v, dout = inputs(a)
    packed = {}
    if a.packed:
        cu = torch.linspace(0, a.seq, a.packed + 1).round().to(torch.int32)
        longest = int((cu[1:] - cu[:-1]).max())
        packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; q {tuple(q.shape)}, k, v {tuple(k.shape)} bf16, causal"
          f"{f', {a.packed} packed sequences' if a.packed else ''}; "
          f"{'the H100 launch path simulated' if a.hopper else 'the interpreter path'}, launches stubbed")
    for name in a.recipes.split(","):
        config = RECIPES[name].replace(backend="triton")

        def step():
            recorded.clear()  # (the records of the calls before: no growth over the timed calls)
            out = fp8_attention(q, k, v, causal=True, config=config, **packed)
            if a.hopper:
                torch.autograd.grad(out, (q, k, v), dout)
            else:
                out.backward(dout)

        for _ in range(3):
            step()
        counter = _CountOps()
        with counter:
            step()
        launches = [getattr(r, "kernel", r) for r in recorded]
        views, others = counter.views, dict(counter.counts.most_common())
        times = []
        for _ in range(a.calls):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        print(f"{name}: {len(launches)} Triton launches per fwd+bwd, {1e3 * statistics.median(times):.2f} ms per "
              f"fwd+bwd (median of {a.calls})\n  {' '.join(launches)}\n  PyTorch operators: {sum(others.values())} "
              f"besides {views} views: {', '.join(f'{op} x{n}' for op, n in others.items())}", flush=True)
        if a.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.calls):
                step()
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats("hf_fp8_attention", 15)


if __name__ == "__main__":
    raise SystemExit(main())
