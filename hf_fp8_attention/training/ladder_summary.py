"""The parity study's size ladder read across its rungs: per size, each mode's final held-out loss
minus the reference's (sdpa's) on the same seed, with the reference's own seed spread beside it,
as a Markdown table and a PNG of the gap against the parameter count.

A run record is what ``examples/parity.py report`` reads from a run folder: ``{"spec": run.json,
"done": done.json or None, ...}``, with ``spec["size"]``, ``spec["params"]``, ``spec["mode"]``,
``spec["seed"]`` and ``done["final_eval_loss"]``. Gaps pair runs by seed (the same initial weights
and batches), so the seed's own variation cancels; a mode's gap at a size is the mean over the seeds
both it and the reference finished. NaN and inf are kept as they are: where a seed's gap is not
finite the table lists every seed's gap instead of a mean, and the plot marks it (a diverged run
shows as such, never as a missing cell, and does not hide the other seeds).
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path


def ladder_gaps(runs: list[dict], modes: tuple[str, ...], reference: str = "sdpa") -> list[dict]:
    """One row per ladder size, smallest first: ``{"size", "params", "reference": mean final loss or
    None, "reference_spread": half the range over its seeds or None, "gaps": {mode: {seed: gap}}}``
    for the modes in ``modes`` that have a paired seed (others are absent)."""
    by_size: dict = {}
    for r in runs:
        if r.get("done") is None:
            continue
        spec = r["spec"]
        size = by_size.setdefault(spec["size"], {"params": spec.get("params"), "finals": {}})
        size["finals"].setdefault(spec["mode"], {})[spec["seed"]] = float(r["done"]["final_eval_loss"])
    rows = []
    for name, size in by_size.items():
        ref = size["finals"].get(reference, {})
        ref_values = list(ref.values())
        gaps = {}
        for mode in modes:
            if mode == reference:
                continue
            paired = {seed: loss - ref[seed] for seed, loss in sorted(size["finals"].get(mode, {}).items())
                      if seed in ref}
            if paired:
                gaps[mode] = paired
        rows.append({"size": name, "params": size["params"],
                     "reference": statistics.fmean(ref_values) if ref_values else None,
                     "reference_spread": (max(ref_values) - min(ref_values)) / 2 if len(ref_values) > 1 else None,
                     "gaps": gaps})
    return sorted(rows, key=lambda row: (row["params"] is None, row["params"] or 0, row["size"]))


def mean_gap(per_seed: dict) -> float:
    """The mean of a mode's per-seed gaps; NaN or inf where any seed's is (never hidden)."""
    return statistics.fmean(per_seed.values())


def _gap_cell(per_seed: dict) -> str:
    values = list(per_seed.values())
    if all(math.isfinite(v) for v in values):
        return f"{mean_gap(per_seed):+.4f}" + (f" ({len(values)} seeds)" if len(values) > 1 else "")
    seeds = " / ".join(str(seed) for seed in per_seed)
    return " / ".join(f"{v:+.4f}" for v in values) + (f" (seeds {seeds})" if len(values) > 1 else "")


def ladder_table(rows: list[dict], modes: tuple[str, ...], reference: str = "sdpa") -> list[str]:
    """Markdown lines of :func:`ladder_gaps`' rows: size, parameters, the reference's final held-out
    loss (± its seed spread), and per mode its mean gap (the number of paired seeds where more than
    one), or each seed's gap where one is not finite."""
    shown = [m for m in modes if m != reference and any(m in row["gaps"] for row in rows)]
    lines = [f"| size | parameters | {reference} held-out loss | " + " | ".join(f"Δ {m}" for m in shown) + " |",
             "|---|---|---|" + "---|" * len(shown)]
    for row in rows:
        ref = "—" if row["reference"] is None else f"{row['reference']:.4f}"
        if row["reference_spread"] is not None:
            ref += f" ± {row['reference_spread']:.4f}"
        cells = []
        for m in shown:
            cells.append("—" if m not in row["gaps"] else _gap_cell(row["gaps"][m]))
        params = "—" if row["params"] is None else f"{row['params'] / 1e6:.1f}M"
        lines.append(f"| {row['size']} | {params} | {ref} | " + " | ".join(cells) + " |")
    return lines


def plot_ladder_gaps(rows: list[dict], path, *, reference: str = "sdpa", title: str = "") -> Path:
    """A PNG at ``path``: each mode's gap to the reference against the parameter count (log x; the y
    axis linear within ±0.05 and logarithmic beyond, so that a diverged run and the matched modes'
    hundredths show on one plot), the reference's seed spread as a band around 0 where known. Rows
    without a parameter count are left out. Where a seed's gap is not finite the mean is too: a cross
    at the plot's edge marks it, and the finite seeds' gaps are drawn as hollow markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [row for row in rows if row["params"]]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    modes = sorted({m for row in rows for m in row["gaps"]})
    finite = [v for row in rows for g in row["gaps"].values() for v in g.values() if math.isfinite(v)]
    edge = max([abs(v) for v in finite] + [0.05]) * 2
    for mode in modes:
        points = [(row["params"], row["gaps"][mode]) for row in rows if mode in row["gaps"]]
        means = [mean_gap(g) for _, g in points]
        xs = [x for x, _ in points]
        (line,) = ax.plot(xs, [m if math.isfinite(m) else float("nan") for m in means], marker="o", label=mode)
        bad = [(x, g) for (x, g), m in zip(points, means) if not math.isfinite(m)]
        if bad:
            ax.plot([x for x, _ in bad], [edge] * len(bad), "x", color=line.get_color(), ms=9,
                    label=f"{mode}: not finite")
            seeds = [(x, v) for x, g in bad for v in g.values() if math.isfinite(v)]
            ax.plot([x for x, _ in seeds], [v for _, v in seeds], "o", mfc="none", color=line.get_color(), ms=7,
                    label=f"{mode}: its finite seeds" if seeds else None)
    spread = [(row["params"], row["reference_spread"]) for row in rows if row["reference_spread"] is not None]
    if spread:
        xs = [x for x, _ in spread]
        ax.fill_between(xs, [-s for _, s in spread], [s for _, s in spread], color="0.8", alpha=0.6,
                        label=f"{reference} seed spread", step="mid" if len(xs) > 1 else None)
        if len(xs) == 1:
            ax.errorbar(xs, [0.0], yerr=[spread[0][1]], color="0.5", capsize=4)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=0.05)
    ax.set_xlabel("parameters")
    ax.set_ylabel(f"final held-out loss − {reference}'s (same seed)")
    ax.set_title(title or f"gap to {reference} across the ladder", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
