"""What the stale delta adds to the gradients, by sequence length, on real activations.

For each layer of a fixture of captured attention inputs (``recipe_errors.py``'s format) and each
length (its first N tokens, causal), runs the CPU emulation of a matched recipe and its stale twin.
Both share the forward and every quantized operand; only D differs (the backward's own Σ_j P̂ dP̂,
or rowsum(dO ∘ O)). So ``g_stale − g_matched`` is exactly what the stale delta adds, and
‖g_stale − g_matched‖ / ‖g_ref‖ (float64 reference) measures it beside each recipe's own error.
Its direction tells a bias from noise: the cosine of the added error to the reference gradient
(beside the cosine of the matched recipe's own error to it), and how the per-row error of D,
ε = D_stale − D_matched, relates to D: ``delta_sign`` = Σ ε / Σ |ε| (0 when ε has no preferred
sign) and ``delta_slope`` = Σ ε·D / Σ D² (the part of ε that rescales D; an ε ∝ D moves every dQ
row along its own −D·τ·Σ_j P_ij k_j term, i.e. along the reference gradient).
Prints one row per (pair, layer, length) and writes a JSON and two PNGs (the added dQ and dK error
against the length, one line per layer; the cosines).

    python benchmarks/stale_vs_length.py                                   # tests/data slice, 1024 tokens
    python benchmarks/stale_vs_length.py --fixture F --tokens 256,512,1024,2048 --out-dir DIR
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from recipe_errors import DEFAULT_FIXTURE, SCALE, emulate, load_layers, rel  # noqa: E402

from hf_fp8_attention import RECIPES  # noqa: E402
from hf_fp8_attention.diagnostics import row_sum_residual  # noqa: E402
from hf_fp8_attention.exact import exact_attention_grads  # noqa: E402
from hf_fp8_attention.masking import MaskSpec  # noqa: E402
from hf_fp8_attention.reference import BackwardInternals  # noqa: E402

PAIRS = (("fp8_delta", "fp8_stale"), ("fp8_delta_fast", "fp8_stale_fast"))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def delta_error_stats(matched: BackwardInternals, stale: BackwardInternals) -> dict[str, float]:
    """``delta_sign`` = Σ ε / Σ |ε| and ``delta_slope`` = Σ ε·D / Σ D² over the rows that see a key,
    ε = D_stale − D_matched and D the matched one's (both ``(B, Hkv, G, Sq)``)."""
    seen = matched.p.sum(dim=-1) > 0
    d = matched.delta.double()[seen]
    eps = stale.delta.double()[seen] - d
    return {"delta_sign": float(eps.sum() / eps.abs().sum()), "delta_slope": float((eps * d).sum() / (d * d).sum())}


def measure(q, k, v, do, exact, matched: str, stale: str) -> dict[str, float]:
    """Errors of ``matched`` and ``stale`` against ``exact`` (float64 attention's out, dq, dk, dv),
    and the stale delta's own contribution ``stale_added_*`` = ‖g_stale − g_matched‖ / ‖g_ref‖, for
    dQ and dK (dV does not see D), with the stale twin's median zero-row-sum residual; the cosines
    ``stale_added_cos_*`` (of g_stale − g_matched) and ``matched_cos_*`` (of g_matched − g_ref) to
    g_ref, and :func:`delta_error_stats`."""
    _, g_matched, matched_internals = emulate(q, k, v, do, RECIPES[matched])
    _, g_stale, internals = emulate(q, k, v, do, RECIPES[stale])
    out = {"residual": float(row_sum_residual([internals]).median()), **delta_error_stats(matched_internals, internals)}
    for i, name in ((0, "dQ"), (1, "dK")):
        ref = exact[1 + i]
        added = g_stale[i].double() - g_matched[i].double()
        out[f"matched_{name}"] = rel(g_matched[i], ref)
        out[f"stale_{name}"] = rel(g_stale[i], ref)
        out[f"stale_added_{name}"] = float(added.norm() / ref.norm())
        out[f"stale_added_cos_{name}"] = cosine(added, ref)
        out[f"matched_cos_{name}"] = cosine(g_matched[i].double() - ref, ref)
    return out


