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


def plot_passkey(rates: dict, lengths, depths, path) -> Path:
    """Pass-key retrieval as a PNG: per mode a heatmap of the rate found, depth (rows) against length (columns).
    ``rates``: {mode: {(length, depth): rate}} (:func:`sieve_attn.eval.passkey.retrieval_rates` per mode)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rates), figsize=(2 + 1.1 * len(lengths) * len(rates), 1.4 + 0.45 * len(depths)),
                             squeeze=False, sharey=True, layout="constrained")
    for ax, (mode, cells) in zip(axes[0], rates.items()):
        grid = [[100 * cells[(length, float(depth))] for length in lengths] for depth in depths]
        image = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        for row, line in enumerate(grid):
            for column, percent in enumerate(line):
                ax.text(column, row, f"{percent:.0f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [str(length) for length in lengths])
        ax.set_yticks(range(len(depths)), [f"{depth:g}" for depth in depths])
        ax.set_xlabel("prompt tokens")
        ax.set_title(mode)
    axes[0][0].set_ylabel("depth of the key")
    fig.colorbar(image, ax=axes[0].tolist(), label="found (%)")
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120))
    plt.close(fig)
    return path
