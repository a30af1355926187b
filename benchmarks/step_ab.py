"""End to end, paired: training steps of one model alternating between attention implementations.

``train_step.py`` builds one model per implementation and times them one after the other; between
those runs the GPU's clocks and the host drift, and the same configuration moved by up to ±2 ms of
a 155 ms step (``benchmarks/NOTES.md``, "End to end"), as much as the differences left to measure.
Here one model (one set of weights, one fused AdamW) runs rounds of one training step per
implementation, switched with Transformers' ``set_attn_implementation`` between steps, the order
rotated every round; each step (forward, backward, optimizer) is timed with CUDA events. Each
implementation's speed against the first one (the reference, sdpa by default) is the median over
rounds of that round's ratio, so a drift shared by the steps of a round cancels; the table also
gives the quartiles of those per-round ratios, i.e. how far one round can be trusted.

    python benchmarks/step_ab.py --model llama0.9b --context 8192 --attn sdpa,fp8_delta,fp8_delta_fast
    python benchmarks/step_ab.py --attn sdpa,fp8_delta_fast,fp8_delta_fast@token-major-out=0   # a switch's A/B
    python benchmarks/step_ab.py --tiny --rounds 3     # CPU smoke test (FP8 through the emulation)

A variant ``IMPL@OPTION=VALUE[@OPTION...]`` runs ``IMPL`` with launch-schedule options of its own
(``recipe_names.add_schedule_options``: ``token-major-out=0``, ``fold-stats=0``, ``backward-chunks=2``,
``chunk-by-size``, ...), set before each of its steps on top of the run's own and put back after, so
one model can A/B a kernel switch step by step as well as two implementations.

The models are ``train_step.py``'s (built from a config, no download), eager mode, bf16 on a GPU.
Peak memory is not separable here (one model, one optimizer): ``train_step.py`` reports it. Every
step's loss must be finite; a NaN or Inf stops the run. Writes ``<out-dir>/<tag>.md`` and ``.json``.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import write_results  # noqa: E402
from model_step import build_model  # noqa: E402
from recipe_names import (add_schedule_options, apply_schedule_options, restore_schedule,  # noqa: E402
                          schedule_state)
from train_step import (MODELS, TINY_CONTEXTS, _Clock, _csv, model_config, register_attention,  # noqa: E402
                        run_environment, step_device, training_optimizer)


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(first quartile, median, third quartile) of ``values`` (one value: itself three times)."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The order of the implementations in each round: rotated by one every round, so that each
    takes every position (first after the previous round's last, ...) equally often."""
    return [names[r % len(names):] + names[:r % len(names)] for r in range(rounds)]


def paired_ratios(times: dict[str, list[float]], reference: str) -> dict[str, list[float]]:
    """Per round, each implementation's speed over the reference's: reference step time / its own."""
    ref = times[reference]
    return {name: [r / t for r, t in zip(ref, ts)] for name, ts in times.items()}


class Variant:
    """One ``--attn`` entry: an attention implementation, optionally with schedule options of its own
    (``IMPL@OPTION=VALUE@...``, module docstring)."""

    def __init__(self, text: str):
        self.name = text
        self.impl, *options = text.split("@")
        argv = []
        for option in options:
            key, _, value = option.partition("=")
            argv += [f"--{key}"] + ([value] if value else [])
        self.parser = argparse.ArgumentParser(prog=f"step_ab.py --attn {text}", add_help=False)
        add_schedule_options(self.parser)
        self.args = self.parser.parse_args(argv)  # an unknown option or value exits with its message
        self.options = bool(options)

    def apply(self, base: tuple) -> str:
        """The run's switches (``base``, a :func:`recipe_names.schedule_state`), then this variant's;
        returns the variant's note."""
        restore_schedule(base)
        return apply_schedule_options(self.parser, self.args) if self.options else ""


class _Stepper:
    """One training step of ``model`` under a given attention implementation."""

    def __init__(self, model, context: int, vocab: int, device: str):
        gen = torch.Generator().manual_seed(context)
        self.ids = torch.randint(0, vocab, (1, context), generator=gen).to(device)
        self.model = model
        self.optimizer, self.fused = training_optimizer(model)

    def use(self, impl: str) -> None:
        """Switch the model's attention implementation (outside the timed step: the switch's Python
        would delay the step's first launches)."""
        model = self.model
        if model.config._attn_implementation != impl:
            model.set_attn_implementation(impl)
            if model.config._attn_implementation != impl:
                raise RuntimeError(f"set_attn_implementation({impl!r}) left {model.config._attn_implementation!r}")

    def __call__(self) -> torch.Tensor:
        model = self.model
        loss = model(input_ids=self.ids, labels=self.ids, use_cache=False).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def run(args, device: str, dtype: torch.dtype) -> dict:
    config = model_config(args.model, args.tiny)
    variants = {v.name: v for v in args.variants}
    base = schedule_state()
    model = build_model(config, args.variants[0].impl, dtype=dtype, device=device, seed=0)
    model.train()
    step = _Stepper(model, args.context, config.vocab_size, device)
    clock = _Clock(device)
    losses = []

    def use(name: str) -> None:
        variants[name].apply(base)
        step.use(variants[name].impl)

    def timed(name: str) -> float:
        out = {}
        use(name)
        clock.sync()  # the previous step's tail does not run into this one's timing
        seconds = clock.time(lambda: out.setdefault("loss", step()))
        loss = out["loss"].item()
        if not math.isfinite(loss):
            raise FloatingPointError(f"{name}: non-finite loss {loss} in a timed step")
        losses.append(loss)
        return seconds * 1e3

    try:
        for name in args.attn:  # warm-up: compiles, allocator, optimizer state
            use(name)
            for _ in range(args.warmup):
                step()
        clock.sync()
        times = {name: [] for name in args.attn}
        for number, order in enumerate(round_orders(args.attn, args.rounds), 1):
            for name in order:
                times[name].append(timed(name))
            if number % 5 == 0 or number == args.rounds:
                print(f"step_ab: round {number} of {args.rounds}: "
                      + ", ".join(f"{name} {times[name][-1]:.1f} ms" for name in args.attn), flush=True)
    finally:
        restore_schedule(base)
    return {"params": sum(p.numel() for p in model.parameters()), "fused_adamw": step.fused,
            "times_ms": times, "losses": losses}


