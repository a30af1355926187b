"""Where a training step's host time goes: the attention path's Python, timed inside a real model.

Builds a model of ``train_step.py`` (default the SmolLM2-135M shape) per attention implementation
and runs training steps (forward, backward, AdamW). The host clock is read around the package's
layers of the call path, as the host issues them (the GPU is not awaited, so in a host-bound step
these are the times the GPU waits for):

- ``hf_forward``: the Transformers attention function (mask plan, transposes, the functional API);
- ``op_forward`` / ``op_backward``: the autograd Function's forward and backward
  (:func:`hf_fp8_attention.ops.run_forward` / ``run_backward``: quantization, planning, launches);
- ``launch``: the Triton kernel launches inside them (:func:`hf_fp8_attention.kernels.launch.launch`:
  Triton's argument binding or the direct path's key, the launcher, the driver call), and their
  count; ``gluon``: the Gluon launches (each with its TMA descriptors). Both are also listed per
  kernel.

Per phase of the step (forward, backward, optimizer step) the host's issue time is set beside the
GPU's time for the same phase (CUDA events recorded as each phase starts and after the last): a
phase whose GPU time is not much longer than its host time is host-bound, and there the GPU waits
for every microsecond of the host's.

``--direct both`` times each FP8 implementation with the direct launch path off and then on
(``HF_FP8_ATTENTION_DIRECT_LAUNCH``; rows ``<impl>+direct``).

Each line gives milliseconds per step and per layer, next to the step's wall time (host clock,
synchronized per step) and the sdpa step's. ``--profile`` adds torch.profiler's top operators
by self CPU time for each FP8 implementation.

    python benchmarks/host_breakdown.py --attn sdpa,fp8_delta,fp8_delta_fast --context 2048
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_step import MODELS, model_config, register_attention, training_optimizer  # noqa: E402
from model_step import build_model  # noqa: E402

from hf_fp8_attention import ops  # noqa: E402
from hf_fp8_attention.kernels import launch  # noqa: E402
from hf_fp8_attention.integration import transformers_backend  # noqa: E402

_TOTALS: dict[str, float] = defaultdict(float)
_COUNTS: dict[str, int] = defaultdict(int)
_KERNELS: dict[str, float] = defaultdict(float)  # host time per launched kernel name
_KERNEL_COUNTS: dict[str, int] = defaultdict(int)
_LOCK = threading.Lock()  # the backward's launches run on the autograd engine's thread


def _timed(name: str, fn, kernel_name=None):
    """``fn`` wrapped so that its host time adds to ``_TOTALS[name]``, and with ``kernel_name`` (of the
    call's positional arguments) to ``_KERNELS["name:kernel"]`` as well."""

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.perf_counter() - t0
            with _LOCK:
                _TOTALS[name] += spent
                _COUNTS[name] += 1
                if kernel_name is not None:
                    key = f"{name}:{kernel_name(args)}"
                    _KERNELS[key] += spent
                    _KERNEL_COUNTS[key] += 1

    return wrapper


def _kernel_name(kernel) -> str:
    """The JIT function's name of a Triton kernel handle."""
    return getattr(getattr(kernel, "fn", kernel), "__name__", type(kernel).__name__)


def instrument() -> None:
    """Wrap the call path's layers with host timers. Each is looked up as a module global at call
    time (the registered attention functions call ``transformers_backend.fp8_attention_forward``,
    the autograd Function ``ops.run_forward`` / ``run_backward``), so replacing the attributes is
    enough."""
    from hf_fp8_attention.kernels import (
        backward, backward_dkdv_gluon, backward_dq_gluon, backward_stats_gluon, forward, forward_gluon, quantize,
        sequence_stats,
    )

    transformers_backend.fp8_attention_forward = _timed("hf_forward", transformers_backend.fp8_attention_forward)
    ops.run_forward = _timed("op_forward", ops.run_forward)
    ops.run_backward = _timed("op_backward", ops.run_backward)
    # either path (HF_FP8_ATTENTION_DIRECT_LAUNCH)
    timed_launch = _timed("launch", launch.launch, lambda args: _kernel_name(args[0]))
    for module in (backward, forward, quantize, sequence_stats):
        module.launch_kernel = timed_launch
    for module, fn in ((forward_gluon, "gluon_forward"), (backward_stats_gluon, "gluon_dq_stats"),
                       (backward_dq_gluon, "gluon_dq"), (backward_dkdv_gluon, "gluon_dkdv")):
        setattr(module, fn, _timed("gluon", getattr(module, fn), lambda args, fn=fn: fn))


def phase_times(step_phases, steps: int) -> dict[str, tuple[float, float]]:
    """Per phase, (host ms, GPU ms) medians over ``steps`` calls of ``step_phases``: a list of
    (name, callable) run in order. The host time is the callable's issue time; the GPU time runs
    from an event recorded as the phase starts to one recorded as the next starts (the last: after
    it), synchronized once per step."""
    names = [name for name, _ in step_phases]
    host: dict[str, list[float]] = {n: [] for n in names}
    gpu: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(steps):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(step_phases) + 1)]
        for (name, fn), event in zip(step_phases, events):
            event.record()
            t0 = time.perf_counter()
            fn()
            host[name].append((time.perf_counter() - t0) * 1e3)
        events[-1].record()
        torch.cuda.synchronize()
        for i, name in enumerate(names):
            gpu[name].append(events[i].elapsed_time(events[i + 1]))
    return {n: (statistics.median(host[n]), statistics.median(gpu[n])) for n in names}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", choices=list(MODELS))
    p.add_argument("--attn", default="sdpa,fp8_delta,fp8_delta_fast")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--direct", choices=("off", "on", "both"), default="off",
                   help="the direct launch path (HF_FP8_ATTENTION_DIRECT_LAUNCH) for the FP8 implementations")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_breakdown.py needs a CUDA GPU (the Triton launch path)")
    names = a.attn.split(",")
    register_attention(names)
    instrument()
    config = model_config(a.model, tiny=False)
    layers = config.num_hidden_layers
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__}; {a.model} shape, {layers} layers, "
          f"1 x {a.context} tokens, bf16, AdamW; host ms per step (per layer)")
    ids = torch.randint(0, config.vocab_size, (1, a.context), generator=torch.Generator().manual_seed(0)).cuda()
    base_ms = None
    settings = {"off": ("0",), "on": ("1",), "both": ("0", "1")}[a.direct]
    runs = [(impl, env) for impl in names for env in (("0",) if impl == "sdpa" else settings)]
    for impl, direct in runs:
        os.environ[launch.DIRECT_LAUNCH_ENV] = direct
        label = impl + ("+direct" if direct == "1" else "")
        model = build_model(config, impl, seed=0)
        model.train()
        opt, _ = training_optimizer(model)

        state = {}

        def forward():
            state["loss"] = model(input_ids=ids, labels=ids, use_cache=False).loss

        def optimizer_step():
            opt.step()
            opt.zero_grad(set_to_none=True)

        phases = [("forward", forward), ("backward", lambda: state.pop("loss").backward()),
                  ("optimizer", optimizer_step)]

        def step():
            for _, fn in phases:
                fn()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        for table in (_TOTALS, _COUNTS, _KERNELS, _KERNEL_COUNTS):
            table.clear()
        walls = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls) * 1e3
        base_ms = wall if impl == "sdpa" else base_ms
        parts = "  ".join(f"{k} {v * 1e3 / a.steps:6.1f} ({v * 1e3 / a.steps / layers:5.2f}) x{_COUNTS[k] // a.steps}"
                          for k, v in sorted(_TOTALS.items()))
        extra = f"  (+{(wall - base_ms) / layers:.2f} ms/layer over sdpa)" if base_ms and impl != "sdpa" else ""
        kernels = "  ".join(f"{k} {v * 1e3 / a.steps / layers:5.3f} x{_KERNEL_COUNTS[k] / a.steps / layers:g}"
                            for k, v in sorted(_KERNELS.items(), key=lambda kv: -kv[1]))
        print(f"{label:<22} step {wall:7.1f} ms{extra}\n    {parts}"
              + (f"\n    per kernel, ms per layer (launches per layer): {kernels}" if kernels else ""), flush=True)
        by_phase = phase_times(phases, a.steps)
        print("    phases, host issue / GPU ms per step: " + "  ".join(
            f"{n} {h:.1f} / {g:.1f}" for n, (h, g) in by_phase.items()), flush=True)
        if a.profile and impl != "sdpa":
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(2):
                    step()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        del model, opt
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
