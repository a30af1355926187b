"""Where a training step's GPU time goes, per attention implementation: one profiled step of a
``train_step.py`` model (forward, backward, AdamW), its kernels summed by kind, and the GPU's idle
time inside the step.

``train_step.py`` gives the step's time; this says which kernels make the difference to sdpa's:

- ``attention (package)``: the package's Triton and Gluon kernels (names of the ``@triton.jit`` /
  ``@gluon.jit`` functions in ``hf_fp8_attention/kernels``);
- ``attention (sdpa)``: PyTorch's flash, cuDNN and memory-efficient attention kernels;
- ``gemm``: cuBLAS / CUTLASS matmuls (the projections, the MLP, the LM head);
- ``optimizer``: the fused AdamW's multi-tensor kernels;
- ``memcpy / memset`` and ``other`` (elementwise, reductions, copies: a layout copy that one
  backend needs and the other not shows here);
- ``idle``: the step's wall time (first kernel start to last kernel end) minus the union of its
  kernels' intervals: where the GPU waits for the host. Each idle interval is also charged to the
  kind of the kernel that ends it, and the largest are listed with their neighbours.

The step's phases (forward, backward, optimizer) are marked in the trace by a small host-to-device
copy of :data:`MARKER_BYTES` issued as each phase starts; per phase the table gives its span on the
GPU (from its marker to the next), its idle time and what ended that idle time. A phase whose idle
time grows against sdpa's is where the host falls behind the GPU.

Then the kernels outside attention whose time per step differs from sdpa's by more than
``--diff-us``. Kineto records CUDA activity only, so the host's per-launch overhead grows little.

    python benchmarks/step_profile.py --model llama0.9b --context 8192 --attn sdpa,fp8_delta,fp8_delta_fast
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import write_results  # noqa: E402
from model_step import build_model  # noqa: E402
from recipe_names import add_schedule_options, apply_schedule_options  # noqa: E402
from train_step import (  # noqa: E402
    MODELS, model_config, register_attention, run_environment, training_optimizer,
)

KERNELS_DIR = Path(__file__).resolve().parents[1] / "hf_fp8_attention" / "kernels"
PHASES = ("forward", "backward", "optimizer")
MARKER_BYTES = 4104  # a size no other copy of a step has: 1026 float32
CATEGORIES = ("attention (package)", "attention (sdpa)", "gemm", "optimizer", "memcpy / memset", "other", "idle")
_SDPA = re.compile(r"flash|fmha|cudnn|attention|sdpa|efficient_attention", re.I)
_GEMM = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|splitk|sm90_|sm80_|ampere_", re.I)
_OPTIMIZER = re.compile(r"multi_tensor_apply|fused_adam|FusedAdam", re.I)


def package_kernel_names(kernels_dir: Path = KERNELS_DIR) -> frozenset[str]:
    """Names of the package's JIT functions (the kernel names a profiler trace shows)."""
    pattern = re.compile(r"@(?:triton|gluon)\.jit[^\n]*\n(?:\s*@[^\n]*\n)*\s*def\s+(\w+)")
    return frozenset(name for path in kernels_dir.glob("*.py") for name in pattern.findall(path.read_text()))


def categorize(name: str, cat: str, package: frozenset[str]) -> str:
    """The :data:`CATEGORIES` entry of one GPU event (``cat``: the trace's event category)."""
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "memcpy / memset"
    if name in package:
        return "attention (package)"
    if _OPTIMIZER.search(name):
        return "optimizer"
    if _SDPA.search(name):
        return "attention (sdpa)"
    if _GEMM.search(name):
        return "gemm"
    return "other"


