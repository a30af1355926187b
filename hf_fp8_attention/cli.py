"""``python -m hf_fp8_attention {check,bench,demo}``.

* ``check``: what this machine supports (GPU, FP8 tensor cores, Triton, versions), which path runs
  (Triton kernels or PyTorch emulation), and a quick numerics self-test against fp64 attention.
* ``bench``: runs ``benchmarks/bench_attention.py`` (CUDA GPU only), passing arguments through.
* ``demo``: the main job — sdpa, fp8_stale and fp8_delta trained side by side (see training/demo.py).
"""
from __future__ import annotations

import argparse
import importlib
import platform
import subprocess
import sys
from pathlib import Path

import torch

# Self-test bounds: the package's FP8 error budget and matched-residual bound, defined and justified
# once in diagnostics.py (a broken path, e.g. a wrong mask or a dropped scale, gives O(1) errors).


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "installed")
    except Exception as err:  # noqa: BLE001  (report any import failure, do not crash check)
        return f"not available ({type(err).__name__})"


def _self_test(device: torch.device) -> tuple[bool, list[str]]:
    """fp8_delta and fp8_stale on a causal GQA problem vs fp64 attention; returns (ok, report lines)."""
    from . import RECIPES, fp8_attention
    from .diagnostics import FP8_ERROR_BUDGET, MATCHED_ROW_SUM_RESIDUAL_MAX, diagnose
    from .exact import exact_attention_grads
    from .masking import MaskSpec

    gen = torch.Generator().manual_seed(0)
    shape_q, shape_kv = (1, 4, 256, 64), (1, 2, 256, 64)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, dout = (torch.randn(shape_q, generator=gen).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(shape_kv, generator=gen).to(device, dtype) for _ in range(2))
    ref = dict(zip(("out", "dq", "dk", "dv"), exact_attention_grads(q, k, v, dout, mask=MaskSpec(causal=True))))
    ok, lines = True, []
    for name in ("fp8_delta", "fp8_stale"):
        qq, kk, vv = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out = fp8_attention(qq, kk, vv, causal=True, config=RECIPES[name])
        out.backward(dout)
        got = {"out": out.detach(), "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}
        errs = {key: float((got[key].double() - ref[key]).norm() / ref[key].norm()) for key in ref}
        finite = all(bool(torch.isfinite(t).all()) for t in got.values())
        residual = diagnose(q, k, v, dout, config=RECIPES[name], causal=True).median_row_sum_residual
        passed = finite and all(errs[key] <= FP8_ERROR_BUDGET[key] for key in errs)
        if name == "fp8_delta":
            passed = passed and residual <= MATCHED_ROW_SUM_RESIDUAL_MAX
        ok &= passed
        lines.append(f"  {name:<9} rel.err out {errs['out']:.3f} dq {errs['dq']:.3f} dk {errs['dk']:.3f} "
                     f"dv {errs['dv']:.3f}   row-sum residual {residual:.1e}   {'PASS' if passed else 'FAIL'}")
    return ok, lines


def cmd_check(args) -> int:
    from . import FP8AttentionConfig
    from .ops import select_backend

    print(f"hf_fp8_attention {_version('hf_fp8_attention')} | python {platform.python_version()} | "
          f"torch {torch.__version__} | transformers {_version('transformers')} | triton {_version('triton')}")
    print(f"optional: accelerate {_version('accelerate')} | peft {_version('peft')} | datasets {_version('datasets')}")
    if torch.cuda.is_available():
        device = torch.device("cuda")
        cap = torch.cuda.get_device_capability()
        fp8 = cap >= (8, 9)
        print(f"GPU: {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]}), FP8 tensor cores: {'yes' if fp8 else 'no'}")
    else:
        device = torch.device("cpu")
        print("GPU: none (CUDA not available)")
    try:
        backend = select_backend(device, FP8AttentionConfig())
        print(f"path used on {device.type}: {backend.value}"
              + ("" if backend.value == "triton" else " (PyTorch emulation: numerically the recipe, not fast)"))
    except Exception as err:  # noqa: BLE001  (report the reason; the self-test below still runs)
        print(f"path used on {device.type}: unavailable ({err})")
    from transformers import AttentionInterface

    registered = [n for n in ("fp8_delta", "fp8_stale") if n in AttentionInterface._global_mapping]
    print(f"Transformers attention backends registered: {', '.join(registered) or 'none'}")
    print("numerics self-test (causal, GQA 4:2, S=256, d=64, vs fp64 attention):")
    ok, lines = _self_test(device)
    print("\n".join(lines))
    print("self-test:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


BENCH_USAGE = ("usage: python -m hf_fp8_attention bench [ARGS ...]\n\n"
               "Runs benchmarks/bench_attention.py (source checkout, CUDA GPU only), passing ARGS through.")


def cmd_bench(args, passthrough: list[str]) -> int:
    from .training.errors import UsageError

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_attention.py"
    if "-h" in passthrough or "--help" in passthrough:  # help works on any machine
        print(BENCH_USAGE)
        if not script.exists():
            print(f"({script} is not here: the benchmark ships with the source checkout)")
            return 0
        print("Its options:\n", flush=True)
        return subprocess.call([sys.executable, str(script), "--help"])
    if not torch.cuda.is_available():
        raise UsageError("bench needs a CUDA GPU (none found); the emulation is not worth timing")
    if not script.exists():
        raise UsageError(f"bench: {script} not found (the benchmark ships with the source checkout)")
    return subprocess.call([sys.executable, str(script), *passthrough])


def cmd_demo(args) -> int:
    from .training.demo import TOKENS_PER_S_NOTE, DemoSettings, format_table, run_demo
    from .training.errors import UsageError

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: CUDA is not available on this machine")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    settings = DemoSettings.for_device(device, tiny=args.tiny)
    for field in ("steps", "seq_len", "batch_size", "lr", "family", "corpus_bytes"):
        value = getattr(args, field)
        if value is not None:
            if field in ("steps", "seq_len", "batch_size", "corpus_bytes") and value < 1:
                raise UsageError(f"--{field.replace('_', '-')} must be positive, got {value}")
            setattr(settings, field, value)
    if args.attns:
        settings.attns = tuple(args.attns)
    print(f"demo on {device}: {settings.family}-{settings.size}, {settings.steps} steps x {settings.batch_size} x "
          f"{settings.seq_len} tokens; runs: {', '.join(settings.attns)}")
    if args.no_progress:
        import datasets

        datasets.disable_progress_bars()
    summary = run_demo(settings, args.out_dir, device, progress=not args.no_progress)
    print("\n=== summary ===")
    print(format_table(summary))
    print(f"\nloss curves: {summary['plot']}\nsummary: {Path(args.out_dir) / 'summary.json'}")
    print(TOKENS_PER_S_NOTE)
    print("row-sum residual: median over query rows of |sum_j dS_ij| / sum_j P_ij|dP_ij| for the run's FP8 "
          "backward replayed on the trained model's real attention inputs and gradients (0 = exact).")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hf_fp8_attention",
        description="Block-scaled FP8 attention for Transformers: check this machine, benchmark, or run the demo.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="environment, path used, numerics self-test")
    sub.add_parser("bench", help="run benchmarks/bench_attention.py (CUDA only); extra args pass through",
                   add_help=False)
    from .training.demo import DemoSettings

    gpu, cpu = DemoSettings.for_device(torch.device("cuda")), DemoSettings.for_device(torch.device("cpu"))

    def default(field: str) -> str:
        a, b = getattr(gpu, field), getattr(cpu, field)
        a, b = ("whole stdlib" if a is None else a), ("whole stdlib" if b is None else b)
        return f"default: {a}" if a == b else f"default: {a} on a GPU, {b} on CPU/--tiny"

    demo = sub.add_parser(
        "demo", help="train sdpa / fp8_stale / fp8_delta side by side",
        description="Train one small model three times (sdpa, fp8_stale, fp8_delta) on the same batches and "
                    "print final/eval loss, tokens/s and the backward's row-sum residual side by side. On a GPU: "
                    f"{gpu.family}-{gpu.size}; on CPU (or --tiny): {cpu.family}-{cpu.size}, a minute or two.")
    demo.add_argument("--out-dir", default="outputs/demo", help="where loss_curves.png and summary.json go "
                                                                "(default: %(default)s)")
    demo.add_argument("--tiny", action="store_true", help="the tiny CPU setting even on a GPU")
    demo.add_argument("--device", choices=("cpu", "cuda"), default=None,
                      help="default: cuda when available, else cpu")
    demo.add_argument("--steps", type=int, help=f"optimizer steps per run ({default('steps')})")
    demo.add_argument("--seq-len", type=int, help=f"tokens per sequence ({default('seq_len')})")
    demo.add_argument("--batch-size", type=int, help=f"sequences per step ({default('batch_size')})")
    demo.add_argument("--lr", type=float, help=f"peak learning rate, cosine schedule ({default('lr')})")
    demo.add_argument("--family", choices=("llama", "mistral", "qwen2", "qwen3"),
                      help=f"model family ({default('family')})")
    demo.add_argument("--corpus-bytes", type=int,
                      help=f"cap on the default corpus (the stdlib sources) in bytes ({default('corpus_bytes')})")
    demo.add_argument("--attns", nargs="+", metavar="ATTN",
                      help=f"subset/order of the runs (default: {' '.join(cpu.attns)})")
    demo.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    from .training.errors import UsageError

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if argv and argv[0] == "bench":
        args, passthrough = parser.parse_args(argv[:1]), argv[1:]
    else:
        args, passthrough = parser.parse_args(argv), []
    try:
        if args.command == "check":
            return cmd_check(args)
        if args.command == "bench":
            return cmd_bench(args, passthrough)
        return cmd_demo(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
