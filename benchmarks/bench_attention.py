"""Time FP8 attention (fp8_delta / fp8_stale) against PyTorch SDPA bf16 (flash and cuDNN backends).

One run on one GPU. Shapes: S in --seqlens at a fixed --tokens per batch (B = tokens // S), heads
--heads, head dims --dims, causal and not; q, k, v bf16 (B, H, S, D) contiguous. ``--gqa G``: k and
v with H / G heads (grouped-query attention, as most models' layers; SDPA with ``enable_gqa``).

Modes (--modes): ``fwd`` (forward only; our time includes quantizing the bf16 inputs), ``bwd``
(backward only, via autograd of the public ``fp8_attention`` / SDPA), ``fwdbwd`` (both). Our
backward modes run only when the Triton FP8 backward kernel is importable (the emulation is far
too slow and large at these shapes); "n/a" otherwise. ``--memory`` adds the peak memory of one
training step (forward + backward of the attention op alone, over what the inputs already hold).

FLOPs: forward 4·B·H·S²·D (halved under a causal mask), backward 2.5x forward, fwd+bwd 3.5x.
Timing: triton.testing.do_bench, median, inputs ~ 100s of MB (far above the 50 MB L2); with
``--timer graph``, triton.testing.do_bench_cudagraph instead: the calls replayed from a CUDA graph,
so the GPU's time without the host's (which, on a busy host, moved the 2 x 8k cells by up to 1.6x
between passes; benchmarks/NOTES.md). The whole
grid is timed --passes times, each shape's implementations back to back within a pass; the table
reports, per cell, the median over the passes after the first (the first also warms the clocks and
compiles; with one pass, that pass), and each ratio as the median of the per-pass ratios, so a
drift common to both sides of a ratio cancels. The JSON keeps every pass's median
(``ms_passes``), so run-to-run spread is on record. Forward-only rows at S <= 2k sit near the
host's issue time (~0.27 ms per call against 0.34-0.59 ms of GPU time): when the host is slow they
time the host, and they varied by up to 30% between passes (benchmarks/NOTES.md, "Host time").

Writes ``<out-dir>/<tag>.md`` and ``.json`` with the GPU name and torch / triton / CUDA / cuDNN
versions, and prints the table last.

    python benchmarks/bench_attention.py                         # forward, the full grid
    python benchmarks/bench_attention.py --modes fwd,bwd,fwdbwd --memory
    python benchmarks/bench_attention.py --dims 256 --heads 8 --modes fwd,fwdbwd   # Gemma 2/3's head dim
    python benchmarks/bench_attention.py --configs fp8_delta,fp8_delta+softcap,fp8_delta+sinks
    python benchmarks/bench_attention.py --quant-launch maxnreg=None,row_stages=None   # another table
    python benchmarks/bench_attention.py --stats-launch stages=None   # another statistics table
    python benchmarks/bench_attention.py --memory --modes fwdbwd --backward-chunks 2   # the backward in chunks
    python benchmarks/bench_attention.py --tokens 8192 --seqlens 8192 --heads 16 --gqa 2 --modes fwdbwd  # Llama 0.89B

A config name may carry logit modifiers after ``+``: ``softcap`` (cap 50, Gemma 2's) and ``sinks``
(one sink logit per head, GPT-OSS's), so their cost shows beside the plain recipe; SDPA runs without
them. ``+dq_in_stats`` switches that recipe option on (``fp8_delta_fast+dq_in_stats``).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_fp8_attention import RECIPES, SUPPORTED_HEAD_DIMS, fp8_attention  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_accumulation import add_accumulation_option, apply_accumulation_option  # noqa: E402
from recipe_names import (CONFIG_FLAGS, SCHEDULE_FLAGS, add_schedule_options, apply_launch_tables,  # noqa: E402
                          apply_schedule_options, fresh_memory_peak, recipe_config)

FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
SDPA_BACKENDS = ("cudnn", "flash", "cudnn_fp8")
TIMERS = ("eager", "graph")
LOGIT_MODS = ("softcap", "sinks")
SOFTCAP = 50.0  # Gemma 2's attn_logit_softcapping


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", type=_csv(int), default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch (B = tokens // S)")
    p.add_argument("--heads", type=_csv(int), default=[16, 32])
    p.add_argument("--gqa", type=int, default=1, help="query heads per key/value head (each of --heads divisible)")
    p.add_argument("--dims", type=_csv(int), default=[64, 128])
    p.add_argument("--causal", type=_csv(lambda x: x.lower() in ("1", "true", "yes")), default=[True, False])
    p.add_argument("--modes", type=_csv(str), default=["fwd"])
    p.add_argument("--configs", type=_csv(str), default=["fp8_delta", "fp8_stale"])
    p.add_argument("--sdpa", type=_csv(str), default=["cudnn", "flash"],
                   help="baselines: cudnn and flash (PyTorch SDPA bf16), cudnn_fp8 (cuDNN's own FP8 SDPA through "
                        "cudnn-frontend: cudnn_fp8_sdpa.py)")
    p.add_argument("--memory", action="store_true", help="peak memory of one fwd+bwd per shape")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=100, help="do_bench repetitions, ms")
    p.add_argument("--timer", choices=TIMERS, default="eager",
                   help="eager: do_bench (the host's launch time included where the GPU waits for it); "
                        "graph: do_bench_cudagraph (the GPU's time)")
    p.add_argument("--passes", type=int, default=3,
                   help="times the grid is timed; the table gives the median over the passes after the first")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--tag", default=None, help="results file name (default: gpu name + date)")
    p.add_argument("--quant-launch", default="", metavar="KEY=VALUE,...",
                   help="entries of quantize.ROTATED_LAUNCH for this run (e.g. maxnreg=None,row_stages=None)")
    p.add_argument("--stats-launch", default="", metavar="KEY=VALUE,...",
                   help="entries of sequence_stats.ROTATED_PARTIALS for this run (e.g. stages=None)")
    add_schedule_options(p)
    add_accumulation_option(p)
    args = p.parse_args(argv)
    apply_launch_tables(p, args.quant_launch, args.stats_launch)
    args.schedule = apply_schedule_options(p, args)
    args.accumulation = apply_accumulation_option(p, args)
    bad = set(args.modes) - set(FLOP_FACTOR)
    if bad:
        p.error(f"unknown modes {sorted(bad)}; choose from {sorted(FLOP_FACTOR)}")
    bad = {c.split("+")[0] for c in args.configs} - set(RECIPES)
    # (field=value parts, e.g. +block_k=256, recipe_config checks below)
    bad |= {m for c in args.configs for m in c.split("+")[1:] if "=" not in m} - set(LOGIT_MODS) - set(CONFIG_FLAGS)
    if bad:
        p.error(f"unknown configs or modifiers {sorted(bad)}; choose from {sorted(RECIPES)}, "
                f"each optionally with +{' / +'.join((*LOGIT_MODS, *CONFIG_FLAGS))} or +field=value")
    for c in args.configs:
        try:
            recipe_config(c, skip=LOGIT_MODS)
        except ValueError as err:
            p.error(f"--configs {c}: {err}")
    bad = set(args.dims) - set(SUPPORTED_HEAD_DIMS)
    if bad:
        p.error(f"unsupported head dims {sorted(bad)}; choose from {list(SUPPORTED_HEAD_DIMS)}")
    bad = set(args.sdpa) - set(SDPA_BACKENDS)
    if bad:
        p.error(f"unknown SDPA backends {sorted(bad)}; choose from {', '.join(SDPA_BACKENDS)}")
    if args.passes < 1:
        p.error(f"--passes must be at least 1, got {args.passes}")
    if args.timer == "graph" and "cudnn_fp8" in args.sdpa:
        p.error("--timer graph: the cudnn_fp8 baseline times its own graphs (cudnn_fp8_sdpa.py); "
                "run it with --timer eager")
    if args.gqa < 1 or any(h % args.gqa for h in args.heads):
        p.error(f"--gqa must be at least 1 and divide every --heads value, got {args.gqa} for heads {args.heads}")
    return args


def fp8_backward_available() -> tuple[bool, str]:
    try:
        from hf_fp8_attention.kernels.backward import triton_backward  # noqa: F401
    except Exception as err:  # noqa: BLE001
        return False, f"{type(err).__name__}: {err}"
    return True, ""


def flops(mode, b, h, s, d, causal):
    fwd = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return fwd * FLOP_FACTOR[mode]


class _CudnnFp8:
    """cuDNN's FP8 SDPA as a baseline: one :class:`cudnn_fp8_sdpa.CudnnFp8Attention` per shape (its graphs
    built once), timed on FP8 inputs prepared outside the timing (that module's docstring)."""

    def __init__(self, causal):
        self.causal = causal
        self.built = {}

    def attention(self, q, k, v):
        import cudnn_fp8_sdpa

        key = (tuple(q.shape), tuple(k.shape))
        if key not in self.built:
            gen = torch.Generator(device="cuda").manual_seed(1)
            dout = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=gen)
            self.built[key] = cudnn_fp8_sdpa.CudnnFp8Attention(q, k, v, self.causal, dout)
        return self.built[key]

    def time(self, mode, q, k, v, warmup, rep):
        from triton.testing import do_bench

        return do_bench(self.attention(q, k, v).runner(mode), warmup=warmup, rep=rep, return_mode="median")