def gpu_events(trace: dict) -> list[dict]:
    """The kernel, memcpy and memset events (``name``, ``cat``, ``ts``, ``dur`` in µs) of a
    chrome trace exported by ``torch.profiler``."""
    return [e for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def is_marker(event: dict) -> bool:
    """Whether a GPU event is one of :func:`phase_marker`'s copies."""
    return event.get("cat") == "gpu_memcpy" and (event.get("args") or {}).get("bytes") == MARKER_BYTES


def phase_marker(device: str = "cuda"):
    """A callable that issues one marker copy (pinned host to device, not awaited)."""
    host = torch.zeros(MARKER_BYTES // 4, dtype=torch.float32).pin_memory()
    dev = torch.empty_like(host, device=device)
    return lambda: dev.copy_(host, non_blocking=True)


def phase_split(events: list[dict], package: frozenset[str], steps: int) -> dict[str, dict] | None:
    """Per phase, µs per step: ``span`` (GPU time from the phase's marker to the next marker, the
    last phase to the last event), ``idle`` (span minus the union of the events inside it, clipped
    to it) and ``idle_before`` (that idle time by the kind of kernel ending each interval; an
    interval the next phase's marker ends is in ``idle`` only). The markers start :data:`PHASES` in
    turn. None where the trace holds no marker."""
    markers = sorted(e["ts"] for e in events if is_marker(e))
    if not markers:
        return None
    others = sorted((e for e in events if not is_marker(e)), key=lambda e: e["ts"])
    last = max(e["ts"] + e["dur"] for e in events)
    out = {p: {"span": 0.0, "idle": 0.0, "idle_before": defaultdict(float)} for p in PHASES}
    for i, start in enumerate(markers):
        stop = markers[i + 1] if i + 1 < len(markers) else last
        inside = [dict(e, ts=max(e["ts"], start), dur=min(e["ts"] + e["dur"], stop) - max(e["ts"], start))
                  for e in others if e["ts"] < stop and e["ts"] + e["dur"] > start]
        phase = out[PHASES[i % len(PHASES)]]
        phase["span"] += (stop - start) / steps
        phase["idle"] += (stop - start - busy_us(inside)) / steps
        if inside:  # the interval from the marker to the first event, then those between events
            lead = [{"name": "marker", "cat": "gpu_memcpy", "ts": start, "dur": 0.0}]
            by_next, _ = idle_gaps(lead + inside, package)
            for kind, us in by_next.items():
                phase["idle_before"][kind] += us / steps
    for phase in out.values():
        phase["idle_before"] = dict(phase["idle_before"])
    return out


def busy_us(events: list[dict]) -> float:
    """Length of the union of the events' [ts, ts + dur) intervals, µs (streams may overlap)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        if start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def idle_intervals(events: list[dict]):
    """The GPU's idle intervals in time order, each as (µs, the name of the kernel that ran last
    before it, the event that ends it); an interval covered by a kernel on another stream is none."""
    ordered = sorted(events, key=lambda e: e["ts"])
    end, before = ordered[0]["ts"] + ordered[0]["dur"], ordered[0]["name"]
    for e in ordered[1:]:
        if e["ts"] > end:
            yield e["ts"] - end, before, e
        if e["ts"] + e["dur"] >= end:
            end, before = e["ts"] + e["dur"], e["name"]


def idle_gaps(events: list[dict], package: frozenset[str], top: int = 8) -> tuple[dict[str, float], list[list]]:
    """The GPU's idle intervals, each charged to the kind of the kernel that ends it (what the GPU
    waited for the host to issue): (µs by category, the ``top`` largest gaps as [µs, kernel before,
    kernel after])."""
    by_next: dict[str, float] = defaultdict(float)
    gaps = []
    for us, before, e in idle_intervals(events):
        by_next[categorize(e["name"], e["cat"], package)] += us
        gaps.append([us, before, e["name"]])
    return dict(by_next), sorted(gaps, reverse=True)[:top]


def idle_before_package(events: list[dict], package: frozenset[str]) -> dict[str, list[float]]:
    """The idle intervals that end at one of the package's kernels, by that kernel's name: name ->
    [µs, intervals]. Where the GPU waits for the host, this names the launches it waits for (a
    host-bound forward shows its preparation and attention launches here)."""
    out: dict[str, list[float]] = {}
    for us, _, e in idle_intervals(events):
        if categorize(e["name"], e["cat"], package) == "attention (package)":
            entry = out.setdefault(e["name"], [0.0, 0])
            entry[0] += us
            entry[1] += 1
    return out


def summarize(events: list[dict], steps: int, package: frozenset[str]) -> dict:
    """Per step: µs by category (``idle`` included), ``wall_us``, µs per kernel name
    (``kernels``: name -> [category, µs]), the idle time by the kind of kernel that ends each idle
    interval (``idle_before``), the same for the package's kernels by name (``idle_before_package``:
    name -> [µs, intervals], both per step), the largest idle intervals of the whole trace (``gaps``,
    µs) and :func:`phase_split`'s ``phases``. The phase markers count in ``phases`` only."""
    phases = phase_split(events, package, steps) if events else None
    events = [e for e in events if not is_marker(e)]
    if not events:
        raise ValueError("the trace holds no GPU events: was the step run on a GPU under the profiler?")
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[str, list] = {}
    for e in events:
        cat = categorize(e["name"], e["cat"], package)
        by_cat[cat] += e["dur"] / steps
        by_name.setdefault(e["name"], [cat, 0.0])[1] += e["dur"] / steps
    wall = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / steps
    by_cat["idle"] = wall - busy_us(events) / steps
    idle_before, gaps = idle_gaps(events, package)
    return {"wall_us": wall, "categories": {c: by_cat.get(c, 0.0) for c in CATEGORIES}, "kernels": by_name,
            "idle_before": {c: us / steps for c, us in idle_before.items()}, "gaps": gaps,
            "idle_before_package": {name: [us / steps, n / steps]
                                    for name, (us, n) in idle_before_package(events, package).items()},
            "phases": phases}


