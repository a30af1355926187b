"""The package's Python per fwd+bwd with ``kernels.quantize.interpreting()`` reading TRITON_INTERPRET
on every call against the flag read once at import, alternated in one process (Triton launches
stubbed, CPU tensors: ``benchmarks/host_python.py``'s setup; the op's forward and backward only,
``ops.run_forward`` + ``ops.run_backward``, GQA 16 / 8 heads, S = 1024, d = 128, ``fp8_delta``).

    python benchmarks/experiments/interpreting_flag_ab.py [--rounds 6]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import host_python  # noqa: E402  (sets TRITON_INTERPRET before Triton is imported)
import torch  # noqa: E402

from hf_fp8_attention import RECIPES, fp8_attention, ops  # noqa: E402
from hf_fp8_attention.config import Backend  # noqa: E402
from hf_fp8_attention.kernels import backward, forward, gluon_hopper, quantize  # noqa: E402


def _read_env() -> bool:  # the form before: an environment read per call
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=100)
    a = ap.parse_args(argv)
    host_python.interpreter.InterpretedFunction.run = host_python._stub_run
    ops.select_backend = lambda device, config: Backend.TRITON
    q = torch.randn(1, 16, 1024, 128, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 8, 1024, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn(1, 16, 1024, 128, dtype=torch.bfloat16)
    spent = []
    run_forward, run_backward = ops.run_forward, ops.run_backward

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - t0)
        return wrapper

    ops.run_forward, ops.run_backward = timed(run_forward), timed(run_backward)
    config = RECIPES["fp8_delta"].replace(backend="triton")
    for _ in range(5):
        fp8_attention(q, k, v, causal=True, config=config).backward(dout)
    forms = {"read per call": _read_env, "read once": quantize.interpreting}
    results = {name: [] for name in forms}
    for _ in range(a.rounds):
        for name, fn in forms.items():
            for module in (quantize, backward, forward, gluon_hopper):
                module.interpreting = fn
            per_call = []
            for _ in range(a.calls):
                spent.clear()
                fp8_attention(q, k, v, causal=True, config=config).backward(dout)
                per_call.append(sum(spent))
            results[name].append(1e6 * statistics.median(per_call))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs; op forward + backward, µs per call, median of "
          f"{a.calls} per round, {a.rounds} rounds alternated")
    for name, values in results.items():
        print(f"{name:>14}: {' '.join(f'{x:.0f}' for x in values)}  (median {statistics.median(values):.0f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
