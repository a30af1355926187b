"""Host (CPU) time of one attention training step against its GPU time: fp8_delta vs SDPA bf16.

At short sequences the GPU finishes an attention call faster than Python can issue it, and the
step is bound by the host: every Triton launch costs tens of microseconds of argument binding.
Per shape (causal, bf16, D=128) and implementation this prints, for forward + backward through
autograd:

- ``host us``: wall time per call of a loop that never waits for the GPU (what the host spends
  issuing the call; when it exceeds the GPU time, the GPU idles);
- ``gpu us``: the summed GPU time of the call's kernels (torch.profiler);
- ``launches``: GPU kernels per call;
- ``x sdpa``: host time over SDPA cuDNN's and SDPA flash's, measured in the same run.

``--recipe`` names the FP8 recipe (default ``fp8_delta``); ``--triton-backward`` runs the Triton
launches where the fast recipes' Gluon backward kernels would run (``backward.LAUNCH``), for an A/B of
their host time. ``--cudagraphs`` adds ``fp8_delta_cudagraphs``: the same step under
``torch.compile(mode="reduce-overhead")``, which records the op's kernels into CUDA graphs and
replays them (its step computes ``(out * dO).sum()`` and calls ``backward()``, the same gradients).

Writes ``<out-dir>/<tag>.md`` and ``.json``.

    python benchmarks/host_overhead.py --tag h200_host_overhead
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_attention import environment, write_results  # noqa: E402

from hf_fp8_attention import FP8AttentionConfig, fp8_attention  # noqa: E402

SHAPES = ((1, 8, 512), (1, 16, 1024), (2, 16, 2048), (1, 32, 4096))  # (B, H, S)


def _step_fns(q, k, v, do, recipe: str):
    cfg = FP8AttentionConfig.from_recipe(recipe)

    def ours():
        fp8_attention(q, k, v, causal=True, config=cfg).backward(do)

    def sdpa(backend):
        def step():
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
        return step

    return {recipe: ours, "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
            "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION)}


def _cudagraph_step(q, k, v, do):
    """fp8_delta forward + backward under torch.compile(mode="reduce-overhead") (CUDA graphs)."""
    cfg = FP8AttentionConfig.from_recipe("fp8_delta")

    def loss(q, k, v, do):
        return (fp8_attention(q, k, v, causal=True, config=cfg) * do).sum()

    compiled = torch.compile(loss, mode="reduce-overhead", fullgraph=True, dynamic=False)

    def step():
        torch.compiler.cudagraph_mark_step_begin()
        compiled(q, k, v, do).backward()

    return step


def _host_us(fn, calls: int) -> float:
    """Host time per call while the GPU queue absorbs the work (synchronised only before and after)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return host / calls * 1e6


def _gpu_us(fn, calls: int = 10) -> tuple[float, float]:
    """(summed kernel time per call in us, kernels per call) from torch.profiler."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return sum(e.device_time for e in kernels) / calls, len(kernels) / calls


def run(calls: int, cudagraphs: bool, recipe: str = "fp8_delta") -> list[dict]:
    rows = []
    for b, h, s in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
                   for _ in range(3))
        do = torch.randn(b, h, s, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        steps = _step_fns(q, k, v, do, recipe)
        if cudagraphs:
            steps["fp8_delta_cudagraphs"] = _cudagraph_step(q, k, v, do)
        for name, fn in steps.items():
            host = _host_us(fn, calls)
            gpu, launches = _gpu_us(fn)
            rows.append({"B": b, "H": h, "S": s, "impl": name, "host_us": host, "gpu_us": gpu, "launches": launches})
            print(f"B={b} H={h} S={s} {name:20s} host {host:8.1f} us  gpu {gpu:8.1f} us  {launches:.0f} launches",
                  flush=True)
    return rows


def render(env: dict, rows: list[dict]) -> str:
    lines = [f"# Host time of one attention training step (fwd+bwd) — {env['gpu']}", "",
             " · ".join(f"{k} {env[k]}" for k in ("torch", "triton", "cuda", "python", "date_utc")), "",
             "causal, bf16, D = 128; host: issue time per call, GPU never awaited; gpu: summed kernel time.", "",
             "| B | H | S | impl | host us | gpu us | launches | host / gpu | x sdpa_cudnn | x sdpa_flash |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = {x["impl"]: x["host_us"] for x in rows if (x["B"], x["H"], x["S"]) == (r["B"], r["H"], r["S"])}
        lines.append(f"| {r['B']} | {r['H']} | {r['S']} | {r['impl']} | {r['host_us']:.0f} | {r['gpu_us']:.0f} | "
                     f"{r['launches']:.0f} | {r['host_us'] / r['gpu_us']:.2f} | "
                     f"{r['host_us'] / ref['sdpa_cudnn']:.2f} | {r['host_us'] / ref['sdpa_flash']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200, help="calls per host-time loop")
    p.add_argument("--cudagraphs", action="store_true",
                   help='also time fp8_delta under torch.compile(mode="reduce-overhead")')
    p.add_argument("--recipe", default="fp8_delta", help="the FP8 recipe timed (a name of RECIPES)")
    p.add_argument("--triton-backward", action="store_true",
                   help="the Triton launches in place of the fast recipes' Gluon backward kernels")
    p.add_argument("--tag", default="host_overhead")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_overhead: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.triton_backward:
        from hf_fp8_attention.kernels import backward
        backward.LAUNCH["gluon_dq"] = backward.LAUNCH["gluon_dkdv"] = ()
    env = environment()
    rows = run(args.calls, args.cudagraphs, args.recipe)
    write_results(args.out_dir, args.tag, render(env, rows), {"env": env, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
