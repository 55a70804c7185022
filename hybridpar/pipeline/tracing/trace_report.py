"""A traced step written out: every rank's events on rank 0, a Chrome trace and a bubble table.

    pipe = HybridPipe(model, balance, chunks=m, loss_fn=..., trace=True)
    pipe.train_step(x, y)             # records this rank's timeline (the last step is kept)
    pipe.write_trace("trace/")        # on every rank: trace.json, gantt.png, table.txt

Events travel as tensors, not pickles: each rank's rows (`hybridpar.trace.COLUMNS`, int64
nanoseconds of the shared wall clock) are padded to the longest and gathered to rank 0, after
one all-reduce of the row counts.

The table measures each stage against the window of the step (first start to last end over
all ranks), as the analytic bubble of GPipe and 1F1B does with the makespan:

    column      meaning (mean over the ranks of the stage)
    busy %      forward + backward + recompute time (tp collectives inside them included)
    bubble %    100 - busy %: idle, waiting or communicating
    wait %      the part of the bubble spent blocked on a peer's message (or send completion)
    analytic %  (p - 1) / (m + p - 1), the bubble of equal stages with free communication
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from hybridpar.io.files import atomic_write_text
from hybridpar.pipeline.schedules.lowering import BWD, FWD, SKIP, SKIPG
from hybridpar.pipeline.schedules.planned import get_plan
from hybridpar.pipeline.schedules.simulate import Timing, simulate_plan
from hybridpar.trace import COLUMNS, KINDS, OPS, Recorder

if TYPE_CHECKING:
    from hybridpar.pipe.steps import PipeSteps

__all__ = ["Event", "StageRow", "TraceReport", "TraceRequest", "analytic_bubble",
           "chrome_trace", "compute_times", "format_table", "gather_events", "request_trace",
           "simulated_step", "stage_table", "traced_step", "write_trace"]

log = logging.getLogger(__name__)

COMPUTE = ("forward", "backward", "recompute", "weight")
_CHANNEL = {FWD: "F", BWD: "B", SKIP: "SKIP", SKIPG: "SKIPG"}
_LETTER = {"forward": "F", "backward": "B", "recompute": "R", "weight": "W"}


class Event(NamedTuple):
    """One span of one rank, times in nanoseconds of the wall clock."""

    rank: int
    kind: str
    op: str
    stage: int
    microbatch: int
    peer: int
    channel: int
    nbytes: int
    start: int
    end: int

    @property
    def name(self) -> str:
        """``F3``, ``B3``, ``R3`` (recompute), ``SEND_F3``, ``RECV_B3``, ``all_reduce``..."""
        if self.kind in _LETTER:
            return f"{_LETTER[self.kind]}{self.microbatch}"
        if self.kind in ("send", "recv"):
            return f"{self.kind.upper()}_{_CHANNEL.get(self.channel, self.channel)}" \
                   f"{self.microbatch}"
        return self.op or self.kind


def gather_events(recorder: Recorder, *, device: torch.device | None = None
                  ) -> list[list[Event]] | None:
    """Every rank's events of its `recorder`, on global rank 0 (None elsewhere); call on every
    rank.

    Raises `ValueError` on every rank when some rank recorded nothing.
    """
    rows = torch.tensor(recorder.events, dtype=torch.int64).reshape(-1, len(COLUMNS))
    world, rank = dist.get_world_size(), dist.get_rank()
    counts = torch.zeros(world, dtype=torch.int64, device=device)
    counts[rank] = rows.shape[0]
    dist.all_reduce(counts)
    sizes = counts.tolist()
    if min(sizes) == 0:
        empty = [r for r, n in enumerate(sizes) if n == 0]
        raise ValueError(f"ranks {empty} recorded no step: build HybridPipe(..., trace=True) "
                         "(or set pipe.trace = True) on every rank and run a step before "
                         "writing the trace")
    padded = torch.zeros(max(sizes), len(COLUMNS), dtype=torch.int64, device=device)
    padded[:rows.shape[0]] = rows.to(padded.device)
    parts = [torch.empty_like(padded) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, parts, dst=0)
    if parts is None:
        return None
    return [[Event(r, KINDS[k], OPS[o], *rest) for k, o, *rest in part[:n].cpu().tolist()]
            for r, (part, n) in enumerate(zip(parts, sizes))]


def _every_ranks(value: int, *, device: torch.device | None) -> list[int]:
    """Each rank's `value`, on every rank (one all-reduce)."""
    values = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    values[dist.get_rank()] = value
    dist.all_reduce(values)
    return [int(v) for v in values.tolist()]


