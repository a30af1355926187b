"""Registers, spills and shared memory of each Triton attention kernel as compiled for this GPU.

One fwd+bwd of the FP8 attention op at a benchmark shape; every kernel launch is recorded and its
compiled resources printed (``n_regs`` per thread, ``n_spills`` = bytes spilled to local memory).
Pin the forward launch (``HF_FP8_ATTENTION_FWD_CONFIG=64,4,3``) to skip autotuning.
Usage (CUDA): ``python benchmarks/kernel_resources.py --seq 8192 --heads 16 --dim 128``.
"""
from __future__ import annotations

import argparse

import torch
import triton


def _record(jit_fn, seen: dict):
    """Wrap ``jit_fn.run`` so each launch's CompiledKernel lands in ``seen`` under the kernel name."""
    run = jit_fn.run

    def recording_run(*args, **kwargs):
        compiled = run(*args, **kwargs)
        seen[jit_fn.__name__] = compiled
        return compiled

    jit_fn.run = recording_run


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--causal", type=int, default=1)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_resources.py needs a CUDA GPU")

    import hf_fp8_attention  # noqa: F401  (registers the ops)
    from hf_fp8_attention import fp8_attention
    from hf_fp8_attention.kernels import backward_fp8, backward_inreg, forward, quantize

    seen: dict = {}
    for module in (forward, backward_fp8, backward_inreg, quantize):
        for obj in vars(module).values():
            if isinstance(obj, triton.runtime.autotuner.Autotuner):
                obj = obj.fn
            if isinstance(obj, triton.runtime.jit.JITFunction):
                _record(obj, seen)
    q, k, v = (torch.randn(1, args.heads, args.seq, args.dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    out = fp8_attention(q, k, v, causal=bool(args.causal))
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()} · triton {triton.__version__} · S={args.seq} H={args.heads} "
          f"D={args.dim} causal={bool(args.causal)}")
    print(f"{'kernel':40s} {'regs':>5s} {'spill B':>8s} {'smem B':>8s} {'warps':>5s} {'stages':>6s}")
    for name, c in sorted(seen.items()):
        meta = c.metadata
        print(f"{name:40s} {c.n_regs:5d} {c.n_spills:8d} {meta.shared:8d} {meta.num_warps:5d} {meta.num_stages:6d}")


if __name__ == "__main__":
    main()