def _sdpa_fn(backend_name, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend_name == "cudnn_fp8":
        return _CudnnFp8(causal)

    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend_name]

    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])

    return run


def _ours_fn(name, causal):
    """``name``: a recipe, optionally with ``+softcap`` / ``+sinks`` / ``+dq_in_stats`` (module docstring)."""
    mods = name.split("+")[1:]
    cfg = recipe_config(name, skip=LOGIT_MODS)
    softcap = SOFTCAP if "softcap" in mods else None
    sinks = {}  # per head count, made once: (H,) fp32 sink logits

    def run(q, k, v):
        if "sinks" in mods and q.shape[1] not in sinks:
            gen = torch.Generator(device=q.device).manual_seed(0)
            sinks[q.shape[1]] = torch.randn(q.shape[1], device=q.device, generator=gen).requires_grad_()
        return fp8_attention(q, k, v, causal=causal, config=cfg, softcap=softcap, sinks=sinks.get(q.shape[1]))

    return run


def _median_ms(fn, warmup: int, rep: int, timer: str, grad_to_none=None) -> float:
    """Median ms of ``fn()``: triton.testing.do_bench (``timer`` "eager") or do_bench_cudagraph
    ("graph": ``fn`` captured and replayed, so no host time; ``warmup`` unused, it warms up once)."""
    from triton.testing import do_bench, do_bench_cudagraph

    if timer == "graph":
        return do_bench_cudagraph(fn, rep=rep, grad_to_none=grad_to_none, return_mode="median")
    return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")


