"""Loss-curve PNGs (matplotlib, Agg backend: works headless)."""
from __future__ import annotations

from pathlib import Path


def _moving_average(values: list, n: int) -> list:
    return [sum(values[max(0, i - n + 1):i + 1]) / len(values[max(0, i - n + 1):i + 1]) for i in range(len(values))]


def plot_loss_curves(curves: dict, path, *, title: str = "training loss", xlabel: str = "step",
                     ylabel: str = "loss", smooth: int = 1, reference: str | None = None) -> Path:
    """Plot ``{label: (steps, values)}`` as lines and save a PNG at ``path``.

    ``smooth > 1`` overlays a moving average of that many points (raw curves stay faint).
    ``reference``: a label whose curve the others are compared to in a second panel (difference of
    the smoothed curves, same steps) — runs that share init and batches overlap in the first panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compare = reference is not None and reference in curves and len(curves) > 1
    if compare:
        fig, (ax, dax) = plt.subplots(2, 1, figsize=(7, 6.2), dpi=110, sharex=True,
                                      gridspec_kw={"height_ratios": [2, 1]})
    else:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, (steps, values) in curves.items():
        steps, values = list(steps), list(values)
        if not values:
            continue
        if smooth > 1 and len(values) > smooth:
            (line,) = ax.plot(steps, values, alpha=0.25)
            avg = _moving_average(values, smooth)
            ax.plot(steps, avg, color=line.get_color(), label=label)
        else:
            ax.plot(steps, values, label=label)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    if compare:
        ref_steps, ref_values = curves[reference]
        ref = dict(zip(ref_steps, _moving_average(list(ref_values), max(1, smooth))))
        for i, (label, (steps, values)) in enumerate(curves.items()):
            if label == reference:
                continue
            avg = _moving_average(list(values), max(1, smooth))
            pairs = [(s, a - ref[s]) for s, a in zip(steps, avg) if s in ref]
            dax.plot([p[0] for p in pairs], [p[1] for p in pairs], color=f"C{i}", label=f"{label} − {reference}")
        dax.axhline(0.0, color="k", lw=0.8)
        dax.set_ylabel(f"{ylabel} − {reference}")
        dax.grid(alpha=0.3)
        dax.legend(fontsize=8)
        dax.set_xlabel(xlabel)
    else:
        ax.set_xlabel(xlabel)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