def summarize(result: dict, args) -> list[dict]:
    ratios = paired_ratios(result["times_ms"], args.attn[0])
    rows = []
    for impl in args.attn:
        ms = statistics.median(result["times_ms"][impl])
        q1, med, q3 = quartiles(ratios[impl])
        rows.append({"attn": impl, "step_ms": ms, "tokens_per_s": args.context / ms * 1e3,
                     "x_ref": med, "x_ref_q1": q1, "x_ref_q3": q3})
    return rows


def render(env: dict, rows: list[dict], result: dict, args) -> str:
    ref = args.attn[0]
    lines = [f"# Paired training steps, one model: {args.model}, {args.context} tokens, eager — {env['gpu']}", "",
             f"torch {env['torch']} · triton {env['triton']} · transformers {env['transformers']} · "
             f"cuda {env['cuda']} · {env['dtype']} · {env['date_utc']} UTC · fp8 path {env['fp8_path']}", "",
             f"`python benchmarks/step_ab.py {' '.join(args.argv)}`"
             + (f" (launch schedule set for this run: {args.schedule})" if args.schedule else ""), "",
             f"{result['params']:,} parameters; {args.rounds} rounds of one step (forward, backward, "
             f"{'fused ' if result['fused_adamw'] else ''}AdamW) per implementation, the order rotated each round, "
             f"after {args.warmup} warm-up step(s) each. `x {ref}`: the median over rounds of {ref}'s step time "
             f"over the implementation's in the same round; q1-q3: the quartiles of those per-round ratios.", "",
             f"| attention | ms/step (median) | tokens/s | x {ref} | q1-q3 |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['attn']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | {r['x_ref']:.3f} | "
                     f"{r['x_ref_q1']:.3f}-{r['x_ref_q3']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="llama0.9b", choices=list(MODELS))
    p.add_argument("--context", type=int, default=None, help="tokens per step (default 8192; 256 with --tiny)")
    p.add_argument("--attn", type=_csv(), default=["sdpa", "fp8_delta", "fp8_delta_fast"],
                   help="attention implementations, each optionally IMPL@OPTION=VALUE... with schedule options "
                        "of its own; the first is the reference of the ratios")
    p.add_argument("--rounds", type=int, default=20, help="rounds of one timed step per implementation")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per implementation")
    p.add_argument("--tiny", action="store_true", help="train_step.py's 2-layer models: a smoke test (runs on CPU)")
    p.add_argument("--tag", default=None, help="results file name (default: step_ab_<model>_s<context>)")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    add_schedule_options(p)
    args = p.parse_args(argv)
    args.argv = argv
    args.schedule = apply_schedule_options(p, args)
    if len(args.attn) < 2 or len(set(args.attn)) != len(args.attn):
        p.error(f"--attn needs at least two different implementations, got {args.attn}")
    args.variants = [Variant(text) for text in args.attn]
    base = schedule_state()
    try:
        for variant in args.variants:  # a bad value (e.g. backward-chunks=0) fails here, before any model
            variant.apply(base)
    finally:
        restore_schedule(base)
    if args.rounds < 1 or args.warmup < 1:
        p.error("--rounds and --warmup must be at least 1")
    args.context = args.context or (TINY_CONTEXTS[0] if args.tiny else 8192)

    picked = step_device(args.tiny, "step_ab")
    if picked is None:
        return 2
    device, dtype = picked
    register_attention([v.impl for v in args.variants])
    env = run_environment(device, dtype)
    result = run(args, device, dtype)
    rows = summarize(result, args)
    tag = args.tag or f"step_ab_{args.model}_s{args.context}"
    data = {"env": env, "args": {k: v for k, v in vars(args).items() if k not in ("argv", "variants")},
            "rows": rows, **result}
    write_results(args.out_dir, tag, render(env, rows, result, args), data)
    return 0


__all__ = ["paired_ratios", "quartiles", "round_orders"]

if __name__ == "__main__":
    sys.exit(main())