def _time(impl, mode, q, k, v, warmup, rep, timer="eager"):
    """Median ms of ``mode`` for ``impl(q, k, v)`` (:func:`_median_ms`), from a fresh memory peak
    (:func:`recipe_names.fresh_memory_peak`): a lone call's path, as :func:`_peak_step_mib` measures it."""
    fresh_memory_peak()
    if isinstance(impl, _CudnnFp8):
        return impl.time(mode, q, k, v, warmup, rep)
    if mode == "fwd":
        with torch.no_grad():
            return _median_ms(lambda: impl(q, k, v), warmup, rep, timer)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    if mode == "bwd":
        out = impl(qg, kg, vg)
        return _median_ms(lambda: out.backward(dout, retain_graph=True), warmup, rep, timer, [qg, kg, vg])
    return _median_ms(lambda: impl(qg, kg, vg).backward(dout), warmup, rep, timer, [qg, kg, vg])


def _peak_step_mib(impl, q, k, v):
    """Peak memory (MiB) of one forward+backward over what q, k, v, dout already hold."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    fresh_memory_peak()
    base = torch.cuda.memory_allocated()
    impl(qg, kg, vg).backward(dout)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def environment() -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name(),
        "capability": "sm_%d%d" % torch.cuda.get_device_capability(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "python": platform.python_version(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }


def run(args) -> tuple[dict, list[dict]]:
    env = environment()
    bwd_ok, bwd_why = fp8_backward_available()
    env["fp8_backward_kernel"] = "available" if bwd_ok else f"unavailable ({bwd_why})"
    rows = []
    earlier = {}  # (shape, key) -> ms of the earlier passes
    shapes = [(d, causal, h, s) for d in args.dims for causal in args.causal for h in args.heads for s in args.seqlens]
    for pass_no in range(1, args.passes + 1):
        last_pass = pass_no == args.passes
        for d, causal, h, s in shapes:
            b = max(args.tokens // s, 1)
            gen = torch.Generator(device="cuda").manual_seed(s + h + d)
            q, k, v = (torch.randn(b, heads, s, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                       for heads in (h, h // args.gqa, h // args.gqa))
            impls = {f"sdpa_{n}": _sdpa_fn(n, causal) for n in args.sdpa}
            impls.update({name: _ours_fn(name, causal) for name in args.configs})
            row = {"B": b, "H": h, "Hkv": h // args.gqa, "S": s, "D": d, "causal": causal}
            for mode in args.modes:
                for name, impl in impls.items():
                    key = f"{name}/{mode}"
                    if name.startswith("fp8") and mode != "fwd" and not bwd_ok:
                        row[key] = None
                        continue
                    past = earlier.setdefault((d, causal, h, s, key), [])
                    try:
                        past.append(_time(impl, mode, q, k, v, args.warmup, args.rep, args.timer))
                        ms = statistics.median(x for x in reported_passes(past) if x is not None)
                        row[key] = {"ms": ms, "tflops": flops(mode, b, h, s, d, causal) / ms * 1e-9,
                                    "ms_passes": list(past)}
                    except Exception as err:  # noqa: BLE001 (an unsupported SDPA backend: record it)
                        past.append(None)  # keeps the passes aligned with the other implementations'
                        row[key] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
            if not last_pass:  # its rows are printed in the last pass; say how far this one got
                print(f"pass {pass_no} of {args.passes}: S={s} H={h} D={d} causal={causal} timed", flush=True)
                del q, k, v
                continue
            if "cudnn_fp8" in args.sdpa:  # what the baseline computed, so that a wrong mask or scale shows
                try:
                    found = impls["sdpa_cudnn_fp8"].attention(q, k, v)
                    row["sdpa_cudnn_fp8/check"] = {"o_dtype": str(found.o_dtype).replace("torch.", ""),
                                                   "refused": found.refused, **found.errors()}
                except Exception as err:  # noqa: BLE001
                    row["sdpa_cudnn_fp8/check"] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
            if args.memory:
                for name, impl in impls.items():
                    if isinstance(impl, _CudnnFp8) or (name.startswith("fp8") and not bwd_ok):
                        row[f"{name}/peak_mib"] = None  # not an autograd op, or no FP8 backward kernel
                        continue
                    try:
                        row[f"{name}/peak_mib"] = _peak_step_mib(impl, q, k, v)
                    except Exception as err:  # noqa: BLE001
                        row[f"{name}/peak_mib"] = f"{type(err).__name__}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            del q, k, v
    env["forward_autotune"] = _autotune_choices()
    return env, rows


def _autotune_choices() -> dict:
    """The launch configuration the forward's autotuner picked per key (empty if pinned)."""
    try:
        from hf_fp8_attention.kernels.forward import FORWARD_TUNER
    except Exception:  # noqa: BLE001
        return {}
    return {str(key): "BLOCK_M={}, num_warps={}, num_stages={}".format(*cfg) for key, cfg in FORWARD_TUNER.choices.items()}


