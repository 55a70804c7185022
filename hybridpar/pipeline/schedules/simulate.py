"""The timed simulator of plans: each task's start and end, makespan, bubble, live activations."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

from hybridpar.pipeline.schedules.plan import (
    BACKWARD,
    FORWARD,
    INPUT,
    WEIGHT,
    Plan,
    Task,
    label,
    validate_plan,
)
from hybridpar.pipeline.schedules.schedule import ScheduleError

__all__ = ["TaskSpan", "Timing", "render_timing", "simulate_plan", "unit_ends"]

Times = float | Sequence[float]   # one duration for every virtual stage, or one per stage


class TaskSpan(NamedTuple):
    """When one task ran on its rank."""

    task: Task
    start: float
    end: float


@dataclass(frozen=True)
class Timing:
    """A simulated step: `spans[r]` lists rank r's tasks in order with their times.

    `live[r]` is rank r's peak of live activations in full-stage micro-batches: a task
    F(i, s) holds stage s's activations of micro-batch i from its start until its W (or its
    B) ends, and each stage holds 1 / v of what the rank's whole share of the model would, so
    v live (micro-batch, stage) pairs count as one micro-batch (ZBV: two half stages).
    """

    makespan: float
    spans: list[list[TaskSpan]]
    busy: list[float]
    live: list[float]
    plan: Plan

    @property
    def idle(self) -> list[float]:
        """Per rank, the time within the makespan it computes nothing."""
        return [self.makespan - b for b in self.busy]

    @property
    def bubble_fractions(self) -> list[float]:
        """Per rank, idle / makespan."""
        return [i / self.makespan if self.makespan else 0.0 for i in self.idle]

    @property
    def bubble_fraction(self) -> float:
        """Share of rank-time spent idle (all ranks)."""
        total = self.makespan * len(self.busy)
        return sum(self.idle) / total if total else 0.0


def _duration_of(times: Times, stages: int, name: str) -> Callable[[int], float]:
    if isinstance(times, (int, float)):
        value = float(times)
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {times}")
        return lambda s: value
    values = [float(t) for t in times]
    if len(values) != stages or any(t < 0 for t in values):
        raise ValueError(f"{name} must be one time >= 0, or one per virtual stage ({stages}); "
                         f"got {list(times)}")
    return values.__getitem__


def _run(plan: Plan, duration: Callable[[Task], float], latency: float) -> list[list[TaskSpan]]:
    """Each rank runs its tasks in order, one at a time, each as soon as what it needs ended
    (a need on another rank: `latency` later). Raises `ScheduleError` on a deadlock."""
    validate_plan(plan)
    last = plan.stages - 1
    ends: dict[tuple[str, int, int], float] = {}   # (F | grad | W, micro-batch, stage) -> end

    def needs(task: Task) -> list[tuple[str, int, int]]:
        kind, i, s = task
        if kind == FORWARD:
            return [(FORWARD, i, s - 1)] if s > 0 else []
        if kind == WEIGHT:
            return [("grad", i, s)]
        return [(FORWARD, i, s)] + ([("grad", i, s + 1)] if s < last else [])

    clock = [0.0] * plan.ranks
    pc = [0] * plan.ranks
    spans: list[list[TaskSpan]] = [[] for _ in range(plan.ranks)]
    progress = True
    while progress:
        progress = False
        for r, tasks in enumerate(plan.tasks):
            while pc[r] < len(tasks) and all(n in ends for n in needs(tasks[pc[r]])):
                task = tasks[pc[r]]
                start = clock[r]
                for need in needs(task):
                    far = plan.placement[need[2]] != r
                    start = max(start, ends[need] + (latency if far else 0.0))
                clock[r] = start + duration(task)
                key = "grad" if task.kind in (INPUT, BACKWARD) else task.kind
                ends[key, task.microbatch, task.stage] = clock[r]
                spans[r].append(TaskSpan(task, start, clock[r]))
                pc[r] += 1
                progress = True
    blocked = [r for r in range(plan.ranks) if pc[r] < len(plan.tasks[r])]
    if blocked:
        reasons = []
        for r in blocked:
            task = plan.tasks[r][pc[r]]
            kind, i, s = next(n for n in needs(task) if n not in ends)
            what = f"{'I or B' if kind == 'grad' else kind} of micro-batch {i} on stage {s}"
            reasons.append(f"rank {r} waits at {task} for {what}")
        raise ScheduleError("deadlock: " + "; ".join(reasons))
    return spans


def _live(plan: Plan) -> list[float]:
    peaks = []
    for tasks in plan.tasks:
        live = peak = 0
        for task in tasks:
            live += task.kind == FORWARD
            peak = max(peak, live)
            live -= task.kind in (WEIGHT, BACKWARD)
        peaks.append(peak / plan.virtual)
    return peaks


def simulate_plan(plan: Plan, *, forward_time: Times = 1.0, backward_time: Times = 1.0,
                  weight_time: Times = 1.0, latency: float = 0.0) -> Timing:
    """Time a plan: F takes `forward_time`, I `backward_time`, W `weight_time`, a full B
    their sum (each a number, or one per virtual stage, default 1); a message between two
    ranks takes `latency`. With `weight_time` 0 a v = 1 plan times like `schedule_check.simulate`
    with the same `backward_time`; with unit F, I and W:

        from_schedule(one_f_one_b(2, 2)): makespan (m + p - 1)(F + I + W) = 9
        rank 0 | F0 F1 .  .  B0 -  .  B1 -
        rank 1 | .  F0 B0 -  F1 B1 -  .  .
    """
    if latency < 0:
        raise ValueError(f"latency must be >= 0, got {latency}")
    f, i, w = (_duration_of(t, len(plan.placement), n) for t, n in (
        (forward_time, "forward_time"), (backward_time, "backward_time"),
        (weight_time, "weight_time")))
    durations = {FORWARD: f, INPUT: i, WEIGHT: w, BACKWARD: lambda s: i(s) + w(s)}
    spans = _run(plan, lambda task: durations[task.kind](task.stage), latency)
    makespan = max((r[-1].end for r in spans if r), default=0.0)
    busy = [sum(span.end - span.start for span in r) for r in spans]
    return Timing(makespan, spans, busy, _live(plan), plan)


def unit_ends(plan: Plan) -> dict[tuple[int, Task], int]:
    """When each task ends in a unit-time run (every task, B included, one slot; no latency):
    the slots of `plan_lowering` (`schedule.end_times` of plans)."""
    spans = _run(plan, lambda task: 1.0, 0.0)
    return {(r, span.task): round(span.end) for r, rank in enumerate(spans) for span in rank}


def render_timing(timing: Timing, *, max_cells: int = 400) -> list[str]:
    """The timeline, one row per rank, one cell per unit of time (the largest that divides
    every start and end); a task's first cell is its label, the rest ``-``, idle ``.``:

        rank 0 | F0 F1 .  I0 W0 I1 W1
        rank 1 | .  F0 I0 F1 I1 W0 W1
    """
    times = [Fraction(t).limit_denominator(1000) for rank in timing.spans
             for span in rank for t in (span.start, span.end)]
    unit = Fraction(0)
    for t in times:
        unit = Fraction(math.gcd(unit.numerator * t.denominator, t.numerator * unit.denominator),
                        unit.denominator * t.denominator)
    cells = round(Fraction(timing.makespan).limit_denominator(1000) / unit) if unit else 0
    if cells > max_cells:
        return [f"(timeline of {cells} cells not drawn: times with a coarser common unit)"]
    labels = [label(span.task, timing.plan) for rank in timing.spans for span in rank]
    width = max((len(text) for text in labels), default=1)
    digits = len(str(len(timing.spans) - 1))
    lines = []
    for r, rank in enumerate(timing.spans):
        row = ["."] * cells
        for span in rank:
            first = round(Fraction(span.start).limit_denominator(1000) / unit)
            last = round(Fraction(span.end).limit_denominator(1000) / unit)
            if last == first:
                continue   # a task that takes no time has no cell
            row[first:last] = [label(span.task, timing.plan)] + ["-"] * (last - first - 1)
        lines.append(f"rank {r:>{digits}} | " + " ".join(c.ljust(width) for c in row).rstrip())
    return lines
