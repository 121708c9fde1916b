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
