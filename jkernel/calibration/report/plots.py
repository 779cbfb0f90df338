"""Plots of a calibration: measured against predicted times on the rows of each fit.

:func:`save_plots` draws every :class:`~jkernel.calibration.fit.base.PlotSeries` of the fits
as a PNG (matplotlib, the optional extra ``jkernel[notebooks]``; nothing is drawn without
it), for the Markdown reports of :mod:`jkernel.calibration.report.markdown`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from jkernel.atomic import write_with

from ..fit.base import PrimitiveFit

__all__ = ["save_plots"]


def save_plots(fits: Sequence[PrimitiveFit], folder: str | Path, stem: str) -> dict[str, list[str]]:
    """PNG plots of every fit's :class:`~jkernel.calibration.fit.base.PlotSeries` (primitive →
    file names); empty when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, list[str]] = {}
    for f in fits:
        for i, ps in enumerate(f.plots):
            fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=100)
            ax.plot(ps.x, ps.measured * 1e6, "o", ms=4, color="black", label="measured")
            for label, pred in ps.predicted.items():
                ax.plot(ps.x, pred * 1e6, "-", lw=1.5, label=label)
            if ps.logx:
                ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(ps.xlabel)
            ax.set_ylabel("time (µs)")
            ax.set_title(ps.title, fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            name = f"{stem}-{f.primitive}-{i}.png"
            write_with(folder / name, fig.savefig)
            plt.close(fig)
            out.setdefault(f.primitive, []).append(name)
    return out
