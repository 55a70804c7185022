"""Schedules as data: which action each pipeline stage takes, in order (checks and a timed
run of them: `schedule_check`)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
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
    "end_times",
    "get_schedule",
    "gpipe",
    "groups",
    "live_microbatches",
    "one_f_one_b",
    "place",
    "render",
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
    stages=3, microbatches=4 (unit F, I and W; `pipeline.schedules.zero_bubble.zb_h1` has the timed
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
