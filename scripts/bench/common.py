"""What the benchmarks share: machine facts, repeat statistics, timing, tables, result files."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MODES", "Spread", "cpu_name", "fmt", "load", "machine", "markdown_table", "spread",
           "timed_round_robin", "write_json"]

MODES = ("full", "quick", "smoke")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def load() -> float:
    """The 1-minute load average (the machines are shared: quote it with every number)."""
    return round(os.getloadavg()[0], 2)


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "processor": cpu_name(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}


Spread = dict[str, Any]  # {"median", "min", "max", "spread_pct", "samples"}: plain, so it
#                          travels back from `hybridpar.spawn` (weights_only loading)


def spread(samples: Sequence[float]) -> Spread:
    """The median of `samples` and their spread, (max - min) / median in percent."""
    med = statistics.median(samples)
    lo, hi = min(samples), max(samples)
    return {"median": med, "min": lo, "max": hi,
            "spread_pct": 100.0 * (hi - lo) / med if med else 0.0, "samples": list(samples)}


def fmt(s: Spread, scale: float = 1.0, digits: int = 1) -> str:
    """``"12.3 ±2.0%"``: the median and half the range of the repeats, in percent."""
    return f"{s['median'] * scale:.{digits}f} ±{s['spread_pct'] / 2:.1f}%"


def timed_round_robin(steps: dict[str, Callable[[], Any]], *, warmup: int, iters: int,
                      repeats: int, barrier: bool = True) -> dict[str, Spread]:
    """Per name: the median over `repeats` of the median step, in seconds, and its spread.

    Collective over the default group. Every step is warmed up `warmup` times, then each
    repeat runs `iters` rounds in which every name takes one step in turn (the order
    reversed every other round), so a slow spell of the shared machine hits all alike.
    Each step is timed alone, between two barriers with `barrier` (BENCH.md's protocol;
    the slowest rank's time is taken).
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    values: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps.items())
    for _ in range(repeats):
        times: dict[str, list[float]] = {name: [] for name in steps}
        for i in range(iters):
            # A B C, then C B A: no step always runs right after the same other one
            for name, step in order if i % 2 == 0 else order[::-1]:
                if barrier:
                    dist.barrier()
                t0 = time.perf_counter()
                step()
                if barrier:
                    dist.barrier()
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            slowest = torch.tensor([statistics.median(ts)], dtype=torch.float64)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            values[name].append(slowest.item())
    return {name: spread(v) for name, v in values.items()}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table, columns padded so it also reads as plain text."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def machine_line(result: dict[str, Any]) -> str:
    """The closing line of a benchmark's output: machine, torch, load before -> after, time
    (`result` holds ``machine``, ``load_before``, ``load_after`` and ``seconds``)."""
    m = result["machine"]
    return (f"machine: {m['processor']}, {m['cpus']} CPUs, torch {m['torch']}; load "
            f"{result['load_before']} -> {result['load_after']}; {result['seconds']} s")


def write_json(path: str | os.PathLike[str], result: dict[str, Any]) -> Path:
    """Write `result` (plus date and machine when missing) as indented JSON, atomically."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    result.setdefault("date", datetime.datetime.now().isoformat(timespec="seconds"))
    result.setdefault("machine", machine())
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=float))
    tmp.replace(out)
    return out
