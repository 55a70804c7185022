"""Lowering: a stage's actions as the groups of P2P operations the executor issues, in order.

The executor (`executor.py`) and the NCCL check (`check_schedule`) read the same rules, so
what is proven here is what runs. Channels name what a message carries; messages between two
ranks match by order alone (`comm`):

    channel     carries                                   direction
    FWD  0      stage output of micro-batch i             s -> s + 1
    BWD  1      gradient of that output                   s + 1 -> s
    SKIP 2      skip tensors stashed on a, popped on b    a -> b
    SKIPG 3     their gradients                           b -> a

The messages of one communication action, in order (skip peers in route order):

    SEND_F i   FWD to s + 1, then SKIP to each stage that pops what s stashes
    RECV_F i   FWD from s - 1, then SKIP from each stage that stashed what s pops
    SEND_B i   BWD to s - 1, then SKIPG to each stage that stashed what s pops
    RECV_B i   BWD from s + 1, then SKIPG from each stage that pops what s stashes

`lower` places every message, skips included, in its slot (`schedule.place`: the time its
producer ends in a unit-time run; both ends use the same slot and issue slots in order, so
NCCL's rendezvous never waits in a cycle). Placing a skip's receive just before its consumer
instead (as Megatron does for neighbours) deadlocks under NCCL with a skip from stage 0 to
stage 3 under 1F1B: `check_schedule` finds it (see the tests).

In a step of new shapes each forward-direction message (FWD, SKIP) is preceded by a header:
the sender puts the headers of a group first; the receiver posts the headers, waits, then
posts the payloads as a group of their own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

from hybridpar.pipeline.schedules.replay import P2POp, ReplayResult, replay
from hybridpar.pipeline.schedules.schedule import (
    COMPUTE,
    GROUP,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    Comm,
    Schedule,
    groups,
    place,
)

__all__ = ["BWD", "FWD", "GROUP", "LABELS", "SKIP", "SKIPG", "Comm", "Message",
           "check_schedule",
           "lower", "lower_stage", "messages", "skip_peers"]

FWD, BWD, SKIP, SKIPG = 0, 1, 2, 3
LABELS = {FWD: "the activation of micro-batch {}", BWD: "the gradient of micro-batch {}",
          SKIP: "the skips of micro-batch {}", SKIPG: "the skip gradients of micro-batch {}"}


class Message(NamedTuple):
    """One message of an action: sent or received, the peer stage, the channel."""

    send: bool
    peer: int
    channel: int


def skip_peers(routes: Sequence[tuple[int, int]], stage: int) -> tuple[list[int], list[int]]:
    """(stages that stash what `stage` pops, stages that pop what it stashes), route order."""
    sources = [src for src, dst in routes if dst == stage and src != stage]
    targets = [dst for src, dst in routes if src == stage and dst != stage]
    return list(dict.fromkeys(sources)), list(dict.fromkeys(targets))


def messages(action: Action | Comm, stage: int, skip_in: Sequence[int],
             skip_out: Sequence[int]) -> list[Message]:
    """The messages of one communication action, in the order the executor queues them
    (a `Comm`: only those with its peer)."""
    kind = action.kind
    if kind == SEND_F:
        out = [Message(True, stage + 1, FWD)] + [Message(True, d, SKIP) for d in skip_out]
    elif kind == RECV_F:
        out = [Message(False, stage - 1, FWD)] + [Message(False, s, SKIP) for s in skip_in]
    elif kind == SEND_B:
        out = [Message(True, stage - 1, BWD)] + [Message(True, s, SKIPG) for s in skip_in]
    elif kind == RECV_B:
        out = [Message(False, stage + 1, BWD)] + [Message(False, d, SKIPG) for d in skip_out]
    else:
        return []
    if isinstance(action, Comm):
        return [m for m in out if m.peer == action.peer]
    return out


def lower(schedule: Schedule, *, routes: Sequence[tuple[int, int]] = ()
          ) -> list[list[Action | Comm]]:
    """Each stage's actions with every message, skips included, in its slot
    (`schedule.place`): what the executor runs."""
    stages = len(schedule)
    orders = [[a for a in actions if a.kind in COMPUTE] for actions in schedule]
    ins_outs = [skip_peers(routes, s) for s in range(stages)]

    def peers(stage: int, kind: str, microbatch: int) -> list[int]:
        skip_in, skip_out = ins_outs[stage]
        return list(dict.fromkeys(
            m.peer for m in messages(Action(kind, microbatch), stage, skip_in, skip_out)
            if 0 <= m.peer < stages))

    return place(orders, peers=peers)


def lower_stage(actions: Sequence[Action | Comm], stage: int, *,
                routes: Sequence[tuple[int, int]] = (), rank_of: Callable[[int], int],
                new_shapes: bool = False) -> list[list[P2POp]]:
    """The groups of P2P operations a stage issues for `actions` (one tensor per message;
    labels as the executor writes them)."""
    skip_in, skip_out = skip_peers(routes, stage)
    out: list[list[P2POp]] = []
    for group in groups(actions):
        headers: list[P2POp] = []
        payloads: list[P2POp] = []
        later: list[P2POp] = []   # payload receives posted after their headers arrived
        for action in group:
            for m in messages(action, stage, skip_in, skip_out):
                label = LABELS[m.channel].format(action.microbatch)
                op = P2POp("send" if m.send else "recv", rank_of(m.peer), 1, "float", label)
                if new_shapes and m.channel in (FWD, SKIP):
                    headers.append(op._replace(numel=128, dtype="int64",
                                               label=f"{label} header"))
                    (payloads if m.send else later).append(op._replace(label=f"{label} [0]"))
                else:
                    payloads.append(op._replace(label=f"{label} [0]"))
        out.append(headers + payloads)
        if later:
            out.append(later)
    return out


def check_schedule(schedule: Schedule, *, routes: Sequence[tuple[int, int]] = (),
                   tp: int = 1, dp: int = 1, new_shapes: bool = False) -> ReplayResult:
    """Lower every rank of a (dp, pp, tp) grid (`lower`) and replay it under NCCL's rules.

    Raises `replay.NCCLOrderError` naming the ranks and messages of a mismatch or deadlock.
    """
    stages = len(schedule)

    def rank(d: int, s: int, *, t: int) -> int:
        return (d * stages + s) * tp + t

    program = lower(schedule, routes=routes)
    lowered = {}
    for d in range(dp):
        for t in range(tp):
            for s, actions in enumerate(program):
                lowered[rank(d, s, t=t)] = lower_stage(
                    actions, s, routes=routes, rank_of=functools.partial(rank, d, t=t),
                    new_shapes=new_shapes)
    return replay(lowered, check_labels=True)
