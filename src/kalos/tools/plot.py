"""Latency CDFs as a PNG (``kalos bench --plot FILE.png``): each measured path beside its baseline.

One panel per comparison; in each, one cumulative-distribution curve per path, latency on a
log axis (microseconds), the baseline dashed. The legend carries each path's p50 and p99, so
the picture reads without the table. Needs matplotlib (``pip install 'kalos-recall[plot]'``); it is
drawn through matplotlib's object API on the Agg canvas, so no global backend is switched and
no window opens.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from kalos.errors import InvalidArgument

__all__ = ["Series", "Panel", "plot_latency_cdfs", "require_matplotlib"]

_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
_BASELINE_COLOR = "#555555"


@dataclass(frozen=True)
class Series:
    label: str
    samples_s: Sequence[float] | np.ndarray
    baseline: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    series: list[Series] = field(default_factory=list)


def require_matplotlib() -> None:
    """Raises :class:`InvalidArgument` naming the extra when matplotlib is missing (check before measuring)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InvalidArgument("plotting needs matplotlib: pip install 'kalos-recall[plot]'") from None


def plot_latency_cdfs(panels: Sequence[Panel], path: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """Draws the panels side by side into ``path`` (PNG); returns the path."""
    require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    panels = [p for p in panels if p.series]
    if not panels:
        raise InvalidArgument("nothing to plot: no panel has samples")
    path = Path(path)
    fig = Figure(figsize=(6.4 * len(panels), 4.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, panel in zip(axes, panels):
        colors = iter(_COLORS)
        for s in panel.series:
            us = np.sort(np.asarray(s.samples_s, dtype=np.float64) * 1e6)
            if not len(us):
                continue
            y = np.arange(1, len(us) + 1) / len(us)
            p50, p99 = np.percentile(us, 50), np.percentile(us, 99)
            label = f"{s.label}\np50 {_fmt(p50)}, p99 {_fmt(p99)} (n={len(us):,})"
            if s.baseline:
                ax.step(us, y, where="post", color=_BASELINE_COLOR, linestyle="--", linewidth=1.8,
                        label=f"baseline: {label}")
            else:
                ax.step(us, y, where="post", color=next(colors), linewidth=2.0, label=label)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: _fmt(v)))
        ax.set_ylim(0, 1.005)
        ax.set_yticks([0, 0.25, 0.5, 0.75, 0.9, 0.99])
        ax.axhline(0.5, color="#bbbbbb", linewidth=0.8, zorder=0)
        ax.axhline(0.99, color="#bbbbbb", linewidth=0.8, zorder=0)
        ax.grid(True, which="major", axis="x", color="#e5e5e5")
        ax.set_xlabel("latency per call (log scale)")
        ax.set_ylabel("fraction of calls at or below")
        ax.set_title(panel.title, fontsize=11)
        ax.legend(loc="lower right", fontsize=8, framealpha=0.9)
    if title:
        fig.suptitle(title, fontsize=12)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


def _fmt(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.3g} s"
    if us >= 1e3:
        return f"{us / 1e3:.3g} ms"
    return f"{us:.3g} us"
