"""Virtual stages: a rank that holds several stages of the model runs them as one program.

Interleaved 1F1B and ZBV (`plan.py`) cut the model into S = p * v stages and give each rank
v of them (`Plan.placement`). Each stage keeps its own `StageExecutor` (its partition, skips,
micro-batches and specs); `RankStages` runs the rank's step as one sequence of items, the
plan lowered with every message in its slot (`plan_lowering.lower_plan`):

    item              what the rank does
    a compute         that stage's F / I / B / W; then what a stage of this rank needs from
                      it is handed over, without a message (`step.Handed`): the outputs and
                      skips after F, the input and skip gradients after I or B
    a message         queued on the rank's one wire by its stage (`messages.py`)
    before a compute  the messages queued by every stage, issued as one group

On a step of new shapes the forward messages carry headers, and a slot is two groups on both
ends: the headers and the gradients, then the activations once the headers are read
(`Wire.issue(hold_payloads=True)`). NCCL needs that once activations go round a cycle of
ranks, as they do for v >= 2 (`plan_lowering.lower_plan_rank`). The rank's listener,
watchdog, recorder and wire are those of its first stage's executor; a failure sends aborts
for what every stage of the rank still owes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from hybridpar import trace
from hybridpar.pipeline.runtime.executor import StageExecutor
from hybridpar.pipeline.runtime.step import Handed, Once, StepResult, TensorOrTensors, as_tuple
from hybridpar.pipeline.schedules.layout import Item
from hybridpar.pipeline.schedules.schedule import (
    BACKWARD,
    COMPUTE,
    FORWARD,
    GROUP,
    INPUT,
    RECV_B,
    RECV_F,
    WEIGHT,
    Action,
    Comm,
)

__all__ = ["RankStages"]



class RankStages:
    """The executors of this rank's virtual stages, run together one step at a time."""

    def __init__(self, executors: Sequence[StageExecutor]) -> None:
        self.executors = {ex.spec.stage: ex for ex in executors}
        self.lead = lead = executors[0]
        self.wire, self.recorder = lead.wire, lead.recorder
        for ex in executors[1:]:
            ex.recorder = lead.recorder
            ex.pipeline_key = lead.pipeline_key   # one key in the store for the rank's failures
        self.rank = dist.get_rank()
        self._seen: dict[int, int] = {}          # a step's items done, per stage
        self._prefetched: set[int] = set()       # a step's receives posted ahead (gloo)

    def run(self, items: Sequence[Item], *, inputs: Sequence[TensorOrTensors] | None,
            targets: Sequence[Any] | None, loss_fn: Callable[..., Tensor] | None,
            weights: Sequence[float], train: bool, what: str, signature: Hashable,
            before_last_backward: Callable[[], None] | None = None,
            when_idle: Callable[[], None] | None = None) -> StepResult:
        """Run the rank's `items` (`StageExecutor.run`'s arguments); the result of the stage
        that holds the loss (or the outputs), else an empty one."""
        split = train and any(a.kind == WEIGHT for _, a in items)
        idle = None if when_idle is None else Once(when_idle)   # whichever stage waits first
        keys = {s: ex.begin([a for t, a in items if t == s], inputs=inputs if ex.first else None,
                            targets=targets if ex.last else None, loss_fn=loss_fn,
                            weights=weights, train=train, what=what, signature=signature,
                            split=split, when_idle=idle)
                for s, ex in self.executors.items()}
        watchdog, listener = self.lead.watchdog, self.lead.listener
        if watchdog is not None:
            watchdog.enter()
        listener.enter(self.lead.steps)
        done = False
        try:
            with trace.span("step"):
                self._run_items(items, before_last_backward)
                self._finish_sends()
            done = True
        finally:
            if watchdog is not None:
                watchdog.leave()
            listener.leave()
            results = {s: ex.end(keys[s], done=done) for s, ex in self.executors.items()}
        last = [r for s, r in results.items() if self.executors[s].last]
        return last[0] if last else StepResult(None, [])

    def _run_items(self, items: Sequence[Item],
                   before_last_backward: Callable[[], None] | None) -> None:
        last_backward = max((k for k, (_, a) in enumerate(items)
                             if a.kind in (BACKWARD, WEIGHT)), default=-1)
        handlers = {s: ex.handlers for s, ex in self.executors.items()}
        self._seen, self._prefetched = dict.fromkeys(self.executors, 0), set()
        early = self.lead.spec.device.type == "cpu" and all(
            ex.step.agreed is not None for ex in self.executors.values())
        recorder, listener = self.recorder, self.lead.listener
        for index, (s, action) in enumerate(items):
            ex = self.executors[s]
            self.lead.acting = ex   # the watchdog reports where the rank is
            at = self._seen[s]
            ex.step.at, ex.step.waiting = at, ""
            recorder.stage, recorder.microbatch = s, action.microbatch
            try:
                if listener.stopped is not None:   # a peer failed: stop before acting
                    raise ex.peer_stopped()
                if action.kind in COMPUTE or action.kind == GROUP:
                    self._issue()
                    if early:
                        self._prefetch(items, index)
                if index == last_backward and before_last_backward is not None:
                    before_last_backward()
                if index not in self._prefetched:
                    handlers[s][action.kind](action)
                if action.kind in COMPUTE:
                    self._hand_over(ex, action)
            except Exception as e:
                ex.raise_at(e, at, self.owed())
            ex.step.last_done = action
            self._seen[s] = at + 1
            if self.lead.watchdog is not None:   # the rank's one watchdog: any stage's progress
                self.lead.watchdog.beat()
        recorder.microbatch = -1

    def _issue(self) -> None:
        """Issue every stage's queued messages as one group (two on new shapes: the
        activations after their headers were read)."""
        incoming = []
        for s, ex in self.executors.items():
            incoming += [(ex, m) for m in ex.step.incoming]
            ex.step.incoming, ex.step.issued_upto = [], self._seen.get(s, 0)
        works = self.lead.issue_group(hold_payloads=True)
        for _, message in incoming:
            message.issued(works)
        learning = [(ex, m) for ex, m in incoming if m.spec is None]
        if not learning and not self.wire.pending:
            return
        acting = self.lead.acting
        with trace.span("wait"):
            for ex, message in learning:
                self.lead.acting = ex   # a wait for a header: the stage it is for
                ex.learn_spec(message)
        self.lead.acting = acting
        works = self.lead.issue_group()
        for _, message in learning:
            message.issued(works)

    def _prefetch(self, items: Sequence[Item], index: int) -> None:
        """gloo: post the receives the next compute needs now (`messages._prefetch`: gloo
        moves a payload only once its receive is posted; it has no rendezvous and keeps the
        receives' order)."""
        k = index + 1
        while k < len(items) and items[k][1].kind not in COMPUTE:
            s, action = items[k]
            if action.kind in (RECV_F, RECV_B) and k not in self._prefetched:
                self.executors[s].handlers[action.kind](action)
                self._prefetched.add(k)
            k += 1
        incoming = [m for ex in self.executors.values() for m in ex.step.incoming]
        if incoming:
            for ex in self.executors.values():
                ex.step.incoming = []
            works = self.lead.issue_group(early=True)
            for message in incoming:
                message.issued(works)

    def _finish_sends(self) -> None:
        """Issue what is still queued, then wait for every send of the step."""
        lead = self.lead
        at = len(lead.step.actions)
        lead.step.at = at
        try:
            self._seen = {s: len(ex.step.actions) for s, ex in self.executors.items()}
            self._issue()
            lead.wait_sends()
        except Exception as e:
            lead.raise_at(e, at, self.owed())

    def owed(self) -> list[tuple[int, int, Tensor]]:
        """The aborts owed to the peers: each stage's, the first per (rank, channel)."""
        owed: dict[tuple[int, int], Tensor] = {}
        for ex in self.executors.values():
            for rank, channel, dummy in ex.owed():
                owed.setdefault((rank, channel), dummy)
        return [(rank, channel, dummy) for (rank, channel), dummy in owed.items()]

    def _hand_over(self, ex: StageExecutor, action: Action | Comm) -> None:
        """Give this rank's other stages what `action` on `ex` made for them."""
        i, s = action.microbatch, ex.spec.stage
        mb = ex.step.mbs[i]
        mine = self.executors
        if action.kind == FORWARD:
            train = ex.step.train
            if s + 1 in mine and mb.outputs is not None:
                mine[s + 1].step.mbs[i].recv_f = Handed(
                    as_tuple(mb.outputs), self.rank, grads=train,
                    single=isinstance(mb.outputs, Tensor))
            for d, routes in ex.skip_out.items():
                if d in mine:
                    mine[d].step.mbs[i].recv_skip[s] = Handed(
                        [mb.skips_out[r.key] for r in routes], self.rank, grads=train)
        elif action.kind in (BACKWARD, INPUT):
            if s - 1 in mine:
                mine[s - 1].step.mbs[i].recv_b = Handed(mb.input_grads, self.rank, grads=False)
                mb.input_grads = ()
            for a in ex.skip_in:
                if a in mine:
                    mine[a].step.mbs[i].recv_skip_grad[s] = Handed(
                        mb.skip_grads.pop(a), self.rank, grads=False)