def profile_steps(model, context: int, vocab: int, warmup: int, steps: int) -> tuple[dict, float]:
    """(chrome trace of ``steps`` training steps after ``warmup``, host-clock ms per step)."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(context)).to("cuda")
    optimizer, _ = training_optimizer(model)
    mark = phase_marker()

    def step():  # one marker as each of PHASES starts
        mark()
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        mark()
        loss.backward()
        mark()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        host_ms = (time.perf_counter() - t0) * 1e3 / steps
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text()), host_ms


def _schedule_note(args) -> str:
    """The launch-schedule options set for the run (``recipe_names.add_schedule_options``), as a note."""
    schedule = getattr(args, "schedule", "")
    return f" (launch schedule set for this run: {schedule})" if schedule else ""


def render(env: dict, args, results: dict[str, dict]) -> str:
    base = results.get("sdpa")
    impls = list(results)
    lines = [f"# Training step by kernel kind: {args.model}, {args.context} tokens, eager, bf16", "",
             ", ".join(f"{k} {v}" for k, v in env.items()), "",
             f"`python benchmarks/step_profile.py --model {args.model} --context {args.context} "
             f"--attn {','.join(impls)} --steps {args.steps}`{_schedule_note(args)}; ms per step, mean of "
             f"{args.steps} profiled steps.", "",
             "| kind | " + " | ".join(impls) + " |" + (" " + " | ".join(f"{i} − sdpa" for i in impls if i != "sdpa")
                                                     + " |" if base else ""),
             "|---" * (len(impls) + (len(impls) - 1 if base else 0) + 1) + "|"]
    rows = [("step (host clock)", lambda r: r["host_ms"] * 1e3),
            ("step (first to last kernel)", lambda r: r["wall_us"])]
    rows += [(c, lambda r, c=c: r["categories"][c]) for c in CATEGORIES]
    for label, get in rows:
        cells = [f"{get(results[i]) / 1e3:.2f}" for i in impls]
        if base:
            cells += [f"{(get(results[i]) - get(base)) / 1e3:+.2f}" for i in impls if i != "sdpa"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for impl in impls:
        if impl == "sdpa" or not base:
            continue
        diffs = []
        for name in set(results[impl]["kernels"]) | set(base["kernels"]):
            cat, mine = results[impl]["kernels"].get(name, [None, 0.0])
            cat = cat or base["kernels"][name][0]
            if cat.startswith("attention"):
                continue
            delta = mine - base["kernels"].get(name, [cat, 0.0])[1]
            if abs(delta) >= args.diff_us:
                diffs.append((delta, cat, name))
        lines += ["", f"Kernels outside attention, {impl} − sdpa, |difference| ≥ {args.diff_us:g} µs per step:",
                  ""]
        lines += [f"- {d:+.0f} µs ({cat}) `{name[:110]}`"
                  for d, cat, name in sorted(diffs, reverse=True)] or ["- none"]
    kinds = [c for c in CATEGORIES if any(r.get("idle_before", {}).get(c) for r in results.values())]
    if kinds:
        lines += ["", "Idle time by the kind of kernel that ends it (what the GPU waited for), ms per step:", "",
                  "| next kernel | " + " | ".join(impls) + " |", "|---" * (len(impls) + 1) + "|"]
        lines += [f"| {c} | " + " | ".join(f"{results[i]['idle_before'].get(c, 0.0) / 1e3:.2f}" for i in impls) + " |"
                  for c in kinds]
    if all(results[i].get("phases") for i in impls):
        lines += ["", "By phase, ms per step: the GPU's span of the phase (marker to marker) and its idle time, "
                  "then that idle time by the kind of kernel ending it:", "",
                  "| phase | " + " | ".join(f"{i} span | {i} idle" for i in impls) + " | idle before, "
                  + "; ".join(impls) + " |", "|---" * (2 * len(impls) + 2) + "|"]
        for phase in PHASES:
            cells = [f"{results[i]['phases'][phase][k] / 1e3:.2f}" for i in impls for k in ("span", "idle")]
            before = "; ".join(", ".join(f"{c} {us / 1e3:.2f}" for c, us in sorted(
                results[i]["phases"][phase]["idle_before"].items(), key=lambda x: -x[1]) if us >= 10) or "-"
                for i in impls)
            lines.append(f"| {phase} | " + " | ".join(cells) + f" | {before} |")
    else:
        unsplit = ", ".join(i for i in impls if not results[i].get("phases"))
        lines += ["", f"By phase: not split (no marker copies of {MARKER_BYTES} bytes in the trace of {unsplit})."]
    for impl in impls:
        waits = sorted(((us, n, name) for name, (us, n) in results[impl].get("idle_before_package", {}).items()),
                       reverse=True)
        if waits:
            lines += ["", f"{impl}: idle time just before the package's kernels, by kernel (per step):", "",
                      "| kernel | idle µs | intervals | µs an interval |", "|---|---|---|---|"]
            lines += [f"| `{name[:60]}` | {us:.0f} | {n:.1f} | {us / n:.0f} |" for us, n, name in waits]
    for impl in impls:
        lines += ["", f"{impl}: the largest idle intervals of the {args.steps} steps "
                  "(µs, kernel before → after):", ""]
        lines += [f"- {us:.0f}: `{a[:60]}` → `{b[:60]}`" for us, a, b in results[impl].get("gaps", [])] or ["- none"]
    for impl in impls:
        top = sorted(((us, name) for name, (cat, us) in results[impl]["kernels"].items()
                      if cat.startswith("attention")), reverse=True)[:12]
        lines += ["", f"{impl}: attention kernels, µs per step:", ""]
        lines += [f"- {us:.0f} `{name[:110]}`" for us, name in top] or ["- none"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=list(MODELS), default="llama0.9b")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--attn", default="sdpa,fp8_delta,fp8_delta_fast")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="profiled steps")
    p.add_argument("--diff-us", type=float, default=50.0, help="list kernels whose time per step differs by this")
    p.add_argument("--tag", default=None)
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    add_schedule_options(p)
    args = p.parse_args(argv)
    args.schedule = apply_schedule_options(p, args)
    if not torch.cuda.is_available():
        raise SystemExit("step_profile.py profiles CUDA kernels: it needs a GPU")
    impls = [x for x in args.attn.split(",") if x]
    register_attention(impls)
    env = run_environment("cuda", torch.bfloat16)
    package = package_kernel_names()
    config = model_config(args.model, tiny=False)
    results = {}
    for impl in impls:
        model = build_model(config, impl, device="cuda", seed=0)
        model.train()
        trace, host_ms = profile_steps(model, args.context, config.vocab_size, args.warmup, args.steps)
        results[impl] = {**summarize(gpu_events(trace), args.steps, package), "host_ms": host_ms}
        print(f"{impl}: {host_ms:.1f} ms per step, GPU idle {results[impl]['categories']['idle'] / 1e3:.2f} ms",
              flush=True)
        del model, trace
        torch.cuda.empty_cache()
    tag = args.tag or f"step_profile_{args.model}_s{args.context}"
    write_results(args.out_dir, tag, render(env, args, results), {"env": env, "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
