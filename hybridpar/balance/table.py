"""Per-stage summary of a balance: layers, parameters, time, memory, share; as rows or text.

    stage  layers  kinds                params  fwd+bwd ms  send ms  activations    memory  share
    0      0-2     Embedding, Block x2    1.2M       10.31     0.52      3.0 MiB  12.6 MiB  34.1%
    ...
    slowest / fastest stage: 1.08x

`send ms` is the stage boundary (`boundary_ms`: the last layer's output forward and its
gradient back); `memory` is parameters * param_scale + buffers + activations of one
micro-batch; `share` is the stage's part of the total time (compute + send).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

from hybridpar.balance.profile import LayerProfile, boundary_ms

__all__ = ["StageRow", "format_table", "imbalance", "stage_table"]

@dataclass
class StageRow:
    """One stage of a balance, summed over its layers."""

    stage: int
    first: int  # index of its first layer
    last: int  # index of its last layer (inclusive)
    names: list[str]
    kinds: list[str]
    params: int
    time_ms: float  # forward + backward (+ tp collectives)
    send_ms: float  # the boundary after the stage (0 for the last)
    activation_bytes: int
    memory_bytes: float
    share: float  # of the total time, 0..1

    @property
    def total_ms(self) -> float:
        return self.time_ms + self.send_ms


def stage_table(profiles: Sequence[LayerProfile], balance: Sequence[int], *,
                p2p_bandwidth: float | None = None, param_scale: float = 2.0) -> list[StageRow]:
    """Sum `profiles` over the stages of `balance`; `p2p_bandwidth` prices the boundaries."""
    if sum(balance) != len(profiles) or any(c < 1 for c in balance):
        raise ValueError(f"balance {list(balance)} does not split {len(profiles)} layers into "
                         "non-empty stages")
    sends = boundary_ms(list(profiles), p2p_bandwidth) if p2p_bandwidth else [0.0] * len(profiles)
    rows, start = [], 0
    for stage, count in enumerate(balance):
        part = profiles[start:start + count]
        stop = start + count
        rows.append(StageRow(
            stage, start, stop - 1, [p.name for p in part], [p.kind for p in part],
            sum(p.params for p in part), sum(p.time_ms for p in part),
            sends[stop - 1] if stop < len(profiles) else 0.0,
            sum(p.activation_bytes for p in part),
            sum(p.memory(param_scale) for p in part), 0.0))
        start = stop
    total = sum(r.total_ms for r in rows)
    for r in rows:
        r.share = r.total_ms / total if total > 0 else 1 / len(rows)
    return rows


def imbalance(rows: Sequence[StageRow]) -> float:
    """Slowest stage time / fastest stage time (1.0 is perfect; inf if one stage costs 0)."""
    times = [r.total_ms for r in rows]
    if max(times) == 0:
        return 1.0
    return max(times) / min(times) if min(times) > 0 else math.inf


def _kinds(kinds: list[str], width: int = 28) -> str:
    """Run-length: ``Linear, ReLU x3, Linear``, cut to `width` characters."""
    runs = [(k, len(list(group))) for k, group in groupby(kinds)]
    text = ", ".join(k if n == 1 else f"{k} x{n}" for k, n in runs)
    return text if len(text) <= width else text[:width - 3] + "..."


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def format_table(rows: Sequence[StageRow]) -> str:
    """`rows` as an aligned text table with the slowest / fastest ratio underneath."""
    head = ["stage", "layers", "kinds", "params", "fwd+bwd ms", "send ms", "activations", "memory",
            "share"]
    body = [[str(r.stage), f"{r.first}-{r.last}" if r.last > r.first else str(r.first),
             _kinds(r.kinds), _count(r.params), f"{r.time_ms:.2f}", f"{r.send_ms:.2f}",
             _bytes(r.activation_bytes), _bytes(r.memory_bytes),
             f"{100 * r.share:.1f}%"] for r in rows]
    widths = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    left = {1, 2}  # text columns; numbers are right-aligned

    def render(line: list[str]) -> str:
        cells = [c.ljust(w) if i in left or i == 0 else c.rjust(w)
                 for i, (c, w) in enumerate(zip(line, widths))]
        return "  ".join(cells).rstrip()

    lines = [render(head), *(render(line) for line in body)]
    lines.append(f"slowest / fastest stage: {imbalance(rows):.2f}x")
    return "\n".join(lines)
