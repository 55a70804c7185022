"""Schedules as data: which action each pipeline stage takes, in order, and a simulator."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar

__all__ = [
    "BACKWARD",
    "COMPUTE",
    "FORWARD",
    "GRADIENT",
    "GROUP",
    "INPUT",
    "RECV_B",
    "RECV_F",
    "SCHEDULES",
    "SEND_B",
    "SEND_F",
    "WEIGHT",
    "Action",
    "Comm",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "Span",
    "end_times",
    "get_schedule",
    "gpipe",
    "groups",
    "live_microbatches",
    "one_f_one_b",
    "place",
    "render",
    "render_timeline",
    "simulate",
    "validate",
    "zero_bubble_h1",
]

# The vocabulary of a stage's action list. Stage s talks only to s - 1 and s + 1:
#
#   kind    peer     meaning
#   F       -        forward micro-batch i (on the last stage this includes the loss)
#   B       -        backward micro-batch i (needs F(i) earlier on the same stage)
#   I       -        its input-gradient half (zero-bubble): B without the linear layers'
#                    weight gradients, which wait for W (`split_backward`)
#   W       -        those weight gradients (needs I(i) earlier; no message)
#   RECV_F  s - 1    post a non-blocking receive of the activation of micro-batch i
#   SEND_F  s + 1    post a non-blocking send of the output of F(i) (after F(i))
#   RECV_B  s + 1    post a non-blocking receive of the output gradient of micro-batch i
#   SEND_B  s - 1    post a non-blocking send of the input gradient of B(i) (after B(i))
#   GROUP   -        end the group of communication here (-1: no micro-batch)
#
# The communication actions between two compute actions form one group, issued together
# (`groups`). A receive only posts; the F / B that consumes the data waits for it. Sends are
# awaited at the end of the step. Messages between two ranks match by order alone (as NCCL
# matches them), so the micro-batch order of both sides must agree: a swap gives silently
# wrong numbers.
FORWARD = "F"
BACKWARD = "B"
INPUT = "I"
WEIGHT = "W"
RECV_F = "RECV_F"
SEND_F = "SEND_F"
RECV_B = "RECV_B"
SEND_B = "SEND_B"
COMPUTE = (FORWARD, BACKWARD, INPUT, WEIGHT)
GRADIENT = (BACKWARD, INPUT)   # the computes that send an input gradient upstream
GROUP = "GROUP"   # ends a group of communication without a compute (two slots in a row)
_KINDS = (FORWARD, BACKWARD, INPUT, WEIGHT, RECV_F, SEND_F, RECV_B, SEND_B, GROUP)


class Action(NamedTuple):
    """One step of a stage: `kind` (F, B, RECV_F, SEND_F, RECV_B, SEND_B) of a micro-batch."""

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return self.kind if self.kind == GROUP else f"{self.kind}{self.microbatch}"


Schedule = list[list[Action]]


class _Kinded(Protocol):
    @property
    def kind(self) -> str: ...


ActionLike = TypeVar("ActionLike", bound=_Kinded)   # an Action, or a lowered Comm


class ScheduleError(ValueError):
    """A schedule that would mismatch messages or deadlock."""


def _check_sizes(stages: int, microbatches: int) -> None:
    for name, value in (("stages", stages), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


class Comm(NamedTuple):
    """A communication action limited to one peer stage (a skip's message in its own slot)."""

    kind: str
    microbatch: int
    peer: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


Peers = Callable[[int, str, int], list[int]]   # (stage, SEND_F/RECV_F/..., mb) -> peer stages


def _adjacent(stages: int) -> Peers:
    def peers(stage: int, kind: str, microbatch: int) -> list[int]:
        peer = stage + 1 if kind in (SEND_F, RECV_B) else stage - 1
        return [peer] if 0 <= peer < stages else []
    return peers


def end_times(orders: Sequence[Sequence[Action]]) -> dict[tuple[int, Action], int]:
    """When each compute ends in a unit-time run of the stages' compute orders (F needs F of
    the stage before, B (or I) the B (or I) of the stage after, W only its own stage's I)."""
    stages = len(orders)
    end: dict[tuple[int, Action], int] = {}
    clock, pc = [0] * stages, [0] * stages
    progress = True
    while progress:
        progress = False
        for s, order in enumerate(orders):
            while pc[s] < len(order):
                action = order[pc[s]]
                peer = s - 1 if action.kind == FORWARD else s + 1
                need = (peer, action) if 0 <= peer < stages and action.kind != WEIGHT \
                    else None
                if need is not None and need not in end:
                    break
                clock[s] = max(clock[s], end[need] if need else 0) + 1
                end[s, action] = clock[s]
                pc[s] += 1
                progress = True
    if any(pc[s] < len(order) for s, order in enumerate(orders)):
        raise ScheduleError("the compute orders of the stages wait on each other (deadlock)")
    return end


def place(orders: Sequence[Sequence[Action]], *, peers: Peers | None = None
          ) -> list[list[Action | Comm]]:
    """Insert each stage's sends and receives, every message in its *slot*.

    A message's slot is the time its producer ends in a unit-time run (`end_times`). Both
    ends put it in the same slot, each stage issues its slots in time order, and the
    communication of one slot is one group (one `batch_isend_irecv`), issued before the
    computes that start at or after it. A rendezvous in slot t so only ever waits for ranks
    at slot t: NCCL progresses, whatever the peers (`peers`: which stages each SEND / RECV
    of a micro-batch talks to; default the neighbours). Without skips this is Megatron's
    pairing (send_forward_recv_backward, ...), with each receive posted as early as its
    message exists:

        compute  F0 F1 B1 B0   on stage 1 of 3, GPipe
        actions  RECV_F0 | F0 | RECV_F1 SEND_F0 | F1 | SEND_F1 GROUP RECV_B1 | B1 |
                 SEND_B1 RECV_B0 | B0 | SEND_B0

    A communication action whose messages fall in different slots (a skip from a stage
    further away) is split into one `Comm` per peer.
    """
    stages = len(orders)
    peers = peers if peers is not None else _adjacent(stages)
    end = end_times(orders)
    placed = []
    for s, order in enumerate(orders):
        # (time, 0 = communication | 1 = compute, tie-break, action)
        events: list[tuple[int, int, int, Action | Comm]] = []
        for position, action in enumerate(order):
            events.append((end[s, action] - 1, 1, position, action))
            if action.kind == WEIGHT:   # local: no message
                continue
            i = action.microbatch
            send, recv = (SEND_F, RECV_F) if action.kind == FORWARD else (SEND_B, RECV_B)
            slots: dict[tuple[str, int], list[int]] = {}   # (kind, slot) -> peers
            for peer in peers(s, send, i):
                slots.setdefault((send, end[s, action]), []).append(peer)
            for peer in peers(s, recv, i):
                slots.setdefault((recv, end[peer, action]), []).append(peer)
            whole = {kind: sum(k == kind for k, _ in slots) == 1 for kind in (send, recv)}
            for (kind, slot), group in slots.items():
                if whole[kind]:
                    events.append((slot, 0, group[0], Action(kind, i)))
                else:
                    events += [(slot, 0, peer, Comm(kind, i, peer)) for peer in group]
        events.sort(key=lambda e: e[:3])
        actions: list[Action | Comm] = []
        for k, (slot, is_compute, _, item) in enumerate(events):
            if k and not is_compute and not events[k - 1][1] and events[k - 1][0] != slot:
                actions.append(Action(GROUP, -1))   # two slots with no compute between
            actions.append(item)
        placed.append(actions)
    return placed


def _build(stages: int, order: Callable[[int], list[Action]]) -> Schedule:
    return [list(map(_as_action, actions)) for actions in place([order(s) for s in
                                                                  range(stages)])]


def _as_action(action: Action | Comm) -> Action:
    return action if isinstance(action, Action) else Action(action.kind, action.microbatch)


def groups(actions: Sequence[ActionLike]) -> list[list[ActionLike]]:
    """The communication groups of a stage's actions: the runs between compute actions (or
    a ``GROUP`` action, which only ends a group).

        RECV_F0 F0 SEND_F0 RECV_F1 F1 SEND_F1  ->  [[RECV_F0], [SEND_F0, RECV_F1], [SEND_F1]]
    """
    out: list[list[ActionLike]] = [[]]
    for action in actions:
        if action.kind in COMPUTE or action.kind == "GROUP":
            out.append([])
        else:
            out[-1].append(action)
    return [g for g in out if g]


def _fresh(cached: Callable[[int, int], tuple[tuple[Action, ...], ...]]
           ) -> Callable[[int, int], Schedule]:
    """A schedule function built once per (stages, microbatches), returned as fresh lists.

    `HybridPipe` asks for its schedule every step; building one is O(stages x microbatches)
    Python (about 0.1 ms at 4 x 16, 1 ms at 8 x 64) that would delay every stage's first
    action. Callers get their own lists, so mutating one never changes the next.
    """
    memo = functools.lru_cache(maxsize=64)(cached)

    @functools.wraps(cached)
    def schedule(stages: int, microbatches: int) -> Schedule:
        _check_sizes(stages, microbatches)
        return [list(actions) for actions in memo(stages, microbatches)]

    schedule.cache_info = memo.cache_info  # type: ignore[attr-defined]
    return schedule


@_fresh
def gpipe(stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Fill-drain: every forward, then every backward in reverse.

    stages=3, microbatches=2 (F = forward, B = backward, number = micro-batch):

        stage 0 | F0 F1 .  .  .  .  B1 B0
        stage 1 | .  F0 F1 .  .  B1 B0 .
        stage 2 | .  .  F0 F1 B1 B0 .  .

    Every stage keeps all m micro-batches alive until the backward starts.
    """
    forwards = [Action(FORWARD, i) for i in range(microbatches)]
    backwards = [Action(BACKWARD, i) for i in reversed(range(microbatches))]
    return tuple(map(tuple, _build(stages, lambda s: forwards + backwards)))


@_fresh
def one_f_one_b(stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """1F1B: warm up with a few forwards, then alternate one forward, one backward.

    Stage s runs min(stages - s - 1, m) warm-up forwards, then F, B pairs, then the remaining
    backwards, so it keeps at most min(stages - s, m) micro-batches alive.
    stages=3, microbatches=4:

        stage 0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
        stage 1 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
        stage 2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .
    """
    def order(s: int) -> list[Action]:
        warmup = min(stages - s - 1, microbatches)
        actions = [Action(FORWARD, i) for i in range(warmup)]
        for i in range(microbatches - warmup):
            actions += [Action(FORWARD, warmup + i), Action(BACKWARD, i)]
        actions += [Action(BACKWARD, i) for i in range(microbatches - warmup, microbatches)]
        return actions

    return tuple(map(tuple, _build(stages, order)))


@_fresh
def zero_bubble_h1(stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """ZB-H1 (Qi et al., ICLR 2024): 1F1B with each backward split into I and W.

    Stage s runs 1F1B's forwards with I in place of B; the W of micro-batch j follows the I of
    micro-batch j + s, and the last s W's come at the end, where 1F1B's stage s idles in the
    drain. So stage s keeps s more micro-batches alive than 1F1B (what W needs: the linear
    layers' inputs and output gradients), p on every stage, 1F1B's peak.
    stages=3, microbatches=4 (unit F, I and W; `pipeline.zero_bubble.zb_h1` has the timed
    picture):

        stage 0 | F0 F1 F2 .  .  I0 W0 F3 I1 W1 I2 W2 I3 W3
        stage 1 | .  F0 F1 .  I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
        stage 2 | .  .  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3
    """
    m = microbatches

    def order(s: int) -> list[Action]:
        warmup = min(stages - s - 1, m)
        actions = [Action(FORWARD, i) for i in range(warmup)]
        for j in range(m):
            if warmup + j < m:
                actions.append(Action(FORWARD, warmup + j))
            actions.append(Action(INPUT, j))
            if j >= s:
                actions.append(Action(WEIGHT, j - s))
        actions += [Action(WEIGHT, j) for j in range(max(m - s, 0), m)]
        return actions

    return tuple(map(tuple, _build(stages, order)))


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zero_bubble_h1}


def get_schedule(name: str) -> Callable[[int, int], Schedule]:
    """The schedule function registered under `name` ("gpipe", "1f1b", "zb-h1")."""
    try:
        return SCHEDULES[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown schedule {name!r}; choose one of {', '.join(sorted(SCHEDULES))}"
        ) from None


def render(schedule: Schedule) -> list[str]:
    """The compute actions of each stage as one line: ``["F0 F1 B1 B0", ...]``."""
    return [" ".join(str(a) for a in actions if a.kind in COMPUTE) for actions in schedule]


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


def live_microbatches(schedule: Schedule, *,
                      checkpointed: Callable[[int], bool] | None = None) -> list[int]:
    """Per stage, the most micro-batches whose activations are held at any time.

    Without `checkpointed`: forwarded but not yet backwarded. With it, a micro-batch i for
    which ``checkpointed(i)`` holds nothing after its forward and all of its activations
    while its backward recomputes them (one at a time):

        one_f_one_b(2, 4), checkpointed = i < 3 ("except_last"), stage 0
        actions  F0 F1 B0 F2 B1 F3 B2 B3
        held      0  0  1  0  1  1  2  1    peak 2 (B2 recomputes while F3 is held)
    """
    peaks = []
    for actions in schedule:
        live = peak = 0
        for action in actions:
            dropped = checkpointed is not None and checkpointed(action.microbatch)
            if action.kind == FORWARD and not dropped:
                live += 1
            elif action.kind == BACKWARD:
                peak = max(peak, live + dropped)   # a recomputation holds one more
                live -= not dropped
            elif action.kind == INPUT:             # held until W (what W needs of it)
                live += dropped
            elif action.kind == WEIGHT:
                live -= 1
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


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