def _cell(row, key, field="tflops"):
    val = row.get(key)
    if val is None:
        return "n/a"
    if "error" in val:
        return "err"
    return f"{val[field]:.0f}"


def reported_passes(values: list) -> list:
    """The passes a cell reports: all but the first (it warms the clocks and compiles), or the one."""
    return values[1:] if len(values) > 1 else values


def paired_ratio(ours_ms: list, ref_ms: list) -> float:
    """Speed of ours over the reference: the median over the reported passes of ref_ms / ours_ms,
    each pass's pair timed back to back (a drift that slows both sides of one pass cancels). A pass
    where either side failed (None) pairs with nothing; NaN when no pass has both."""
    if len(ours_ms) != len(ref_ms):
        raise ValueError(f"paired_ratio: {len(ours_ms)} passes of ours against {len(ref_ms)} of the reference")
    pairs = [(o, r) for o, r in zip(reported_passes(ours_ms), reported_passes(ref_ms))
             if o is not None and r is not None]
    return statistics.median(r / o for o, r in pairs) if pairs else float("nan")


def _ratio(row, key, ref):
    a, b = row.get(key), row.get(ref)
    if not a or not b or "error" in a or "error" in b:
        return "n/a"
    ratio = paired_ratio(a["ms_passes"], b["ms_passes"])
    return "n/a" if math.isnan(ratio) else f"{ratio:.2f}"


def _shape_head(args) -> list[str]:
    """A table's shape columns; ``Hkv`` only with ``--gqa``."""
    return ["causal", "H"] + (["Hkv"] if args.gqa > 1 else []) + ["D", "S", "B"]


def _shape_cells(row, args) -> list[str]:
    return [str(row[key]) for key in _shape_head(args)]


