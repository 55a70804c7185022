"""Lowering of plans: each rank's tasks with the messages between virtual stages, in slots.

`lowering.lower` does this for `Action` schedules (one stage per rank, skips included); this
is its form for plans, where a rank holds several virtual stages and a message's peer is the
rank of the neighbouring stage (`Plan.placement`):

    task      on rank of stage s          message (when the neighbour is on another rank)
    F(i, s)   RECV_F(i, s) before it      output of stage s - 1, from the rank of s - 1
              SEND_F(i, s) after it       output of stage s, to the rank of s + 1
    I/B(i, s) RECV_B(i, s) before it      gradient of stage s's output, from the rank of s + 1
              SEND_B(i, s) after it       gradient of stage s's input, to the rank of s - 1
    W(i, s)   -

Skips (`routes`: (stash stage a, pop stage b) pairs) add a message a -> b after F(i, a)
and its gradient b -> a after the backward of (i, b), like the neighbours' messages.

A neighbour on the same rank (ZBV's stages p - 1 and p) gets its tensor without a message.
Every message sits in the slot its producer ends in, in a unit-time run of the plan
(`simulate.unit_ends`); both ends use that slot and each rank issues its slots in order,
one group per slot, so NCCL's rendezvous never waits in a cycle (`schedule.place`). Within a
slot, the messages between two ranks go in the order of their (producer, consumer) stages,
which both ends know (a rank's sends first: they leave the task that ends the slot).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

from hybridpar.pipeline.schedules.plan import FORWARD, WEIGHT, Plan, Task
from hybridpar.pipeline.schedules.replay import P2POp, ReplayResult, replay
from hybridpar.pipeline.schedules.schedule import GROUP, RECV_B, RECV_F, SEND_B, SEND_F
from hybridpar.pipeline.schedules.simulate import unit_ends

__all__ = ["Hop", "check_plan", "hop_groups", "lower_plan", "lower_plan_rank"]


class Hop(NamedTuple):
    """A message of a task: `kind` (SEND_F, RECV_F, SEND_B, RECV_B) of `microbatch`, for the
    local virtual `stage` that sends it or consumes it, with virtual stage `peer_stage` on
    rank `peer` (GROUP: ends a group of communication, -1 elsewhere)."""

    kind: str
    microbatch: int
    stage: int
    peer: int
    peer_stage: int = -1

    def __str__(self) -> str:
        return self.kind if self.kind == GROUP else f"{self.stage}{self.kind}{self.microbatch}"


_END = Hop(GROUP, -1, -1, -1)


def lower_plan(plan: Plan, *, routes: Sequence[tuple[int, int]] = ()
               ) -> list[list[Task | Hop]]:
    """Each rank's tasks with its messages, one group per slot (a GROUP between two slots
    with no task between), as the executor will issue them; `routes`: the skips, as
    (stash stage, pop stage) pairs.

        zbv(2, 1), rank 1: stages 1 and 2 (2's neighbour 3 is on rank 0, 1's neighbour 0 too)
        1RECV_F0 | 1F0 | 2F0 | 2SEND_F0 GROUP 2RECV_B0 | 2I0 | 2W0 | 1I0 | 1SEND_B0 | 1W0
    """
    ends = unit_ends(plan)
    end = {(task.kind == FORWARD, task.microbatch, task.stage): t
           for (_, task), t in ends.items() if task.kind != WEIGHT}   # (is F, i, s) -> slot
    where, last = plan.placement, plan.stages - 1
    consumers = [_peers(s, +1, routes, last) for s in range(plan.stages)]
    producers = [_peers(s, -1, routes, last) for s in range(plan.stages)]
    lowered = []
    for r, tasks in enumerate(plan.tasks):
        # (slot, 0 hop | 1 task, peer rank | position, (0 send | 1 receive, producer,
        # consumer), item): a slot's sends come from the task that ends it, its receives
        # feed later tasks
        events: list[tuple[int, int, int, tuple[int, int, int], Task | Hop]] = []
        for position, task in enumerate(tasks):
            events.append((ends[r, task] - 1, 1, position, (0, 0, 0), task))
            kind, i, s = task
            if kind == WEIGHT:
                continue
            forward = kind == FORWARD
            # forward: outputs to the consumers, inputs from the producers; backward: the
            # gradients of the inputs to the producers, of the outputs from the consumers
            to, of = (consumers[s], producers[s]) if forward else (producers[s], consumers[s])
            send, recv = (SEND_F, RECV_F) if forward else (SEND_B, RECV_B)
            for d in to:
                if where[d] != r:
                    events.append((end[forward, i, s], 0, where[d], (0, s, d),
                                   Hop(send, i, s, where[d], d)))
            for a in of:
                if where[a] != r:
                    events.append((end[forward, i, a], 0, where[a], (1, a, s),
                                   Hop(recv, i, s, where[a], a)))
        events.sort(key=lambda e: e[:4])
        items: list[Task | Hop] = []
        for k, (slot, is_task, _, _, item) in enumerate(events):
            if k and not is_task and not events[k - 1][1] and events[k - 1][0] != slot:
                items.append(_END)   # two slots with no task between
            items.append(item)
        lowered.append(items)
    return lowered


def _peers(stage: int, direction: int, routes: Sequence[tuple[int, int]], last: int
           ) -> list[int]:
    """The stages that consume `stage`'s outputs (direction +1: the next, then the pops of
    its stashes) or produce its inputs (-1: the previous, then the stashes it pops)."""
    neighbour = stage + direction
    skips = [b if direction > 0 else a for a, b in routes
             if (a if direction > 0 else b) == stage and a != b]
    return list(dict.fromkeys(([neighbour] if 0 <= neighbour <= last else []) + skips))


def hop_groups(items: Sequence[Task | Hop]) -> list[list[Hop]]:
    """The communication groups of a rank's items: the runs of hops between tasks (or a
    GROUP, which only ends a group)."""
    out: list[list[Hop]] = [[]]
    for item in items:
        if isinstance(item, Task) or item.kind == GROUP:
            out.append([])
        else:
            out[-1].append(item)
    return [g for g in out if g]


def _label(hop: Hop) -> str:
    """The same text on both ends: the stages the message goes between."""
    i, s = hop.microbatch, hop.stage
    sends = hop.kind in (SEND_F, SEND_B)
    peer = hop.peer_stage if hop.peer_stage >= 0 else \
        s + (1 if hop.kind in (SEND_F, RECV_B) else -1)
    a, b = (s, peer) if sends else (peer, s)
    what = "activation" if hop.kind in (SEND_F, RECV_F) else "gradient"
    return f"the {what} of micro-batch {i}, stage {a} -> {b}"


def lower_plan_rank(items: Sequence[Task | Hop], *, rank_of: Callable[[int], int],
                    new_shapes: bool = False, headers_apart: bool = True
                    ) -> list[list[P2POp]]:
    """The groups of P2P operations a rank issues for `items` (one tensor per message).

    With `new_shapes` each activation is preceded by a header. Both ends then issue a slot
    as two groups: the headers (and the gradients, which have none), then the activations.
    `lowering.lower_stage` lets the sender put header and activation in one group
    (`headers_apart=False`). That deadlocks once the activations of one slot go round a
    cycle of ranks, which v = 1 never does and v >= 2 does (looped: rank p - 1 sends stage
    p - 1 to rank 0; ZBV: ranks r and r + 1 send each other activations). Two ranks:

        rank 0  [send header 0>1, send act 0>1, recv header 1>2]  [recv act 1>2]
        rank 1  [recv header 0>1, send header 1>2, send act 1>2]  [recv act 0>1]
        each first group waits for the other rank's second group
    """
    out: list[list[P2POp]] = []
    for group in hop_groups(items):
        first: list[P2POp] = []
        second: list[P2POp] = []
        for hop in group:
            sends = hop.kind in (SEND_F, SEND_B)
            op = P2POp("send" if sends else "recv", rank_of(hop.peer), 1, "float",
                       _label(hop))
            payload = op._replace(label=f"{op.label} [0]")
            if new_shapes and hop.kind in (SEND_F, RECV_F):
                first.append(op._replace(numel=128, dtype="int64", label=f"{op.label} header"))
                (second if headers_apart or not sends else first).append(payload)
            else:
                first.append(payload)
        if not headers_apart:   # lower_stage's order: the group's headers first
            first.sort(key=lambda op: not op.label.endswith("header"))
        out.append(first)
        if second:
            out.append(second)
    return out


def check_plan(plan: Plan, *, routes: Sequence[tuple[int, int]] = (), tp: int = 1,
               dp: int = 1, new_shapes: bool = False, headers_apart: bool = True
               ) -> ReplayResult:
    """Lower every rank of a (dp, pp, tp) grid and replay it under NCCL's rules
    (`lowering.check_schedule` for plans); raises `replay.NCCLOrderError`."""
    p = plan.ranks

    def rank(d: int, r: int, *, t: int) -> int:
        return (d * p + r) * tp + t

    program = lower_plan(plan, routes=routes)
    lowered = {}
    for d in range(dp):
        for t in range(tp):
            for r, items in enumerate(program):
                lowered[rank(d, r, t=t)] = lower_plan_rank(
                    items, rank_of=functools.partial(rank, d, t=t), new_shapes=new_shapes,
                    headers_apart=headers_apart)
    return replay(lowered, check_labels=True)
