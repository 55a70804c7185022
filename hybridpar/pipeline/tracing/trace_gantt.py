"""The Gantt chart of a traced step as a PNG (matplotlib, an optional extra imported lazily).

One row per rank, time in ms from the start of the step:

    rank 0 | F0 F1 F2 F3 ......... B3 B2 B1 B0      forward, backward, recompute: full bars
    rank 1 | ...F0 F1 F2 F3 B3 B2 B1 B0 ....        wait (blocked on a peer): grey bars
                                                    send / recv / collective: thin ticks
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any

from hybridpar.io.files import atomic_write

__all__ = ["write_gantt"]

_COLORS = {"forward": "#4c78a8", "backward": "#59a14f", "recompute": "#f28e2b",
           "weight": "#76b7b2",
           "wait": "#d0d0d0", "send": "#b07aa1", "recv": "#9c755f", "collective": "#e15759"}
_TICKS = ("send", "recv", "collective")


def write_gantt(path: str | os.PathLike[str], ranks: Sequence[Sequence[Any]], *,
                labels: Sequence[str], window: tuple[int, int], title: str) -> bool:
    """Draw `ranks` (lists of `trace_report.Event`) into `path`; False (and a warning) when
    matplotlib is not installed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        warnings.warn("matplotlib is not installed: no gantt.png (pip install "
                      "'hybridpar[plot]'); trace.json and table.txt are written", stacklevel=2)
        return False
    t0, t1 = window
    fig = Figure(figsize=(12, 1.2 + 0.55 * len(ranks)), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for row, events in enumerate(ranks):
        y = len(ranks) - 1 - row
        for kind, color in _COLORS.items():
            bars = [((e.start - t0) / 1e6, (e.end - e.start) / 1e6) for e in events
                    if e.kind == kind]
            if not bars:
                continue
            box = (y + 0.28, 0.1) if kind in _TICKS else (y - 0.4, 0.8)
            ax.broken_barh(bars, box, facecolors=color, edgecolor="white" if kind not in _TICKS
                           else color, linewidth=0.4)
        computes = [e for e in events if e.kind in ("forward", "backward", "recompute", "weight")]
        several = len({e.stage for e in computes}) > 1   # virtual stages: "3F0" = stage 3's F0
        for e in computes:
            name = f"{e.stage}{e.name}" if several else e.name
            ax.text((e.start + e.end - 2 * t0) / 2e6, y - 0.05, name, ha="center",
                    va="center", fontsize=6, color="white", clip_on=True)
    ax.set_yticks(range(len(ranks)), list(reversed(labels)), fontsize=8)
    ax.set_xlim(0, (t1 - t0) / 1e6)
    ax.set_xlabel("ms since the start of the step")
    ax.set_title(title, fontsize=9)
    fig.legend(handles=[Patch(color=c, label=k) for k, c in _COLORS.items()], ncols=7,
               fontsize=7, loc="outside lower center", frameon=False)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120), suffix=".png")
    return True
