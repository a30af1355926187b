"""Host time of the kernel launches: Triton's launch path against the direct one (GPU).

Part 1, per launch of one fwd+bwd (``--recipes``; SmolLM2's attention shape by default: 9 query /
3 kv heads, head_dim 64, 2048 tokens, causal), median host microseconds of:

- ``triton``: ``kernel[grid](*args, **meta)``, what every launch cost before the direct path;
- ``binder``: Triton's argument binding and specialization alone (internal API, for the split);
- ``direct``: :class:`hf_fp8_attention.kernels.launch.DirectLauncher` on a known key (our key,
  then Triton's ``CompiledKernel[grid]`` launcher);
- ``launcher``: the compiled kernel's launcher alone (``CompiledKernel.run``, no key).

Part 2, the host time of one whole ``fp8_attention`` fwd+bwd with ``HF_FP8_ATTENTION_DIRECT_LAUNCH``
off and on, alternated over ``--rounds``, next to ``torch.nn.functional.scaled_dot_product_attention``
(bf16; flash and cuDNN backends) at the same shape. Host time = the Python call's wall time, the GPU
synchronized between calls (at these shapes the GPU finishes before the host issues the next call).

    python benchmarks/launch_path.py [--recipes fp8_delta,fp8_delta_fast] [--seq 2048]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_fp8_attention import RECIPES, fp8_attention  # noqa: E402
from hf_fp8_attention.kernels import launch as launch_mod  # noqa: E402
from hf_fp8_attention.kernels.launch import DirectLauncher  # noqa: E402


def _median_us(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(times)


def _inputs(a):
    q = torch.randn(1, a.heads, a.seq, a.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, a.kv_heads, a.seq, a.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    return q, k, v, torch.randn_like(q)


def per_launch(a, recipe: str, q, k, v, dout) -> None:
    """Part 1: capture one fwd+bwd's launches through Triton's path, then time each one's pieces."""
    captured = []
    run = JITFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        meta = dict(kwargs)
        compiled = run(self, *args, grid=grid, warmup=warmup, **kwargs)
        captured.append((self, args, grid, meta, compiled))
        return compiled

    os.environ[launch_mod.DIRECT_LAUNCH_ENV] = "0"  # every launch through Triton's run, recorded
    cfg = RECIPES[recipe]
    for _ in range(2):
        fp8_attention(q, k, v, causal=True, config=cfg).backward(dout)
    JITFunction.run = recording
    try:
        fp8_attention(q, k, v, causal=True, config=cfg).backward(dout)
    finally:
        JITFunction.run = run
    torch.cuda.synchronize()
    totals = dict(triton=0.0, binder=0.0, direct=0.0, launcher=0.0)
    print(f"\n{recipe}: {len(captured)} launches per fwd+bwd; host us per launch (median of {a.calls})")
    for kernel, args, grid, meta, compiled in captured:
        device = torch.cuda.current_device()
        binder = kernel.device_caches[device][4]
        bound, _, _ = binder(*args, **meta, debug=False)
        values = tuple(bound.values())
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        stream = torch.cuda.current_stream().cuda_stream
        direct = DirectLauncher(kernel)
        direct(grid, args, meta)  # first call of the key: binds, compiles (cached), launches
        row = dict(
            triton=_median_us(lambda: kernel[grid](*args, **meta), a.calls),
            binder=_median_us(lambda: binder(*args, **meta, debug=False), a.calls),
            direct=_median_us(lambda: direct(grid, args, meta), a.calls),
            launcher=_median_us(lambda: compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata,
                                                     None, None, None, *values), a.calls),
        )
        assert direct.direct >= a.calls, "the direct path was not taken"
        for name in totals:
            totals[name] += row[name]
        print(f"  {kernel.fn.__name__:24s} {len(values):3d} args: " + "  ".join(f"{n} {t:6.1f}" for n, t in row.items()))
    print("  total per fwd+bwd: " + "  ".join(f"{n} {t:6.0f}" for n, t in totals.items()), flush=True)


def whole_call(a, recipes, q, k, v, dout) -> None:
    """Part 2: one fwd+bwd's host time, direct path off / on, alternated; SDPA beside it."""

    def fp8_step(cfg):
        return lambda: fp8_attention(q, k, v, causal=True, config=cfg).backward(dout)

    def sdpa_step(backend):
        def step():
            with sdpa_kernel(backend):
                torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout)
        return step

    def host_ms(step) -> float:
        times = []
        for _ in range(a.calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return 1e3 * statistics.median(times)

    results: dict[str, list[float]] = {}
    steps = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        steps[f"sdpa {backend.name.lower()}"] = (None, sdpa_step(backend))
    for recipe in recipes:
        for on in ("0", "1"):
            steps[f"{recipe} direct={'on' if on == '1' else 'off'}"] = (on, fp8_step(RECIPES[recipe]))
    for name, (env, step) in steps.items():  # warm-up: compiles, tunes, fills the launch caches
        if env is not None:
            os.environ[launch_mod.DIRECT_LAUNCH_ENV] = env
        for _ in range(3):
            step()
    for _ in range(a.rounds):
        for name, (env, step) in steps.items():
            if env is not None:
                os.environ[launch_mod.DIRECT_LAUNCH_ENV] = env
            try:
                results.setdefault(name, []).append(host_ms(step))
            except RuntimeError as err:  # an SDPA backend this build lacks
                results.setdefault(name, []).append(float("nan"))
                print(f"  {name}: {err}", flush=True)
    os.environ.pop(launch_mod.DIRECT_LAUNCH_ENV, None)
    print(f"\nhost ms per fwd+bwd (median of {a.calls} calls per round; rounds: {a.rounds})")
    for name, vals in results.items():
        print(f"  {name:28s} " + "  ".join(f"{x:6.3f}" for x in vals) + f"   median {statistics.median(vals):6.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", default="fp8_delta,fp8_delta_fast")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_path.py needs a CUDA GPU")
        return 1
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}; "
          f"q (1, {a.heads}, {a.seq}, {a.head_dim}), k/v (1, {a.kv_heads}, {a.seq}, {a.head_dim}) bf16, causal")
    q, k, v, dout = _inputs(a)
    recipes = a.recipes.split(",")
    for recipe in recipes:
        per_launch(a, recipe, q, k, v, dout)
    whole_call(a, recipes, q, k, v, dout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
