"""Headless matplotlib for the PNGs the scripts write beside their JSON (training curves, benchmark plots)."""
from __future__ import annotations

import os


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed); imported on first use only."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: str, dpi: int = 120) -> None:
    """Lay out, write `path` (its folder made if missing) and close the figure."""
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def paired_bars(path: str, labels: list[str], bars: dict[str, list[float]], *, ylabel: str, title: str,
                log: bool = False) -> None:
    """Two bars per label (`bars`: {legend: one value per label}, two entries), side by side, written to `path`."""
    if len(bars) != 2:
        raise ValueError(f"paired_bars: two series to pair, got {list(bars)}")
    import numpy as np
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels)), 4))
    x = np.arange(len(labels))
    for offset, (legend, values) in zip((-0.2, 0.2), bars.items()):
        ax.bar(x + offset, values, 0.4, label=legend)
    ax.set_xticks(x, labels, rotation=30, fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    save(fig, path)