def analytic_bubble(stages: int, microbatches: int) -> float:
    """(p - 1) / (m + p - 1): the idle share of GPipe and 1F1B with equal stages."""
    return (stages - 1) / (microbatches + stages - 1)


def simulated_step(schedule: str, stages: int, microbatches: int,
                   times: tuple[float, float, float], *, virtual: int = 1) -> Timing:
    """`schedule`'s step over `stages` ranks of `virtual` equal stages each taking `times`
    (t_f, t_b, t_w) per micro-batch: t_b is B, or I under a split backward, whose W takes
    t_w (`simulate.simulate_plan`)."""
    t_f, t_b, t_w = times
    plan = get_plan(schedule)(stages, microbatches,
                              virtual=virtual if schedule == "interleaved" else None)
    return simulate_plan(plan, forward_time=t_f, backward_time=t_b, weight_time=t_w)


def _window(ranks: Sequence[Sequence[Event]]) -> tuple[int, int]:
    steps = [e for events in ranks for e in events if e.kind == "step"] or \
        [e for events in ranks for e in events]
    return min(e.start for e in steps), max(e.end for e in steps)


# Chrome trace --------------------------------------------------------------------------------

def chrome_trace(ranks: Sequence[Sequence[Event]], *, labels: Sequence[str],
                 meta: dict[str, Any]) -> dict[str, Any]:
    """The Trace Event Format object: a track per rank, a flow arrow per send -> receive.

    One process holds a thread track per rank (``tid = rank + 1``: Perfetto keeps 0 for the
    idle thread). Sends and receives pair by (source, destination, channel, micro-batch), one
    message per step; an arrow starts inside the send and ends inside the receive just after
    its last wait, when the message had arrived.
    """
    t0 = min(e.start for events in ranks for e in events)

    def us(ns: int) -> float:
        return round((ns - t0) / 1000, 3)

    pid = 1
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": meta.get("title", "")}}]
    for rank, events in enumerate(ranks):
        tid = rank + 1
        out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": {"name": labels[rank]}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                    "args": {"sort_index": rank}})
        for e in events:
            fields = (("stage", e.stage), ("microbatch", e.microbatch), ("peer", e.peer))
            args: dict[str, int | str] = {k: v for k, v in fields if v >= 0}
            if e.nbytes:
                args["bytes"] = e.nbytes
            if e.channel >= 0:
                args["channel"] = _CHANNEL.get(e.channel, str(e.channel))
            out.append({"ph": "X", "name": e.name, "cat": e.kind, "pid": pid, "tid": tid,
                        "ts": us(e.start), "dur": round(us(e.end) - us(e.start), 3),
                        "args": args})
    sends = {(e.rank, e.peer, e.channel, e.microbatch): e
             for events in ranks for e in events if e.kind == "send"}
    arrived = {(e.peer, e.rank, e.channel, e.microbatch): e.end   # the last wait wins
               for events in ranks for e in events if e.kind == "wait" and e.channel >= 0}
    flow = 0
    for events in ranks:
        for e in events:
            key = (e.peer, e.rank, e.channel, e.microbatch)
            if e.kind != "recv" or key not in sends:
                continue
            send, flow = sends[key], flow + 1
            came = max(arrived.get(key, e.start), e.start)
            common = {"name": e.name.replace("RECV", "P2P"), "cat": "p2p", "id": flow,
                      "pid": pid}
            out.append({**common, "ph": "s", "tid": send.rank + 1,
                        "ts": us((send.start + send.end) // 2)})
            out.append({**common, "ph": "f", "bp": "e", "tid": e.rank + 1,
                        "ts": us(came + min(1000, (e.end - came) // 2))})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": meta}


# the bubble table ----------------------------------------------------------------------------

@dataclass
class StageRow:
    """One stage's share of the step, averaged over its ranks (fractions of the window)."""

    stage: int
    ranks: list[int]
    forwards: int
    backwards: int
    recomputes: int
    weights: int
    busy_ms: float
    busy: float
    bubble: float
    wait: float
    analytic: float
    kept: int = 0        # the most bytes one of its ranks kept for backward at once


def _overlap(e: Event, lo: int, hi: int) -> int:
    return max(0, min(e.end, hi) - max(e.start, lo))


def stage_table(ranks: Sequence[Sequence[Event]], *, stage_of: Sequence[int],
                microbatches: int, bubble: float | None = None,
                kept: Sequence[int] | None = None) -> list[StageRow]:
    """Busy, bubble and wait of each stage over the step window, against the analytic bubble
    (default: GPipe's and 1F1B's); `kept`: each rank's peak bytes saved for backward."""
    lo, hi = _window(ranks)
    span = max(hi - lo, 1)
    stages = max(stage_of) + 1
    if bubble is None:
        bubble = analytic_bubble(stages, microbatches)
    rows = []
    for s in range(stages):
        members = [r for r, st in enumerate(stage_of) if st == s]
        busy = [sum(_overlap(e, lo, hi) for e in ranks[r] if e.kind in COMPUTE) for r in members]
        wait = [sum(_overlap(e, lo, hi) for e in ranks[r] if e.kind == "wait") for r in members]
        first = ranks[members[0]]
        mean_busy, mean_wait = sum(busy) / len(members), sum(wait) / len(members)
        rows.append(StageRow(
            stage=s, ranks=members,
            forwards=sum(e.kind == "forward" for e in first),
            backwards=sum(e.kind == "backward" for e in first),
            recomputes=sum(e.kind == "recompute" for e in first),
            weights=sum(e.kind == "weight" for e in first),
            busy_ms=mean_busy / 1e6, busy=mean_busy / span, bubble=1 - mean_busy / span,
            wait=mean_wait / span, analytic=bubble,
            kept=max(kept[r] for r in members) if kept is not None else 0))
    return rows


def compute_times(ranks: Sequence[Sequence[Event]]) -> tuple[float, float, float]:
    """(t_f, t_b, t_w) in ms: the mean forward, backward + recompute (B, or I), and deferred
    weight gradients (W; 0 unless the backward is split) of one micro-batch."""

    def mean(kinds: tuple[str, ...], per: str) -> float:
        spans = [e for events in ranks for e in events if e.kind in kinds]
        count = sum(e.kind == per for events in ranks for e in events)
        return sum(e.end - e.start for e in spans) / 1e6 / count if count else 0.0

    return (mean(("forward",), "forward"), mean(("backward", "recompute"), "backward"),
            mean(("weight",), "weight"))


def format_table(rows: Sequence[StageRow], *, step_ms: float, microbatches: int,
                 times: tuple[float, float, float], header: str, schedule: str = "1f1b",
                 simulated: Timing | None = None) -> str:
    """The rows as the text `write_trace` prints and saves in table.txt (`simulated`: the
    `schedule`'s step with the measured `times`, when W ran or a rank holds several
    stages)."""
    lines = [header, f"step {step_ms:.3f} ms: first rank's start to last rank's end", ""]
    names = ("stage", "ranks", "F", "B", "R", "W", "busy ms", "busy %", "bubble %", "wait %",
             "analytic %", "kept MiB")
    cells = [[str(r.stage), ",".join(map(str, r.ranks)), str(r.forwards), str(r.backwards),
              str(r.recomputes), str(r.weights), f"{r.busy_ms:.3f}", f"{100 * r.busy:.1f}",
              f"{100 * r.bubble:.1f}", f"{100 * r.wait:.1f}", f"{100 * r.analytic:.1f}",
              f"{r.kept / 2**20:.3g}"] for r in rows]
    n = len(rows)
    cells.append(["mean", "", "", "", "", "", f"{sum(r.busy_ms for r in rows) / n:.3f}",
                  f"{100 * sum(r.busy for r in rows) / n:.1f}",
                  f"{100 * sum(r.bubble for r in rows) / n:.1f}",
                  f"{100 * sum(r.wait for r in rows) / n:.1f}", f"{100 * rows[0].analytic:.1f}",
                  f"{sum(r.kept for r in rows) / n / 2**20:.3g}"])
    widths = [max(len(name), *(len(c[i]) for c in cells)) for i, name in enumerate(names)]
    for line in [list(names), *cells]:
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths))).rstrip())
    p, m = len(rows), microbatches
    (t_f, t_b, t_w), slots = times, m + p - 1
    lines += ["", "busy: forward + backward + recompute + weight; bubble: 100 - busy (idle, "
              "waiting, communicating);",
              "kept: the most bytes a rank of the stage held saved for backward at once "
              "(activations: what the checkpoint mode keeps);"]
    if simulated is None:
        bound = slots * (t_f + t_b)
        lines += [f"wait: blocked on a peer; analytic: (p - 1) / (m + p - 1) = {p - 1}/{slots}",
                  f"bound: (m + p - 1)(t_f + t_b) = {slots} x ({t_f:.3f} + {t_b:.3f}) ms = "
                  f"{bound:.3f} ms with the mean measured t_f, t_b: "
                  f"{bound / step_ms if step_ms else 0:.2f} of the step"]
    else:   # split or virtual: the bound is the schedule's own simulation
        bound = simulated.makespan
        parts = "B: the input-gradient part (I), W: the deferred weight gradients" if t_w \
            else "B: the whole backward"
        each = "" if simulated.plan.virtual == 1 else \
            f" (each of a rank's {simulated.plan.virtual} stages)"
        lines += [f"wait: blocked on a peer; {parts};",
                  f"analytic and bound: {schedule}'s simulated step with "
                  f"the mean measured t_f, t_b, t_w{each} = {t_f:.3f}, {t_b:.3f}, {t_w:.3f} ms: "
                  f"{bound:.3f} ms, {bound / step_ms if step_ms else 0:.2f} of the step"]
    return "\n".join(lines) + "\n"


# writing -------------------------------------------------------------------------------------

@dataclass
class TraceReport:
    """What `write_trace` wrote on rank 0, and the table it printed."""

    folder: Path
    files: list[Path]
    table: str
    rows: list[StageRow]
    step_ms: float
    events: list[list[Event]] = field(repr=False, default_factory=list)


def write_trace(pipe: PipeSteps, folder: str | os.PathLike[str], *,
                show: bool = True) -> TraceReport | None:
    """Gather the last traced step of every rank and write it to `folder` (see the module)."""
    from hybridpar.pipeline.tracing.trace_gantt import write_gantt

    kept = _every_ranks(int(pipe.recorder.meta.get("kept", 0)), device=pipe.device)
    ranks = gather_events(pipe.recorder, device=pipe.device)
    if ranks is None:
        return None
    topo, meta = pipe.topology, dict(pipe.recorder.meta)
    coords = [topo.dims.coordinate(r) for r in range(len(ranks))]
    m = int(meta.get("microbatches", pipe.chunks))
    title = (f"{meta.get('what', 'step')} on {len(ranks)} ranks: pp={topo.pp} tp={topo.tp} "
             f"dp={topo.dp}, {pipe.schedule}, m={m} micro-batches, checkpoint "
             f"{pipe.checkpoint!r}")
    held = [pipe.layout.stages_of(c.pp) for c in coords]   # virtual: several stages a rank
    labels = [f"rank {r} | stage{'s' * (len(h) > 1)} {', '.join(map(str, h))} | tp {c.tp} | "
              f"dp {c.dp}" for r, (c, h) in enumerate(zip(coords, held))]
    lo, hi = _window(ranks)
    times = compute_times(ranks)
    # a split backward (W ran) or virtual stages: the schedule's own simulated step, once
    virtual = pipe.layout.virtual
    simulated = simulated_step(pipe.schedule, topo.pp, m, times, virtual=virtual) \
        if times[2] or virtual > 1 else None
    bubble = analytic_bubble(topo.pp, m) if simulated is None else simulated.bubble_fraction
    rows = stage_table(ranks, stage_of=[c.pp for c in coords], microbatches=m, bubble=bubble,
                       kept=kept)
    table = format_table(rows, step_ms=(hi - lo) / 1e6, microbatches=m, times=times,
                         header=title, schedule=pipe.schedule, simulated=simulated)
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    trace = chrome_trace(ranks, labels=labels, meta={
        "title": title, "pp": topo.pp, "tp": topo.tp, "dp": topo.dp, "microbatches": m,
        "schedule": pipe.schedule, "checkpoint": pipe.checkpoint,
        "analytic_bubble": bubble, "kept_bytes": kept})
    atomic_write_text(out / "trace.json", json.dumps(trace))
    atomic_write_text(out / "table.txt", table)
    files = [out / "trace.json", out / "table.txt"]
    if write_gantt(out / "gantt.png", ranks, labels=labels, window=(lo, hi), title=title):
        files.append(out / "gantt.png")
    if show:
        print(table, end="", flush=True)
    return TraceReport(out, files, table, rows, (hi - lo) / 1e6, [list(e) for e in ranks])


# one step of a training loop -----------------------------------------------------------------

@dataclass
class TraceRequest:
    """Which training step `traced_step` traces (None: the last), and where it goes."""

    folder: Path
    step: int | None = None
    done: bool = False


def request_trace(folder: str | os.PathLike[str], *, step: int | None = None) -> TraceRequest:
    """A request to trace step `step` (1-based; None: the last) into `folder`, for `train(...,
    trace=...)` (``hybridpar run --trace [--trace-step N]``)."""
    return TraceRequest(Path(folder), step)


@contextmanager
def traced_step(pipe: PipeSteps, request: TraceRequest | None, *, step: int,
                last: int) -> Iterator[None]:
    """Trace `pipe` inside when `step` is the one `request` asks for (`last`: the run's final
    step), then write the trace on every rank; otherwise (or with no request) do nothing."""
    if request is None or request.done or step != (request.step or last):
        yield
        return
    before, pipe.trace = pipe.trace, True
    try:
        yield
    finally:
        pipe.trace = before
    write_trace(pipe, request.folder)
    request.done = True
    log.info("traced step %d into %s", step, request.folder)
