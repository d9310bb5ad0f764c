"""Matplotlib figures for reports (eval, study): drawn on the Agg canvas and saved atomically."""

from __future__ import annotations

from pathlib import Path

from wingspan.errors import import_optional
from wingspan.files import atomic_file


def require_matplotlib() -> None:
    """Fail now, not after the work whose results the plot shows."""
    import_optional("matplotlib", "matplotlib", "the report's plots (PNG)")


def agg_figure(**kwargs):
    """A matplotlib Figure on the Agg canvas directly, not pyplot: no GUI backend, no global figure state."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(layout="constrained", **kwargs)
    FigureCanvasAgg(figure)
    return figure


def save_png(figure, path: Path) -> None:
    with atomic_file(path) as tmp:
        figure.savefig(tmp, format="png", dpi=120)
