"""`hybridpar plot`: a run's story as PNGs, several runs overlaid (the `plot` extra).

    RUN_DIR/metrics.jsonl ... -> OUT/loss.png        train loss (lines), eval loss (dashed)
                                 OUT/lr.png          learning rate
                                 OUT/throughput.png  tokens/s (or samples/s)
                                 OUT/memory.png      peak memory of the largest rank: host
                                                     (VmHWM), device (CUDA) dotted
                                 OUT/story.png       the four above as one 2 x 2 grid

each against the step, one colour per run, its legend the run folder's name.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridpar.train.metrics import read_metrics

__all__ = ["PANELS", "add_parser", "load_runs", "plot_runs", "run"]

#: file stem -> (title, y label)
PANELS = {"loss": ("loss", "loss"), "lr": ("learning rate", "lr"),
          "throughput": ("throughput", "per second"), "memory": ("peak memory (largest rank)",
                                                                  "MiB")}


def load_runs(run_dirs: Sequence[str | os.PathLike[str]]) -> dict[str, list[dict[str, Any]]]:
    """{label: records} of each run folder; a `ValueError` for a folder without records."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for d in run_dirs:
        folder = Path(d)
        file = folder / "metrics.jsonl"
        if not file.is_file():
            what = "is not a folder" if not folder.is_dir() else "has no metrics.jsonl"
            raise ValueError(f"{folder} {what}: give run folders that `hybridpar run` trained "
                             "in (its --run-dir, e.g. runs/quickstart)")
        records = read_metrics(file)
        if not records:
            raise ValueError(f"{file} holds no records yet: a run writes one every "
                             "train.log_every steps")
        label = folder.resolve().name
        if label in runs:   # two runs of the same name: tell them apart by their path
            label = str(folder)
        runs[label] = records
    return runs


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    steps, values = [], []
    for r in records:
        value = r.get(key)
        if isinstance(value, list):   # per-rank values: the largest rank
            value = max(value) if value else None
        if isinstance(value, int | float) and not isinstance(value, bool):
            steps.append(int(r["step"]))
            values.append(float(value))
    return steps, values


def _draw(ax: Any, name: str, runs: dict[str, list[dict[str, Any]]]) -> None:
    title, ylabel = PANELS[name]
    units = set()
    for i, (label, records) in enumerate(runs.items()):
        colour = f"C{i % 10}"
        if name == "loss":
            lines = [("loss", "-", label), ("eval_loss", "--", f"{label} (eval)")]
        elif name == "lr":
            lines = [("lr", "-", label)]
        elif name == "throughput":
            key = "tokens_per_s" if any("tokens_per_s" in r for r in records) else "samples_per_s"
            units.add(key.split("_")[0])
            lines = [(key, "-", label)]
        else:
            lines = [("host_peak_mib", "-", f"{label} host"),
                     ("device_peak_mib", ":", f"{label} device")]
        for key, style, text in lines:
            steps, values = _series(records, key)
            if steps:
                ax.plot(steps, values, style, color=colour, label=text,
                        marker="o" if len(steps) < 3 else None)
    if units:
        ylabel = " / ".join(sorted(units)) + " per second"
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def plot_runs(run_dirs: Sequence[str | os.PathLike[str]],
              out: str | os.PathLike[str]) -> list[Path]:
    """Write `PANELS` as OUT/<name>.png and the grid OUT/story.png; the paths written."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError("hybridpar plot needs matplotlib: pip install -e '.[plot]'") from None
    matplotlib.use("Agg")   # files only: no display needed
    import matplotlib.pyplot as plt

    runs = load_runs(run_dirs)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name in PANELS:
        fig, ax = plt.subplots(figsize=(6, 4))
        _draw(ax, name, runs)
        fig.tight_layout()
        written.append(folder / f"{name}.png")
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, name in zip(axes.flat, PANELS):
        _draw(ax, name, runs)
    fig.tight_layout()
    written.append(folder / "story.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written


def add_parser(commands: Any) -> None:
    p = commands.add_parser("plot", help="PNGs of loss, learning rate, throughput and memory "
                            "against step, several runs overlaid",
                            description="Read RUN_DIR/metrics.jsonl of each run and write "
                            "loss.png, lr.png, throughput.png, memory.png and the grid "
                            "story.png, every run a colour (needs matplotlib: the plot extra).")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders (--run-dir of "
                   "`hybridpar run`)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="where the PNGs go (default: RUN_DIR/plots of the first run)")


def run(args: argparse.Namespace) -> int:
    out = args.out if args.out is not None else Path(args.run_dirs[0]) / "plots"
    for path in plot_runs(args.run_dirs, out):
        print(f"wrote {path}")
    return 0