def plot(results: dict, lengths: list[int], path: Path) -> None:
    """Two PNGs: ``path`` the added dQ and dK error against the length, one line per (pair, layer);
    ``*_direction.png`` beside it the cosines of the added error (solid) and of the matched recipe's
    own error (dotted) to the reference gradient."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def figure(title: str, ylabel: str, lines, suptitle: str | None = None):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        if suptitle:
            fig.suptitle(suptitle, fontsize=10)
        for ax, grad in zip(axes, ("dQ", "dK")):
            for i, (key, rows) in enumerate(results.items()):
                for metric, scale, style in lines:
                    label = key if style == "-" else None
                    ax.plot(lengths, [scale * rows[str(n)][metric.format(grad)] for n in lengths], style, marker="o",
                            color=f"C{i}", label=label, markersize=3)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens (causal)")
            ax.set_title(title.format(grad))
            ax.grid(alpha=0.3)
        axes[0].set_ylabel(ylabel)
        axes[1].legend(fontsize=7)
        fig.tight_layout()
        return fig

    figure("{}: ‖stale − matched‖ / ‖exact‖", "% of the exact gradient's norm",
           [("stale_added_{}", 100, "-")]).savefig(path, dpi=120)
    figure("{}", "cosine to the exact gradient", [("stale_added_cos_{}", 1, "-"), ("matched_cos_{}", 1, ":")],
           "what the stale delta adds (solid) and the matched recipe's own error (dotted)").savefig(
        path.with_name(path.stem + "_direction.png"), dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", type=Path, default=DEFAULT_FIXTURE)
    parser.add_argument("--tokens", default="256,512,1024", help="comma-separated lengths (first N tokens)")
    parser.add_argument("--out-dir", type=Path, help="writes stale_vs_length.json and the two PNGs there")
    args = parser.parse_args(argv)
    lengths = sorted(int(x) for x in args.tokens.split(","))
    layers = load_layers(args.fixture, max(lengths))
    have = next(iter(layers.values()))[0].shape[2]
    if have < max(lengths):
        parser.error(f"--tokens {max(lengths)}: the fixture holds {have} tokens")
    results: dict[str, dict[str, dict[str, float]]] = {}
    print(f"{'pair':<31} {'layer':>5} {'tokens':>6}  dQ matched / stale / added   dK matched / stale / added"
          "   residual (stale)   cos(added, ref) dQ / dK   cos(matched error, ref) dQ / dK   ε: sign / slope")
    for layer, tensors in layers.items():
        for n in lengths:
            q, k, v, do = (t[:, :, :n] for t in tensors)
            exact = exact_attention_grads(q, k, v, do, scale=SCALE, mask=MaskSpec(causal=True))  # shared by both pairs
            for matched, stale in PAIRS:
                key = f"{matched}/{stale} layer {layer}"
                row = results.setdefault(key, {})[str(n)] = measure(q, k, v, do, exact, matched, stale)
                print(f"{matched + ' / ' + stale:<31} {layer:>5} {n:>6}  "
                      + "  ".join(" / ".join(f"{100 * row[f'{kind}_{g}']:5.2f}%" for kind in ("matched", "stale",
                                                                                                "stale_added"))
                                  for g in ("dQ", "dK"))
                      + f"   {row['residual']:.1e}"
                      + f"   {row['stale_added_cos_dQ']:+.3f} / {row['stale_added_cos_dK']:+.3f}"
                      + f"   {row['matched_cos_dQ']:+.3f} / {row['matched_cos_dK']:+.3f}"
                      + f"   {row['delta_sign']:+.3f} / {row['delta_slope']:+.2e}", flush=True)
    if args.out_dir:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "stale_vs_length.json").write_text(json.dumps(
            {"fixture": args.fixture.name, "tokens": lengths, "results": results}, indent=1))
        plot(results, lengths, args.out_dir / "stale_vs_length.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
