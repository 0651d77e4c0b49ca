"""Loss curves drawn from what a run reported: the "What the run did" (or "The curves") section of every
notebook."""

from __future__ import annotations

__all__ = ["plot_losses"]


def plot_losses(
    curves: dict[str, list[float]],
    title: str,
    xlabel: str = "step",
    start: dict | None = None,
    ylabel: str = "loss",
):
    """Draw one line per entry of `curves` (name -> values) and return the figure.

    `start` maps a curve name to the x of its first point, so a resumed run is drawn where
    it picked up instead of at 0. Any per-step or per-epoch curve works (`ylabel`: a metric).
    """
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for name, values in curves.items():
        x0 = (start or {}).get(name, 0)
        ax.plot(range(x0, x0 + len(values)), values, marker="." if len(values) < 80 else None, label=name)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend()
    fig.tight_layout()
    return fig
