"""Run one stage's action list: receive, compute the partition, send; backward in reverse.

The schedule says what to do (`schedule.py`); this module only does it: the step loop and
the computes (forward, backward or its I, W). The messages of the SEND / RECV actions, and
when their groups are issued: `messages.py`.

Timeline events (`hybridpar.trace`, while it records) per action; each is tagged with the
stage and the action's micro-batch, so the collectives and transfers inside inherit them:

    action    events
    a group   send (one span per message sent); a header wait on a new signature
    F i       recv FWD (+ SKIP), then forward (loss included on the last stage)
    B i       recompute (checkpointed i), recv BWD (+ SKIPG), then backward
    the end   wait (for the posted sends), all inside one step span

Failures (`stops.py`, `failure.py`): the failing rank re-raises its own error with the step's
block as a note (stage, action, micro-batch, the last completed action), its peers a
`PipelineError` block (the peer and operation waited for), after aborts (`comm`: an entry in
the store, then a dummy of the expected size) to the peers still owed a message this step,
so they stop at once; on gloo the others' listeners (`listener.py`) stop them before their
next action or break their waits. The step's data: `step.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchgpipe.skip.skippable import Skippable
from torchgpipe.skip.tracker import use_skip_tracker

from hybridpar import trace
from hybridpar.comm import p2p as comm
from hybridpar.pipeline.activations.checkpoint import is_checkpointed, layer_stride
from hybridpar.pipeline.activations.layer_checkpoint import contexts, run_layers
from hybridpar.pipeline.activations.split_backward import SplitLinear, WeightGrads, deferring
from hybridpar.pipeline.failures.failure import PipelineError
from hybridpar.pipeline.failures.watchdog import Watchdog
from hybridpar.pipeline.runtime.messages import StageMessages
from hybridpar.pipeline.runtime.skip import SkipRoute, StageSkipTracker
from hybridpar.pipeline.runtime.step import (
    MicroBatch,
    StageSpec,
    StepResult,
    StepState,
    TensorOrTensors,
    as_tuple,
    current_microbatch,
    floating,
    grad_or_zeros,
    microbatch_context,
    scalar_loss,
)
from hybridpar.pipeline.schedules.schedule import (
    BACKWARD,
    COMPUTE,
    FORWARD,
    GROUP,
    INPUT,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    WEIGHT,
    Action,
    Comm,
)
from hybridpar.recompute import selective

__all__ = ["PipelineError", "StageExecutor", "StageSpec", "current_microbatch"]


class StageExecutor(StageMessages):
    """Interprets a stage's action list for one step (training or inference)."""

    def __init__(self, spec: StageSpec, *, wire: comm.Wire | None = None) -> None:
        self.spec = spec   # `wire`: the rank's, shared by its virtual stages (`virtual.py`)
        self.wire = wire if wire is not None else \
            comm.Wire(tags=spec.p2p_tags, coalesce=spec.device.type != "cpu")
        self.recorder = trace.Recorder()   # the timeline of this stage's steps, when traced
        self.book = comm.SpecBook()   # the agreed message specs of each step signature
        self.steps = 0                # steps run: keys this rank's aborts in the store
        self.step = StepState()       # the step being run (an idle one between steps)
        self.watchdog = None if spec.watchdog is None else Watchdog(
            spec.watchdog, describe=self._hang_report, pending=self._pending,
            peer_failed=self._peer_abort, publish=comm.publish_hang)
        self.listener = self._listener()   # gloo: stops this stage when a peer failed
        s = spec.stage
        self.first, self.last = s == 0, s == spec.num_stages - 1
        self.skippable = any(isinstance(m, Skippable) for m in spec.partition.modules())
        self.tp = 1 if spec.tp_group is None else dist.get_world_size(spec.tp_group)
        # a peer rank's stage in reports: the one nearest this stage (virtual stages: a rank
        # may hold several)
        self._stages = {spec.rank_of_stage(t): t for t in
                        sorted(range(spec.num_stages), key=lambda t: -abs(t - s))}
        self.skip_in: dict[int, list[SkipRoute]] = {}
        self.skip_out: dict[int, list[SkipRoute]] = {}
        for r in spec.routes:
            if r.dst == s and r.src != s:
                self.skip_in.setdefault(r.src, []).append(r)
            if r.src == s and r.dst != s:
                self.skip_out.setdefault(r.dst, []).append(r)

    @property
    def handlers(self) -> dict[str, Callable[[Any], None]]:
        """What each kind of action does."""
        return {RECV_F: self._communicate, FORWARD: self._forward, SEND_F: self._communicate,
                RECV_B: self._communicate, BACKWARD: self._backward, INPUT: self._backward,
                WEIGHT: self._weight, SEND_B: self._communicate, GROUP: lambda _: None}

    # one step ----------------------------------------------------------------------------
    def run(self, actions: Sequence[Action | Comm], *, inputs: Sequence[TensorOrTensors] | None,
            targets: Sequence[Any] | None, loss_fn: Callable[..., Tensor] | None,
            weights: Sequence[float], train: bool, what: str = "step",
            signature: Hashable = None,
            before_last_backward: Callable[[], None] | None = None,
            when_idle: Callable[[], None] | None = None) -> StepResult:
        """Run `actions`; `inputs` on the first stage, `targets` and `loss_fn` on the last.

        `what` names the step in error messages ("train_step", "eval_step", "forward").
        `signature` identifies the shapes of the step (the same on every rank): a step of a
        signature seen before sends no headers. `before_last_backward` is called just before
        this stage's last backward (the dp buckets arm there). `when_idle` is called once,
        just before the step's first wait for another rank (a receive, or at the end its
        sends): work that can wait until the stage has nothing to do (the loss's receive).
        """
        key = self.begin(actions, inputs=inputs, targets=targets, loss_fn=loss_fn,
                         weights=weights, train=train, what=what, signature=signature,
                         when_idle=when_idle)
        if self.watchdog is not None:
            self.watchdog.enter()
        self.listener.enter(self.steps)
        done = False
        try:
            with trace.span("step"):
                self._run_actions(before_last_backward)
                self._finish_sends()
            done = True
        finally:
            if self.watchdog is not None:
                self.watchdog.leave()
            self.listener.leave()
            result = self.end(key, done=done)
        return result

    def begin(self, actions: Sequence[Action | Comm], *,
              inputs: Sequence[TensorOrTensors] | None, targets: Sequence[Any] | None,
              loss_fn: Callable[..., Tensor] | None, weights: Sequence[float], train: bool,
              what: str, signature: Hashable, split: bool | None = None,
              when_idle: Callable[[], None] | None = None) -> Hashable:
        """Make the step's state (`run`'s arguments; `split`: the step's backward is split,
        by default when `actions` have a W); returns the key of its specs."""
        key = (train, signature)
        self.step = StepState(
            train=train, inputs=inputs, targets=targets, loss_fn=loss_fn, weights=weights,
            m=len(weights), signature=comm.signature_hash(key),
            agreed=self.book.get(key),            # None: this step learns the specs
            mbs=[MicroBatch(key=torch.empty(0)) for _ in range(len(weights))],
            what=what, actions=list(actions),
            split=train and (any(a.kind == WEIGHT for a in actions) if split is None
                             else split),
            when_idle=when_idle)
        self.recorder.stage, self.recorder.microbatch = self.spec.stage, -1
        return key

    def end(self, key: Hashable, *, done: bool) -> StepResult:
        """After the step, `done` or failed: clear it; keep the specs a done step learned."""
        self.steps += 1
        self.wire.pending.clear()
        self.wire.early.clear()
        self.step.issued = []
        if done and self.step.agreed is None:
            self.book.commit(key, self.step.learned)
        self.step.mbs, self.step.sends = [], []
        return StepResult(self.step.loss_sum, self.step.outputs)

    def _run_actions(self, before_last_backward: Callable[[], None] | None) -> None:
        """Do the step's actions in order; a compute (or GROUP) first issues the group queued
        before it. `before_last_backward` runs before the last action that accumulates
        gradients (the last B, or the last W of a split backward)."""
        actions = self.step.actions
        last_backward = max((k for k, a in enumerate(actions) if a.kind in (BACKWARD, WEIGHT)),
                            default=-1)
        handlers = self.handlers
        recorder = self.recorder
        for index, action in enumerate(actions):
            self.step.at, self.step.waiting = index, ""
            recorder.microbatch = action.microbatch  # tags the events of this action
            try:
                if self.listener.stopped is not None:   # a peer failed: stop before acting
                    raise self.peer_stopped()
                if action.kind in COMPUTE or action.kind == GROUP:
                    self._issue(index)
                if index == last_backward and before_last_backward is not None:
                    before_last_backward()
                if index not in self.step.prefetched:
                    handlers[action.kind](action)
            except Exception as e:
                self.raise_at(e, index)
            self.step.last_done = action
            if self.watchdog is not None:
                self.watchdog.beat()
        recorder.microbatch = -1

    def _finish_sends(self) -> None:
        """Issue what is still queued, then wait for every send of the step."""
        self.step.at = len(self.step.actions)
        try:
            self._issue(len(self.step.actions))
            self.wait_sends()
        except Exception as e:
            self.raise_at(e, len(self.step.actions))

    # forward -----------------------------------------------------------------------------
    def _forward(self, action: Action) -> None:
        i = action.microbatch
        mb = self.step.mbs[i]
        if self.first:
            assert self.step.inputs is not None
            mb.inputs = self.step.inputs[i]
        else:
            posted, mb.recv_f = mb.recv_f, None
            received = self._recv(posted, f"the activation of micro-batch {i}",
                                  self.spec.stage - 1)
            single = posted is not None and posted.single
            activations = tuple(t for t in received if t is not None)   # never absent
            mb.inputs = activations[0] if single else activations
        for src, routes in self.skip_in.items():
            tensors = self._recv(mb.recv_skip.pop(src), f"the skips of micro-batch {i}", src)
            mb.skips_in.update((r.key, t) for r, t in zip(routes, tensors))
        checkpointed = self.step.train and is_checkpointed(self.spec.checkpoint, i, self.step.m)
        with trace.span("forward"):
            if checkpointed:
                with self.spec.replay.first_forward() as state:
                    mb.rng = state
                    self._compute(mb, i)
            elif self.step.train:
                self._compute(mb, i)
            else:
                with torch.no_grad():
                    self._compute(mb, i)
        step = self.step
        if self.last and mb.loss is not None:   # training or evaluation: the loss, once
            value = mb.loss.detach().float()     # reported in fp32 (bf16 runs too)
            step.loss_sum = value if step.loss_sum is None else step.loss_sum + value
            if checkpointed or not step.train:   # recomputed in backward / not needed
                mb.loss = None
            if not step.train:
                mb.outputs = None
        elif self.last:                          # inference: the outputs are the result
            assert mb.outputs is not None
            step.outputs.append(mb.outputs)

    def _compute(self, mb: MicroBatch, i: int) -> None:
        """The partition's forward on micro-batch `i` (and the weighted loss on the last stage,
        when the step has a loss)."""
        assert mb.inputs is not None
        # a stage without @skippable layers needs no tracker: the compute starts sooner
        tracker = StageSkipTracker(self.spec.routes, self.spec.stage, mb.skips_in) \
            if self.skippable else None
        every = layer_stride(self.spec.checkpoint) if self.step.train else None
        split_mode = SplitLinear if self.step.split else None
        cores = selective(functools.partial(contexts, self.spec.replay, split_mode)) \
            if self.step.train and self.spec.checkpoint == "selective" else nullcontext()
        with microbatch_context(mb.key), cores, \
                use_skip_tracker(tracker) if tracker is not None else nullcontext(), \
                SplitLinear() if self.step.split else nullcontext():
            # SplitLinear: linear layers' weight gradients can wait for W
            if every is None:
                out = self.spec.partition(mb.inputs)
            else:                    # checkpoint = "layers" / "layers:K"
                out = run_layers(self.spec.partition, mb.inputs, every=every,
                                 replay=self.spec.replay, split_mode=split_mode)
        if not self.last and not isinstance(out, (Tensor, tuple)):
            raise TypeError(f"stage {self.spec.stage} returned {type(out).__name__}; a stage "
                            "must return a Tensor or a tuple of Tensors")
        mb.outputs, mb.skips_out = out, {} if tracker is None else tracker.outgoing
        step = self.step
        if self.last and step.loss_fn is not None and step.targets is not None:
            # the one place a loss is computed: weighted by the micro-batch's share of rows
            mb.loss = scalar_loss(step.loss_fn(out, step.targets[i])) * step.weights[i]

    # backward ----------------------------------------------------------------------------
    def _backward(self, action: Action) -> None:
        """B of micro-batch i, or its I (the linear layers' weight gradients wait for W)."""
        i = action.microbatch
        mb = self.step.mbs[i]
        if mb.rng is not None:  # checkpointed: recompute the forward with the replayed RNG
            with trace.span("recompute"), self.spec.replay.recompute(mb.rng):
                self._compute(mb, i)
        tensors: list[Tensor] = []
        grads: list[Tensor | None] = []
        if self.last:
            assert mb.loss is not None
            tensors, grads = [mb.loss], [None]
        else:
            assert mb.outputs is not None
            received = self._recv(mb.recv_b, f"the gradient of micro-batch {i}",
                                  self.spec.stage + 1)
            tensors += floating(as_tuple(mb.outputs))
            grads += received
        for dst, routes in self.skip_out.items():
            received = self._recv(mb.recv_skip_grad.pop(dst),
                                  f"the skip gradients of micro-batch {i}", dst)
            tensors += floating([mb.skips_out[r.key] for r in routes])
            grads += received
        pairs = [(t, g) for t, g in zip(tensors, grads) if t.requires_grad]
        with trace.span("backward"):
            if pairs and action.kind == INPUT:
                mb.weight_grads = WeightGrads()
                with deferring(mb.weight_grads):
                    torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
            elif pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if not self.first:
            assert mb.inputs is not None
            mb.input_grads = tuple(grad_or_zeros(t) for t in floating(as_tuple(mb.inputs)))
        for src, routes in self.skip_in.items():
            mb.skip_grads[src] = tuple(grad_or_zeros(t) for t in
                                       floating([mb.skips_in[r.key] for r in routes]))
        mb.inputs = mb.outputs = mb.loss = None
        mb.skips_in, mb.skips_out, mb.recv_b = {}, {}, None

    def _weight(self, action: Action) -> None:
        """W of micro-batch i: the weight gradients its I deferred."""
        mb = self.step.mbs[action.microbatch]
        grads, mb.weight_grads = mb.weight_grads, None
        if grads is not None:
            with trace.span("weight"):
                grads.run()
