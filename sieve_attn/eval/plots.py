"""Plots people would rather look at than read."""
from __future__ import annotations

from pathlib import Path

from .._files import atomic_write


def plot_loss(history, path) -> Path:
    """Training loss per step (and its running mean) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s, _ in history]
    losses = [l for _, l in history]
    smooth, running = [], None
    for loss in losses:
        running = loss if running is None else 0.9 * running + 0.1 * loss
        smooth.append(running)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, losses, alpha=0.35, label="loss")
    ax.plot(steps, smooth, label="running mean")
    ax.set_xlabel("step")
    ax.set_ylabel("LM loss (Focus, training gate)")
    ax.set_title("Router-only training")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120))  # the temporary file keeps the name: PNG
    plt.close(fig)
    return path