def render(env, rows, args) -> str:
    lines = [f"# FP8 attention benchmark — {env['gpu']} ({env['capability']})", ""]
    lines.append(f"torch {env['torch']} · triton {env['triton']} · CUDA {env['cuda']} · cuDNN {env['cudnn']} · "
                 f"python {env['python']} · {env['date_utc']} UTC · {args.tokens} tokens per batch · "
                 f"FP8 backward kernel: {env['fp8_backward_kernel']}")
    if args.quant_launch:
        lines += ["", f"Quantization launch table set for this run: `{args.quant_launch}`"]
    if args.stats_launch:
        lines += ["", f"Statistics launch table set for this run: `{args.stats_launch}`"]
    if args.schedule:
        lines += ["", f"Launch schedule set for this run: {args.schedule} ({SCHEDULE_FLAGS})"]
    if args.accumulation:
        lines += ["", f"Kernels compiled with {args.accumulation} (`--promote-accumulation`)"]
    if env.get("forward_autotune"):
        lines.append("")
        lines.append("Forward autotuner choices: " + "; ".join(f"`{k}` -> `{v}`" for k, v in env["forward_autotune"].items()))
    lines.append("")
    lines.append("TFLOP/s (forward 4·B·H·S²·D, halved when causal; backward 2.5x; fwd+bwd 3.5x). "
                 "Ratios: ours / SDPA cuDNN (x cudnn) and ours / SDPA flash (x flash). "
                 + (f"Medians of do_bench ({args.warmup} ms warm-up, {args.rep} ms); " if args.timer == "eager" else
                    f"Medians of do_bench_cudagraph ({args.rep} ms of CUDA-graph replays: GPU time, no host); ")
                 + (f"each cell the median of passes 2-{args.passes} of {args.passes}, each ratio the median of "
                    "those passes' ratios (each pass times a shape's implementations back to back)."
                    if args.passes > 1 else "one pass."))
    for mode in args.modes:
        lines += ["", f"## {mode}", ""]
        head = _shape_head(args) + [f"sdpa_{n}" for n in args.sdpa]
        for name in args.configs:
            head += [name] + [f"x {n}" for n in args.sdpa]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for r in rows:
            cells = _shape_cells(r, args)
            cells += [_cell(r, f"sdpa_{n}/{mode}") for n in args.sdpa]
            for name in args.configs:
                cells.append(_cell(r, f"{name}/{mode}"))
                cells += [_ratio(r, f"{name}/{mode}", f"sdpa_{n}/{mode}") for n in args.sdpa]
            lines.append("| " + " | ".join(cells) + " |")
    if "cudnn_fp8" in args.sdpa:
        errs = ("o", "dq", "dk", "dv")
        lines += ["", "## cuDNN FP8 SDPA baseline (sdpa_cudnn_fp8)", "",
                  "cuDNN's kernels alone: its inputs handed over in FP8 with one scale per tensor, so the amax "
                  "and casts a training step adds are not in its times (ours include our quantization). Its O "
                  "and gradients against float32 attention on the same bf16 inputs (relative Frobenius error):", "",
                  "| " + " | ".join(_shape_head(args) + ["outputs"] + [f"{e} error" for e in errs]) + " |",
                  "|" + "---|" * (len(_shape_head(args)) + 1 + len(errs))]
        for r in rows:
            check = r.get("sdpa_cudnn_fp8/check", {})
            cells = ([check["error"]] + [""] * len(errs) if "error" in check else
                     [check.get("o_dtype", "n/a")] + [f"{check.get(f'{e}_rel_err', float('nan')):.4f}" for e in errs])
            lines.append("| " + " | ".join(_shape_cells(r, args) + cells) + " |")
    if args.memory:
        names = [f"sdpa_{n}" for n in args.sdpa] + list(args.configs)
        head = _shape_head(args) + names
        lines += ["", "## peak memory of one fwd+bwd step (MiB over inputs)", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            vals = []
            for n in names:
                v = r.get(f"{n}/peak_mib")
                vals.append("n/a" if v is None else (f"{v:.0f}" if isinstance(v, float) else str(v)))
            lines.append("| " + " | ".join(_shape_cells(r, args) + vals) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention: needs a CUDA GPU", file=sys.stderr)
        return 2
    env, rows = run(args)
    text = render(env, rows, args)
    tag = args.tag or (env["gpu"].replace(" ", "_").lower() + "_" + env["date_utc"][:10])
    write_results(args.out_dir, tag, text, {"env": env, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows})
    return 0


def write_results(out_dir, tag: str, text: str, data: dict, quiet: bool = False) -> None:
    """Write ``<out_dir>/<tag>.md`` (the table) and ``.json`` (``data``), and print the table
    unless ``quiet``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{tag}.md").write_text(text)
    (out / f"{tag}.json").write_text(json.dumps(data, indent=1))
    if not quiet:
        print(text)


if __name__ == "__main__":
    sys.exit(main())
