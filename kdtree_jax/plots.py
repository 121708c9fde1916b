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


def grouped_bars(path: str, labels: list[str], bars: dict[str, list[float]], *, ylabel: str, title: str,
                 log: bool = False) -> None:
    """One group of bars per label (`bars`: {legend: one value per label}, at least one series), side by side,
    written to `path`."""
    if not bars or any(len(v) != len(labels) for v in bars.values()):
        raise ValueError(f"grouped_bars: one value per label ({len(labels)}) in each series, got "
                         f"{ {k: len(v) for k, v in bars.items()} }")
    import numpy as np
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(labels) * (1 + len(bars) / 2)), 4))
    x = np.arange(len(labels))
    width = 0.8 / len(bars)
    for i, (legend, values) in enumerate(bars.items()):
        ax.bar(x + (i - (len(bars) - 1) / 2) * width, values, width, label=legend)
    ax.set_xticks(x, labels, rotation=30, fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    save(fig, path)
