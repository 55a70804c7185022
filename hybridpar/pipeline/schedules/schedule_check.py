"""Checks of schedules: every message pairs up in order (`validate`), and a timed run of the
action lists that finds deadlocks and draws timelines (`simulate`, `render_timeline`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from hybridpar.pipeline.schedules.schedule import (
    _KINDS,
    BACKWARD,
    COMPUTE,
    FORWARD,
    GRADIENT,
    GROUP,
    INPUT,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    WEIGHT,
    Action,
    Schedule,
    ScheduleError,
)

__all__ = ["SimResult", "Span", "render_timeline", "simulate", "validate"]


# A message kind travels on one channel: SEND_F on stage s pairs with RECV_F on s + 1.
_SEND_OF = {RECV_F: SEND_F, RECV_B: SEND_B}
_RECV_OF = {SEND_F: RECV_F, SEND_B: RECV_B}
_NEEDS = {FORWARD: RECV_F, BACKWARD: RECV_B, INPUT: RECV_B}   # W needs no message


def _peer(stage: int, kind: str) -> int:
    return stage - 1 if kind in (RECV_F, SEND_B) else stage + 1


def _check_stage(s: int, stages: int, actions: Sequence[Action]) -> None:
    """Local rules of one stage: kinds, endpoints, and each action after what it needs."""
    done: set[Action] = set()
    for action in actions:
        kind, i = action
        where = f"stage {s}: {action}"
        if kind not in _KINDS:
            raise ScheduleError(f"{where}: unknown kind {kind!r}; use one of {_KINDS}")
        if kind == GROUP:
            continue
        if isinstance(i, bool) or not isinstance(i, int) or i < 0:
            raise ScheduleError(f"{where}: micro-batch must be an integer >= 0, got {i!r}")
        if kind not in COMPUTE and not 0 <= _peer(s, kind) < stages:
            raise ScheduleError(f"{where}: stage {s} of {stages} has no peer for {kind}")
        if action in done:
            raise ScheduleError(f"{where} appears twice")
        before = {BACKWARD: FORWARD, INPUT: FORWARD, WEIGHT: INPUT}.get(kind)
        if before is not None and Action(before, i) not in done:
            raise ScheduleError(f"{where} comes before {before}{i} on the same stage")
        if kind in GRADIENT and {Action(BACKWARD, i), Action(INPUT, i)} & done:
            raise ScheduleError(f"{where}: micro-batch {i} is already backwarded")
        if kind in _NEEDS and 0 <= _peer(s, _NEEDS[kind]) < stages:
            if Action(_NEEDS[kind], i) not in done:
                raise ScheduleError(f"{where} needs {_NEEDS[kind]}{i} posted earlier")
        if kind in _RECV_OF:
            producers = (FORWARD,) if kind == SEND_F else GRADIENT
            if not {Action(p, i) for p in producers} & done:
                raise ScheduleError(f"{where} comes before {'/'.join(producers)}{i} that "
                                    "produces it")
        done.add(action)
    forwards = {i for kind, i in done if kind == FORWARD}
    backwards = {i for kind, i in done if kind in GRADIENT}
    if forwards != backwards:
        missing = sorted(forwards - backwards)
        raise ScheduleError(f"stage {s}: micro-batches {missing} are forwarded, never backwarded")
    halves = {i for kind, i in done if kind == INPUT} - {i for kind, i in done if kind == WEIGHT}
    if halves:
        raise ScheduleError(f"stage {s}: micro-batches {sorted(halves)} have I without W")


def _check_channel(src: int, dst: int, send: str, schedule: Schedule) -> None:
    """Sends on src and receives on dst of one kind pair up one to one, in the same order."""
    recv = _RECV_OF[send]
    sends = [i for kind, i in schedule[src] if kind == send]
    recvs = [i for kind, i in schedule[dst] if kind == recv]
    for i in sorted((Counter(sends) - Counter(recvs)).elements()):
        raise ScheduleError(f"stage {src}: {send}{i} has no matching {recv}{i} on stage {dst}")
    for i in sorted((Counter(recvs) - Counter(sends)).elements()):
        raise ScheduleError(f"stage {dst}: {recv}{i} has no matching {send}{i} on stage {src}")
    for k, (i, j) in enumerate(zip(sends, recvs)):
        if i != j:
            raise ScheduleError(
                f"stage {dst}: {recv}{j} is receive #{k} from stage {src} but send #{k} is "
                f"{send}{i}; it would silently get micro-batch {i}'s tensor. Post receives "
                f"in the send order {sends}, not {recvs}"
            )


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` unless every message pairs up in order (deadlock: `simulate`)."""
    if not schedule:
        raise ScheduleError("a schedule needs at least one stage")
    stages = len(schedule)
    for s, actions in enumerate(schedule):
        _check_stage(s, stages, actions)
    microbatches = {i for kind, i in schedule[0] if kind == FORWARD}
    for s, actions in enumerate(schedule):
        mine = {i for kind, i in actions if kind == FORWARD}
        if mine != microbatches:
            raise ScheduleError(
                f"stage {s} computes micro-batches {sorted(mine)} but stage 0 computes "
                f"{sorted(microbatches)}; every stage must run each micro-batch once"
            )
    for s in range(stages - 1):
        _check_channel(s, s + 1, SEND_F, schedule)
        _check_channel(s + 1, s, SEND_B, schedule)


