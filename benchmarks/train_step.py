"""End to end: one training step (forward, backward, AdamW step) of a Llama built from a config.

Two model shapes, both built from a ``LlamaConfig`` (no download), bf16, gradient checkpointing off:

- ``llama0.9b``: hidden 2048, 16 layers, 16 query / 8 kv heads, head_dim 128, MLP 5632, vocab 32000
  (untied embeddings: about 0.89B parameters), at 4k, 8k and 16k tokens;
- ``smollm2``: the SmolLM2-135M shape: hidden 576, 30 layers, 9 query / 3 kv heads, head_dim 64,
  MLP 1536, vocab 49152, tied embeddings, at 2k and 8k tokens.

For each attention implementation (``sdpa`` and the FP8 recipes) and each mode (eager;
``compile``: ``torch.compile(model, dynamic=False)``, the whole model with its loss, the optimizer
step eager; ``cudagraphs``: the same with ``mode="reduce-overhead"``, which replays the step's
kernels as CUDA graphs, so a model whose layers wait for the host's launches runs at its GPU
time), the model is rebuilt with the same seed; each context length gets a fresh fused AdamW.
One batch is one sequence of ``context`` random tokens (tokens per step = context), labels = inputs.
After ``--warmup`` steps (the first one compiles, and its time is reported), ``--steps`` steps are
timed with CUDA events; the table gives tokens/s from the median step, the ratio to ``sdpa`` at the
same (model, context, mode) and the peak memory of the run (``torch.cuda.max_memory_allocated``
after a reset). Out of memory is reported per configuration and the run goes on.

    python benchmarks/train_step.py                       # everything, one run
    python benchmarks/train_step.py --models smollm2 --modes eager --attn sdpa,fp8_delta
    python benchmarks/train_step.py --tiny                # 2-layer models at 256 tokens (smoke test)
    python benchmarks/train_step.py --tag T --max-minutes 8 [--resume]   # the grid over several jobs

Without CUDA only ``--tiny`` runs (on CPU in fp32: the FP8 recipes then run their PyTorch
emulation, so the numbers say nothing about speed). Writes ``<out-dir>/<tag>.md`` / ``.json``,
after every model build. The whole grid takes longer than one 10-minute job: ``--max-minutes``
stops before the next build, and ``--resume`` keeps what ``<tag>.json`` holds (from the same GPU
and software only) and measures the rest; each row records when it was measured.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_fp8_attention  # noqa: E402,F401  (registers fp8_delta / fp8_stale)
from hf_fp8_attention import RECIPES, register_fp8_attention  # noqa: E402
from hf_fp8_attention.integration import DEFAULT_BACKENDS  # noqa: E402
from bench_attention import environment, write_results  # noqa: E402
from model_step import build_model  # noqa: E402
from recipe_names import (SCHEDULE_FLAGS, add_schedule_options, apply_schedule_options,  # noqa: E402
                          recipe_config)

MODELS = {
    "llama0.9b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128, intermediate_size=5632, vocab_size=32000, tie_word_embeddings=False),
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True),
}
# --tiny: the same head layout (heads, kv heads, head_dim), 2 layers, small hidden / MLP / vocab.
TINY = {
    "llama0.9b": dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512, vocab_size=1024),
    "smollm2": dict(hidden_size=288, num_hidden_layers=2, intermediate_size=512, vocab_size=1024),
}
CONTEXTS = {"llama0.9b": (4096, 8192, 16384), "smollm2": (2048, 8192)}
TINY_CONTEXTS = (256,)
ATTN = ("sdpa", "fp8_delta", "fp8_delta_fast", "fp8_stale")
MODES = ("eager", "compile", "cudagraphs")
DEFAULT_MODES = ("eager", "compile")  # the whole grid's; cudagraphs when asked for


def _csv(kind=str):
    return lambda text: [kind(x) for x in text.split(",") if x]


def model_config(name: str, tiny: bool) -> LlamaConfig:
    fields = {**MODELS[name], **(TINY[name] if tiny else {})}
    return LlamaConfig(**fields, max_position_embeddings=32768, attention_dropout=0.0, use_cache=False)


def register_attention(names) -> None:
    """Register every FP8 recipe name asked for that ``import hf_fp8_attention`` did not, and each
    recipe with options (``recipe+field=value``, :func:`recipe_names.recipe_config`) under that name."""
    for name in names:
        if "+" in name:
            register_fp8_attention(name, recipe_config(name))
        elif name in RECIPES and name not in DEFAULT_BACKENDS:
            register_fp8_attention(name, name)


def run_environment(device: str, dtype: torch.dtype) -> dict:
    if device == "cuda":
        env = environment()
        try:
            from hf_fp8_attention.ops import select_backend

            env["fp8_path"] = select_backend("cuda", RECIPES["fp8_delta"]).value
        except RuntimeError as exc:  # an older GPU: the fp8 rows will fail and say why
            env["fp8_path"] = f"unavailable ({exc})"
    else:
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = "not installed"
        env = {"gpu": f"none (CPU: {platform.processor() or platform.machine()})", "capability": None,
               "torch": torch.__version__, "triton": triton_version, "cuda": None, "cudnn": None,
               "python": platform.python_version(),
               "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
               "fp8_path": "emulation"}
    env["transformers"] = transformers.__version__
    env["device"] = device
    env["dtype"] = str(dtype).removeprefix("torch.")
    return env


def step_device(tiny: bool, prog: str) -> tuple[str, torch.dtype] | None:
    """(device, dtype) of a training-step benchmark: bf16 on a CUDA GPU; without one, the ``--tiny``
    models on CPU in fp32 (said on stdout), else None after saying why on stderr."""
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16
    if tiny:
        print(f"{prog}: no CUDA GPU: running the --tiny models on CPU in fp32 (FP8 recipes through the PyTorch "
              "emulation; a smoke test, not a benchmark)", flush=True)
        return "cpu", torch.float32
    print(f"{prog}: needs a CUDA GPU (use --tiny for a CPU smoke test)", file=sys.stderr)
    return None


def training_optimizer(model) -> tuple[torch.optim.Optimizer, bool]:
    """(AdamW over ``model``'s parameters, whether it is the fused one): fused where the torch build
    and device allow it."""
    try:
        return torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True), True
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.AdamW(model.parameters(), lr=1e-5), False


class _Clock:
    """Step times: CUDA events on a GPU, the host clock (after the step's work) on CPU."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn) -> float:
        """Seconds ``fn()`` takes."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def step_forward(model, mode: str):
    """The callable one training step runs ``model`` through in ``mode`` (:data:`MODES`)."""
    if mode == "eager":
        return model
    if mode == "compile":
        return torch.compile(model, dynamic=False)
    graphed = torch.compile(model, dynamic=False, mode="reduce-overhead")

    def forward(**inputs):
        # A new step: the graphs may overwrite the previous step's outputs (all consumed by then).
        torch.compiler.cudagraph_mark_step_begin()
        return graphed(**inputs)

    return forward


def measure(model, forward, context: int, vocab: int, args, device: str) -> dict:
    """Warm-up then timed training steps at one context length; a fresh optimizer."""
    clock = _Clock(device)
    gen = torch.Generator().manual_seed(context)
    ids = torch.randint(0, vocab, (1, context), generator=gen).to(device)
    optimizer, fused = training_optimizer(model)

    def step():
        loss = forward(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    try:
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        clock.sync()
        t0 = time.perf_counter()
        step()  # compiles under torch.compile; allocates the optimizer state
        clock.sync()
        first_s = time.perf_counter() - t0
        for _ in range(args.warmup - 1):
            step()
        clock.sync()
        times = [clock.time(step) for _ in range(args.steps)]
        median = statistics.median(times)
        return {"status": "ok", "step_ms": median * 1e3, "step_ms_all": [t * 1e3 for t in times],
                "tokens_per_s": context / median, "first_step_s": first_s, "fused_adamw": fused,
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if device == "cuda" else None}
    finally:
        optimizer.zero_grad(set_to_none=True)
        del optimizer
        model.zero_grad(set_to_none=True)


def _cleanup(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _row_key(row: dict) -> tuple:
    return row["model"], row["mode"], row["attn"], row["context"]


def run(args, device: str, dtype: torch.dtype, prior: list[dict] = (), save=None) -> tuple[list[dict], dict, int]:
    """Measure every (model, mode, attention, context) of ``args`` that ``prior`` (rows of an
    earlier run, ``--resume``) has not measured; ``save(rows, params)`` after each model build.
    Stops before a new build once ``args.max_minutes`` have passed. Returns the rows (``prior``'s
    first), the parameter counts and how many configurations are left."""
    rows, params = list(prior), {}
    done = {_row_key(r) for r in prior}
    started = time.monotonic()
    left = 0
    for model_name in args.models:
        config = model_config(model_name, args.tiny)
        contexts = args.contexts or (TINY_CONTEXTS if args.tiny else CONTEXTS[model_name])
        for mode in args.modes:
            for impl in args.attn:
                todo = [c for c in contexts if (model_name, mode, impl, c) not in done]
                if not todo:
                    print(f"{model_name:<10} {mode:<8} {impl:<15} measured in an earlier run (--resume)", flush=True)
                    continue
                if args.max_minutes is not None and time.monotonic() - started > 60 * args.max_minutes:
                    left += len(todo)
                    continue
                torch._dynamo.reset()  # each compile starts afresh (no recompile limit across models)
                model = None
                try:
                    model = build_model(config, impl, dtype=dtype, device=device, seed=0)
                    model.train()
                    got = model.config._attn_implementation
                    if got != impl:
                        raise RuntimeError(f"model built with attn_implementation={got!r}, not {impl!r}")
                    params[model_name] = sum(p.numel() for p in model.parameters())
                    forward = step_forward(model, mode)
                except Exception as exc:  # noqa: BLE001  (reported in the table)
                    failure = "OOM" if _is_oom(exc) else f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    traceback.print_exc()
                    forward = None
                for context in todo:
                    row = {"model": model_name, "mode": mode, "attn": impl, "context": context,
                           "date_utc": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M")}
                    if forward is None:
                        row["status"] = failure
                    else:
                        try:
                            row.update(measure(model, forward, context, config.vocab_size, args, device))
                        except Exception as exc:  # noqa: BLE001
                            if _is_oom(exc):
                                row["status"] = "OOM"
                            else:
                                traceback.print_exc()
                                row["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                        _cleanup(device)
                    rows.append(row)
                    print(_progress(row), flush=True)
                del model, forward
                _cleanup(device)
                if save is not None:
                    save(rows, params)
    return rows, params, left


def _progress(row: dict) -> str:
    head = f"{row['model']:<10} {row['mode']:<8} S={row['context']:<6} {row['attn']:<15}"
    if row["status"] != "ok":
        return f"{head} {row['status']}"
    peak = f"{row['peak_gib']:7.2f} GiB" if row["peak_gib"] is not None else "    n/a"
    return (f"{head} {row['tokens_per_s']:10.0f} tok/s  {row['step_ms']:9.2f} ms/step  peak {peak}  "
            f"first step {row['first_step_s']:.1f} s")


def _add_ratios(rows: list[dict]) -> None:
    sdpa = {(r["model"], r["mode"], r["context"]): r["tokens_per_s"] for r in rows
            if r["attn"] == "sdpa" and r["status"] == "ok"}
    for r in rows:
        base = sdpa.get((r["model"], r["mode"], r["context"]))
        r["x_sdpa"] = r["tokens_per_s"] / base if r["status"] == "ok" and base else None


def _ordered(rows: list[dict]) -> list[dict]:
    """Rows in table order: model, mode, context, then the attention implementations as given."""
    models, modes = list(MODELS), list(MODES)
    attn = list(dict.fromkeys(r["attn"] for r in rows))
    return sorted(rows, key=lambda r: (models.index(r["model"]), modes.index(r["mode"]), r["context"],
                                       attn.index(r["attn"])))


def load_prior(path: Path, env: dict) -> tuple[list[dict], dict]:
    """The rows and parameter counts of an earlier run written to ``path`` (``--resume``), measured
    configurations only (errors are measured again). Refuses rows of another machine or software
    stack: one table compares implementations measured under the same conditions."""
    if not path.exists():
        return [], {}
    data = json.loads(path.read_text())
    keys = ("gpu", "torch", "triton", "transformers", "device", "dtype")
    theirs = {k: data["env"].get(k) for k in keys}
    ours = {k: env.get(k) for k in keys}
    if theirs != ours:
        raise SystemExit(f"train_step: --resume: {path} was measured on {theirs}, this run is {ours}; "
                         "use another --tag")
    return [r for r in data["rows"] if r["status"] in ("ok", "OOM")], data.get("params", {})


def _count(n: int) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def render(env: dict, rows: list[dict], params: dict, args) -> str:
    tiny = " (--tiny: 2-layer models, not the benchmark)" if args.tiny else ""
    fused = {r["fused_adamw"] for r in rows if r["status"] == "ok"}
    adamw = {frozenset({True}): "fused", frozenset({False}): "unfused (foreach)"}.get(frozenset(fused), "fused where available")
    clock = "CUDA events" if env["device"] == "cuda" else "host clock"
    schedule = getattr(args, "schedule", "")
    chunks = f"; launch schedule set for this run: {schedule} ({SCHEDULE_FLAGS})" if schedule else ""
    lines = [f"# One training step (forward, backward, AdamW) per attention backend — {env['gpu']}{tiny}", "",
             " · ".join(f"{k} {env[k]}" for k in ("torch", "triton", "transformers", "cuda", "python", "date_utc")
                        if env.get(k) is not None), "",
             f"{env['dtype']} weights, batch 1 (tokens/step = context), random tokens, loss over all tokens, "
             f"{adamw} AdamW, no gradient checkpointing; {args.warmup} warm-up step(s), median of {args.steps} timed "
             f"({clock}). `compile`: `torch.compile(model, dynamic=False)` (model and loss; the optimizer step "
             "eager); `cudagraphs`: the same with `mode=\"reduce-overhead\"` (CUDA graphs). "
             "`x sdpa`: tokens/s over sdpa's at the same model, mode and context. `peak`: "
             "`torch.cuda.max_memory_allocated()` of the run (weights, gradients, optimizer state, activations). "
             f"`first step`: the first warm-up step (compilation included). FP8 path: {env.get('fp8_path')}"
             f"{chunks}.",
             ""]
    for model_name in args.models:
        shape = {**MODELS[model_name], **(TINY[model_name] if args.tiny else {})}
        count = params.get(model_name)
        lines += [f"## {model_name}: hidden {shape['hidden_size']}, {shape['num_hidden_layers']} layers, "
                  f"{shape['num_attention_heads']} q / {shape['num_key_value_heads']} kv heads, head_dim "
                  f"{shape['head_dim']}, MLP {shape['intermediate_size']}, vocab {shape['vocab_size']}"
                  f"{', tied embeddings' if shape['tie_word_embeddings'] else ''}"
                  f"{f' — {_count(count)} parameters' if count else ''}", "",
                  "| mode | context | attention | tokens/s | x sdpa | peak GiB | ms/step | first step s |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r["model"] != model_name:
                continue
            if r["status"] != "ok":
                lines.append(f"| {r['mode']} | {r['context']} | {r['attn']} | {r['status']} | | | | |")
                continue
            lines.append(f"| {r['mode']} | {r['context']} | {r['attn']} | {r['tokens_per_s']:.0f} | "
                         f"{_fmt(r['x_sdpa'], '.2f')} | {_fmt(r['peak_gib'], '.2f')} | {r['step_ms']:.1f} | "
                         f"{r['first_step_s']:.1f} |")
        lines.append("")
    return "\n".join(lines)


def _default_tag(env: dict, tiny: bool) -> str:
    gpu = "".join(c if c.isalnum() else "_" for c in env["gpu"].lower().replace("nvidia", "")).strip("_")
    gpu = "_".join(part for part in gpu.split("_") if part) if env["device"] == "cuda" else "cpu"
    return f"{gpu}_train_step{'_tiny' if tiny else ''}_{_dt.date.today():%Y%m%d}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=_csv(), default=list(MODELS), help=f"comma-separated of {', '.join(MODELS)}")
    p.add_argument("--contexts", type=_csv(int), default=None,
                   help="comma-separated, for every model (default: 4096,8192,16384 for llama0.9b, 2048,8192 "
                        "for smollm2; 256 with --tiny)")
    p.add_argument("--attn", type=_csv(), default=list(ATTN), help="attention implementations (sdpa, eager, or "
                   "any recipe name of hf_fp8_attention.RECIPES)")
    p.add_argument("--modes", type=_csv(), default=list(DEFAULT_MODES),
                   help="of eager, compile, cudagraphs (default: eager,compile)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration (median)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps (the first compiles)")
    p.add_argument("--tiny", action="store_true", help="2-layer models at 256 tokens: a smoke test (runs on CPU)")
    p.add_argument("--tag", default=None, help="results file name (default: GPU name, date)")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--resume", action="store_true",
                   help="keep the configurations <out-dir>/<tag>.json already holds and measure only the others")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new model build after this many minutes (results are written after each "
                        "build; run again with --resume to go on)")
    add_schedule_options(p)
    args = p.parse_args(argv)
    args.schedule = apply_schedule_options(p, args)
    for name in args.models:
        if name not in MODELS:
            p.error(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    for mode in args.modes:
        if mode not in MODES:
            p.error(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be at least 1")

    picked = step_device(args.tiny, "train_step")
    if picked is None:
        return 2
    device, dtype = picked
    register_attention(args.attn)
    env = run_environment(device, dtype)
    tag = args.tag or _default_tag(env, args.tiny)
    print(f"train_step: {env['gpu']} · torch {env['torch']} · triton {env['triton']} · transformers "
          f"{env['transformers']} · {env['dtype']}", flush=True)
    for name in args.models:
        config = model_config(name, args.tiny)
        with torch.device("meta"):
            count = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        print(f"train_step: {name}: {count:,} parameters", flush=True)
    prior, prior_params = load_prior(Path(args.out_dir) / f"{tag}.json", env) if args.resume else ([], {})

    def save(rows, params, quiet=True):
        rows = _ordered(rows)
        _add_ratios(rows)
        params = {**prior_params, **params}
        data = {"env": env, "args": vars(args), "tag": tag, "params": params, "rows": rows}
        write_results(args.out_dir, tag, render(env, rows, params, args), data, quiet=quiet)
        return rows

    rows, params, left = run(args, device, dtype, prior, save)
    rows = save(rows, params, quiet=False)
    if left:
        print(f"train_step: --max-minutes reached with {left} configuration(s) left; run the same command "
              "with --resume to measure them", flush=True)
    errors = [r for r in rows if r["status"] not in ("ok", "OOM")]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
