"""Figures: matplotlib without a display, and one way to write a figure to a file (every plot kvsieve draws)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any


def pyplot() -> ModuleType:
    """`matplotlib.pyplot` on the Agg backend, which needs no display (a server, CI), imported at first use: matplotlib
    takes about a second to import and only the plotting commands need it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path, dpi: int = 110) -> Path:
    """Lay `fig` out, write it to `path` (its folder made where missing) and close it; returns `path`."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