class Span(NamedTuple):
    """When one compute action ran on its stage."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """Timing of a simulated step; `spans[s]` lists stage s's compute actions in order."""

    makespan: float
    busy: list[float]
    idle: list[float]
    spans: list[list[Span]]

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-time spent idle: (p - 1) / (m + p - 1) for GPipe and 1F1B."""
        total = self.makespan * len(self.busy)
        return sum(self.idle) / total if total else 0.0


def simulate(
    schedule: Schedule,
    *,
    forward_time: float = 1.0,
    backward_time: float = 1.0,
    weight_time: float = 0.0,
    transfer_time: float = 0.0,
) -> SimResult:
    """Run every stage's actions in order with the given durations; prove there's no deadlock.

    I takes `backward_time`, W `weight_time` and B, their sum, both.
    Sends never block and put the message on its channel `transfer_time` after they are
    posted; a compute waits for the message it needs. Raises `ScheduleError` for unmatched
    or reordered messages (see `validate`) and for a deadlock, naming what each stage waits on.
    """
    validate(schedule)
    durations = {FORWARD: forward_time, BACKWARD: backward_time + weight_time,
                 INPUT: backward_time, WEIGHT: weight_time}
    stages = len(schedule)
    clock = [0.0] * stages
    pc = [0] * stages
    arrival: dict[tuple[int, int, str, int], float] = {}  # (src, dst, send kind, mb) -> time
    spans: list[list[Span]] = [[] for _ in range(stages)]

    def waits_for(s: int) -> tuple[int, int, str, int] | None:
        """The message the next action of stage s needs that has not been sent yet."""
        kind, i = schedule[s][pc[s]]
        if kind in _NEEDS and 0 <= _peer(s, _NEEDS[kind]) < stages:
            key = (_peer(s, _NEEDS[kind]), s, _SEND_OF[_NEEDS[kind]], i)
            if key not in arrival:
                return key
        return None

    progress = True
    while progress:
        progress = False
        for s, actions in enumerate(schedule):
            while pc[s] < len(actions) and waits_for(s) is None:
                action = actions[pc[s]]
                kind, i = action
                if kind in _RECV_OF:
                    arrival[(s, _peer(s, kind), kind, i)] = clock[s] + transfer_time
                elif kind in COMPUTE:
                    start = clock[s]
                    if kind in _NEEDS and 0 <= _peer(s, _NEEDS[kind]) < stages:
                        key = (_peer(s, _NEEDS[kind]), s, _SEND_OF[_NEEDS[kind]], i)
                        start = max(start, arrival[key])
                    clock[s] = start + durations[kind]
                    spans[s].append(Span(action, start, clock[s]))
                pc[s] += 1
                progress = True

    blocked = [s for s in range(stages) if pc[s] < len(schedule[s])]
    if blocked:
        reasons = []
        for s in blocked:
            src, _, send, i = waits_for(s) or (s, s, "?", -1)
            reasons.append(f"stage {s} waits at {schedule[s][pc[s]]} for {send}{i} of stage {src}")
        raise ScheduleError("deadlock: " + "; ".join(reasons))

    makespan = max(clock, default=0.0)
    busy = [sum(span.end - span.start for span in stage) for stage in spans]
    return SimResult(makespan, busy, [makespan - b for b in busy], spans)


def render_timeline(schedule: Schedule) -> list[str]:
    """The picture of the docstrings: one slot per unit-time compute, dots when idle."""
    result = simulate(schedule)
    slots = round(result.makespan)
    labels = [str(span.action) for spans in result.spans for span in spans]
    width = max((len(label) for label in labels), default=1)
    digits = len(str(len(schedule) - 1))
    lines = []
    for s, spans in enumerate(result.spans):
        cells = ["."] * slots
        for span in spans:
            cells[round(span.start)] = str(span.action)
        row = " ".join(cell.ljust(width) for cell in cells)
        lines.append(f"stage {s:>{digits}} | {row}".rstrip())
    return lines
