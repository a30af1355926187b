"""Time one training step of a small Llama (built from a config, no hub) per attention backend.

What a user of Transformers sees: ``model(input_ids, attention_mask, position_ids, labels)`` then
``loss.backward()``, in bf16, for ``attn_implementation`` = fp8_delta, sdpa. Two batch kinds:
``dense`` (every token valid; position_ids given, as Trainer and generate pass them) and
``padded`` (right padding to the longest row: the varlen path). The step includes everything the
attention backend does on the host (mask planning, checks, launches), so at short sequences it
also measures host overhead.

Prints a table of milliseconds per step and writes ``<out-dir>/<tag>.md`` / ``.json``.

    python benchmarks/model_step.py --tag h200_model_step
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hf_fp8_attention  # noqa: E402,F401  (registers the fp8_* backends)
from bench_attention import environment, write_results  # noqa: E402


KINDS = ("dense", "padded")


def build_model(config, impl: str, dtype: torch.dtype = torch.bfloat16, device: str = "cuda", seed: int = 0):
    """A causal LM built from ``config`` (no hub) with ``attn_implementation=impl``, the same weights for
    the same ``seed`` whatever ``impl`` is."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=dtype).to(device)


def _model(impl: str, layers: int, hidden: int, heads: int, kv_heads: int):
    config = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=hidden // heads, num_hidden_layers=layers, intermediate_size=hidden * 8 // 3,
                         vocab_size=32000, attention_dropout=0.0)
    return build_model(config, impl)


def _batch(kind: str, batch: int, seq: int):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32000, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if kind == "padded":  # rows of 100%, 75%, 50%, ... of the length, right-padded
        for r in range(batch):
            mask[r, seq - (seq * (r % 4)) // 4:] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return {k: t.cuda() for k, t in (("input_ids", ids), ("attention_mask", mask), ("position_ids", position_ids),
                                      ("labels", ids))}


def step_ms(model, batch, steps: int) -> float:
    def step():
        model(**batch).loss.backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def run(args) -> list[dict]:
    rows = []
    for impl in args.impls:
        model = _model(impl, args.layers, args.hidden, args.heads, args.kv_heads)
        for b, s in args.shapes:
            for kind in KINDS:
                ms = step_ms(model, _batch(kind, b, s), args.steps)
                rows.append({"impl": impl, "batch": b, "seq": s, "kind": kind, "ms": ms})
                print(f"{impl:10s} B={b} S={s} {kind:6s} {ms:8.2f} ms/step", flush=True)
        del model
        torch.cuda.empty_cache()
    return rows


def render(env: dict, rows: list[dict], args) -> str:
    ms = {(r["impl"], r["batch"], r["seq"], r["kind"]): r["ms"] for r in rows}
    lines = [f"# One training step of a {args.layers}-layer Llama (hidden {args.hidden}, {args.heads} heads, "
             f"{args.kv_heads} kv heads, bf16) — {env['gpu']}", "",
             " · ".join(f"{k} {env[k]}" for k in ("torch", "triton", "cuda", "python", "date_utc")), "",
             "ms per step (forward + backward, loss over all tokens); padded: rows 100/75/50/25% valid.", "",
             "| B | S | batch | " + " | ".join(args.impls) + " |", "|---|---|---|" + "---|" * len(args.impls)]
    for b, s in args.shapes:
        for kind in KINDS:
            lines.append(f"| {b} | {s} | {kind} | " + " | ".join(f"{ms[(i, b, s, kind)]:.2f}" for i in args.impls) + " |")
    return "\n".join(lines) + "\n"


def _shape(text: str) -> tuple[int, int]:
    b, s = text.split("x")
    return int(b), int(s)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--impls", type=lambda t: t.split(","), default=["fp8_delta", "sdpa"])
    p.add_argument("--shapes", type=lambda t: [_shape(x) for x in t.split(",")], default=[(8, 512), (4, 1024), (2, 2048)],
                   help="batch x seq, comma-separated (default 8x512,4x1024,2x2048)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--tag", default="model_step")
    p.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("model_step: needs a CUDA GPU", file=sys.stderr)
        return 2
    env = environment()
    rows = run(args)
    write_results(args.out_dir, args.tag, render(env, rows, args), {"env": env, "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
