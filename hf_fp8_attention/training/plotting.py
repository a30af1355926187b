"""Loss-curve PNGs (matplotlib, Agg backend: works headless)."""
from __future__ import annotations

from pathlib import Path


def plot_loss_curves(curves: dict, path, *, title: str = "training loss", xlabel: str = "step",
                     ylabel: str = "loss", smooth: int = 1) -> Path:
    """Plot ``{label: (steps, values)}`` as lines and save a PNG at ``path``.

    ``smooth > 1`` overlays a moving average of that many points (raw curves stay faint).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for label, (steps, values) in curves.items():
        steps, values = list(steps), list(values)
        if not values:
            continue
        if smooth > 1 and len(values) > smooth:
            (line,) = ax.plot(steps, values, alpha=0.25)
            avg = [sum(values[max(0, i - smooth + 1):i + 1]) / len(values[max(0, i - smooth + 1):i + 1])
                   for i in range(len(values))]
            ax.plot(steps, avg, color=line.get_color(), label=label)
        else:
            ax.plot(steps, values, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
