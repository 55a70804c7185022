"""Run one stage's action list: receive, compute the partition, send; backward in reverse.

The schedule says what to do (`schedule.py`); this module only does it. Channels between a
pair of ranks (each a tag pair in `comm`):

    channel     carries                                   direction
    FWD  0      stage output of micro-batch i             s -> s + 1
    BWD  1      gradient of that output                   s + 1 -> s
    SKIP 2      skip tensors stashed on a, popped on b    a -> b
    SKIPG 3     their gradients                           b -> a

Every floating tensor that crosses a boundary in training gets a gradient back (zeros when
the receiver did not use it), so sender and receiver agree on the messages without asking.

Timeline events (`hybridpar.trace`, while it records) per action; each is tagged with the
stage and the action's micro-batch, so the collectives and transfers inside inherit them:

    action    events
    RECV_F/B  none (posting a receive is free); its message is taken by the F / B that needs it
    F i       recv FWD (+ SKIP), then forward (loss included on the last stage)
    B i       recompute (checkpointed i), recv BWD (+ SKIPG), then backward
    SEND_F/B  send FWD (+ SKIP) / send BWD (+ SKIPG)
    the end   wait (for the posted sends), all inside one step span

Failures (`failure.py`): whatever stops a stage raises one `PipelineError` block per rank
(stage, action, micro-batch, the peer and operation waited for, the last completed action),
after sending aborts to the peers still owed a message this step, so they stop at once.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.tracker import use_skip_tracker

from hybridpar import comm, trace
from hybridpar.pipeline import failure
from hybridpar.pipeline.checkpoint import RNGReplay, is_checkpointed
from hybridpar.pipeline.failure import Aborted, PipelineError, WaitFailed
from hybridpar.pipeline.schedule import Action
from hybridpar.pipeline.skip import SkipRoute, StageSkipTracker
from hybridpar.tensor_parallel.attrs import get_parallel_dim, register_parallel_dim

__all__ = ["PipelineError", "StageExecutor", "StageSpec", "current_microbatch"]

FWD, BWD, SKIP, SKIPG = 0, 1, 2, 3

TensorOrTensors = Tensor | tuple[Tensor, ...]
SkipKey = tuple[Namespace, str]


_local = threading.local()


def current_microbatch() -> Tensor | None:
    """A tensor that identifies the micro-batch being computed on this stage (None outside).

    The same object during the first forward and the recomputation of a micro-batch, so it
    can key a dict or a weak reference, as torchgpipe's `current_microbatch`.
    """
    return getattr(_local, "microbatch", None)


@contextmanager
def _microbatch_context(key: Tensor) -> Iterator[None]:
    before = getattr(_local, "microbatch", None)
    _local.microbatch = key
    try:
        yield
    finally:
        _local.microbatch = before


@dataclass
class StageSpec:
    """What an executor needs to know about its stage."""

    stage: int
    num_stages: int
    partition: nn.Sequential
    routes: Sequence[SkipRoute]
    rank_of_stage: Callable[[int], int]
    tp_group: ProcessGroup | None
    timeout: datetime.timedelta
    checkpoint: str = "except_last"
    replay: RNGReplay = field(default_factory=RNGReplay)


@dataclass
class _MicroBatch:
    key: Tensor
    inputs: TensorOrTensors | None = None
    outputs: TensorOrTensors | None = None
    loss: Tensor | None = None
    skips_in: dict[SkipKey, Tensor] = field(default_factory=dict)
    skips_out: dict[SkipKey, Tensor] = field(default_factory=dict)
    rng: Any = None
    input_grads: tuple[Tensor, ...] = ()
    skip_grads: dict[int, tuple[Tensor, ...]] = field(default_factory=dict)
    recv_f: comm.PostedRecv | None = None
    recv_b: comm.PostedRecv | None = None
    recv_skip: dict[int, comm.PostedRecv] = field(default_factory=dict)
    recv_skip_grad: dict[int, comm.PostedRecv] = field(default_factory=dict)


def _as_tuple(x: TensorOrTensors) -> tuple[Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def _floating(tensors: Sequence[Tensor]) -> list[Tensor]:
    return [t for t in tensors if t.is_floating_point()]


@dataclass
class StepResult:
    """What a step leaves on this stage: the weighted loss sum (last stage) and outputs."""

    loss: Tensor | None
    outputs: list[TensorOrTensors]


class StageExecutor:
    """Interprets a stage's action list for one step (training or inference)."""

    def __init__(self, spec: StageSpec) -> None:
        self.spec = spec
        self.history = comm.History()  # predicts the P2P headers of a step from the last one
        s = spec.stage
        self.first, self.last = s == 0, s == spec.num_stages - 1
        self.skip_in: dict[int, list[SkipRoute]] = {}
        self.skip_out: dict[int, list[SkipRoute]] = {}
        for r in spec.routes:
            if r.dst == s and r.src != s:
                self.skip_in.setdefault(r.src, []).append(r)
            if r.src == s and r.dst != s:
                self.skip_out.setdefault(r.dst, []).append(r)

    # one step ----------------------------------------------------------------------------
    def run(self, actions: Sequence[Action], *, inputs: Sequence[TensorOrTensors] | None,
            targets: Sequence[Any] | None, loss_fn: Callable[..., Tensor] | None,
            weights: Sequence[float], train: bool, what: str = "step") -> StepResult:
        """Run `actions`; `inputs` on the first stage, `targets` and `loss_fn` on the last.

        `what` names the step in error messages ("train_step", "eval_step", "forward").
        """
        self.train, self.inputs, self.targets = train, inputs, targets
        self.loss_fn, self.weights = loss_fn, weights
        self.m = len(weights)
        self.history.new_step(what)  # its P2P headers are predicted from the last such step
        self.mbs = [_MicroBatch(key=torch.empty(0)) for _ in range(self.m)]
        self.sends: list[tuple[Any, str, int]] = []
        self.loss_sum: Tensor | None = None
        self.outputs: list[TensorOrTensors] = []
        self.what, self.actions, self.last_done = what, list(actions), None
        handlers = {"RECV_F": self._recv_f, "F": self._forward, "SEND_F": self._send_f,
                    "RECV_B": self._recv_b, "B": self._backward, "SEND_B": self._send_b}
        recorder = trace.RECORDER
        recorder.stage, recorder.microbatch = self.spec.stage, -1
        with trace.span("step"):
            for index, action in enumerate(self.actions):
                recorder.microbatch = action.microbatch  # tags the events of this action
                try:
                    handlers[action.kind](action.microbatch)
                except Exception as e:
                    raise self._fail(e, index) from e
                self.last_done = action
            recorder.microbatch = -1
            with trace.span("wait"):
                try:
                    for work, what_, stage in self.sends:
                        self._wait(work, what_, stage)
                except Exception as e:
                    raise self._fail(e, len(self.actions)) from e
        self.mbs = []
        return StepResult(self.loss_sum, self.outputs)

    def _wait(self, work: Any, what: str, stage: int) -> None:
        try:
            work.wait(self.spec.timeout)
        except RuntimeError as e:
            raise WaitFailed(f"send {what} to", stage, self._rank(stage), e) from e

    def _rank(self, stage: int) -> int:
        return self.spec.rank_of_stage(stage)

    def _recv(self, posted: comm.PostedRecv | None, what: str, stage: int) -> tuple[Tensor, ...]:
        assert posted is not None, f"schedule error: {what} was never posted"
        try:
            return posted.wait(self.spec.timeout)
        except comm.PeerFailed as e:
            raise Aborted(f"receive {what} from", stage, posted.src, e) from e
        except RuntimeError as e:
            raise WaitFailed(f"receive {what} from", stage, posted.src, e) from e

    def _post(self, stage: int, channel: int) -> comm.PostedRecv:
        return comm.post_recv(self._rank(stage), channel=channel, tp_group=self.spec.tp_group,
                              history=self.history)

    def _send(self, tensors: Sequence[Tensor], stage: int, channel: int, what: str,
              *, grads: bool, single: bool = False) -> None:
        works = comm.send(tuple(tensors), self._rank(stage), channel=channel,
                          tp_group=self.spec.tp_group, grads=grads, single=single,
                          history=self.history)
        self.sends.extend((w, what, stage) for w in works)

    # failures ----------------------------------------------------------------------------
    def _place(self, index: int = 0) -> failure.StepPlace:
        return failure.StepPlace(self.spec.stage, self.spec.num_stages, dist.get_rank(),
                                 getattr(self, "what", "step"), self.spec.timeout,
                                 getattr(self, "actions", ()), index,
                                 getattr(self, "last_done", None))

    @contextmanager
    def guard(self, operation: str, ranks: Sequence[int]) -> Iterator[None]:
        """Run a collective of the step outside the schedule (loss, dp gradients, norm);
        its failure (a timeout, a peer gone) becomes a `PipelineError` block."""
        try:
            yield
        except PipelineError:
            raise
        except RuntimeError as e:
            self.history.clear()
            raise failure.collective_error(operation, ranks, self._place(), e) from e

    def _fail(self, error: Exception, index: int) -> PipelineError:
        """The error block of a failure at action `index`, after telling the peers (aborts)."""
        self.history.clear()  # this step's messages were not all exchanged
        if isinstance(error, PipelineError):
            return error
        place = self._place(index)
        hint = "" if isinstance(error, WaitFailed) else self._hint(error, place.action)
        report = failure.describe(error, place, hint=hint)
        failure.send_aborts(self._owed(index), report, self.spec.timeout)
        return PipelineError(report.message)

    def _owed(self, index: int) -> list[tuple[int, int]]:
        """(rank, channel) of every message this stage still owes a peer from action `index`."""
        targets: list[tuple[int, int]] = []
        for action in self.actions[index:]:
            if action.kind == "SEND_F":
                targets += [(self._rank(self.spec.stage + 1), FWD)]
                targets += [(self._rank(dst), SKIP) for dst in self.skip_out]
            elif action.kind == "SEND_B":
                targets += [(self._rank(self.spec.stage - 1), BWD)]
                targets += [(self._rank(src), SKIPG) for src in self.skip_in]
        return targets

    def _hint(self, error: Exception, action: Action | None) -> str:
        """How to fix a failure inside this stage's own computation (empty: no advice)."""
        if "Timed out" in str(error):
            return ("a collective inside the stage timed out: a tensor-parallel peer of this "
                    "stage is stuck or failed (see its error)")
        if action is None or action.kind != "F" or self.first or not isinstance(
                error, (RuntimeError, ValueError)):
            return ""
        mb = self.mbs[action.microbatch]
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in _as_tuple(mb.inputs)) \
            if isinstance(mb.inputs, (Tensor, tuple)) else "?"
        return (f"stage {self.spec.stage}'s input came from stage {self.spec.stage - 1} as "
                f"{shapes}; check that the layers on both sides of the stage boundary fit (run "
                "the model on one device: model(x) must work)")

    # forward -----------------------------------------------------------------------------
    def _recv_f(self, i: int) -> None:
        mb = self.mbs[i]
        mb.recv_f = self._post(self.spec.stage - 1, FWD)
        for src in self.skip_in:
            mb.recv_skip[src] = self._post(src, SKIP)

    def _forward(self, i: int) -> None:
        mb = self.mbs[i]
        if self.first:
            assert self.inputs is not None
            mb.inputs = self.inputs[i]
        else:
            posted, mb.recv_f = mb.recv_f, None
            received = self._recv(posted, f"the activation of micro-batch {i}",
                                  self.spec.stage - 1)
            mb.inputs = received[0] if posted is not None and posted.single else received
        for src, routes in self.skip_in.items():
            tensors = self._recv(mb.recv_skip.pop(src), f"the skips of micro-batch {i}", src)
            mb.skips_in.update((r.key, t) for r, t in zip(routes, tensors))
        checkpointed = self.train and is_checkpointed(self.spec.checkpoint, i, self.m)
        with trace.span("forward"):
            if checkpointed:
                with self.spec.replay.first_forward() as state:
                    mb.rng = state
                    self._compute(mb, i)
            elif self.train:
                self._compute(mb, i)
            else:
                with torch.no_grad():
                    self._compute(mb, i)
        if self.last:
            if self.train:
                assert mb.loss is not None
                value = mb.loss.detach()
                self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
                if checkpointed:
                    mb.loss = None
            elif self.loss_fn is not None and self.targets is not None:  # evaluation
                assert mb.outputs is not None
                with torch.no_grad():
                    value = _scalar_loss(self.loss_fn(mb.outputs, self.targets[i])) \
                        * self.weights[i]
                self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
                mb.outputs = None
            else:
                assert mb.outputs is not None
                self.outputs.append(mb.outputs)

    def _compute(self, mb: _MicroBatch, i: int) -> None:
        """The partition's forward on micro-batch `i` (and the weighted loss on the last stage)."""
        tracker = StageSkipTracker(self.spec.routes, self.spec.stage, mb.skips_in)
        with use_skip_tracker(tracker), _microbatch_context(mb.key):
            assert mb.inputs is not None
            out = self.spec.partition(mb.inputs)
        if not self.last and not isinstance(out, (Tensor, tuple)):
            raise TypeError(f"stage {self.spec.stage} returned {type(out).__name__}; a stage "
                            "must return a Tensor or a tuple of Tensors")
        mb.outputs, mb.skips_out = out, tracker.outgoing
        if self.last and self.train:
            assert self.loss_fn is not None and self.targets is not None
            mb.loss = _scalar_loss(self.loss_fn(out, self.targets[i])) * self.weights[i]

    def _send_f(self, i: int) -> None:
        mb = self.mbs[i]
        assert mb.outputs is not None
        self._send(_as_tuple(mb.outputs), self.spec.stage + 1, FWD,
                   f"the activation of micro-batch {i}", grads=self.train,
                   single=isinstance(mb.outputs, Tensor))
        for dst, routes in self.skip_out.items():
            self._send([mb.skips_out[r.key] for r in routes], dst, SKIP,
                       f"the skips of micro-batch {i}", grads=self.train)
        if not self.train:
            mb.outputs, mb.skips_out = None, {}

    # backward ----------------------------------------------------------------------------
    def _recv_b(self, i: int) -> None:
        mb = self.mbs[i]
        mb.recv_b = self._post(self.spec.stage + 1, BWD)
        for dst in self.skip_out:
            mb.recv_skip_grad[dst] = self._post(dst, SKIPG)

    def _backward(self, i: int) -> None:
        mb = self.mbs[i]
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
            tensors += _floating(_as_tuple(mb.outputs))
            grads += received
        for dst, routes in self.skip_out.items():
            received = self._recv(mb.recv_skip_grad.pop(dst),
                                  f"the skip gradients of micro-batch {i}", dst)
            tensors += [mb.skips_out[r.key] for r in routes]
            grads += received
        pairs = [(t, g) for t, g in zip(tensors, grads) if t.requires_grad]
        with trace.span("backward"):
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        if not self.first:
            assert mb.inputs is not None
            mb.input_grads = tuple(_grad_or_zeros(t) for t in _floating(_as_tuple(mb.inputs)))
        for src, routes in self.skip_in.items():
            mb.skip_grads[src] = tuple(_grad_or_zeros(mb.skips_in[r.key]) for r in routes)
        mb.inputs = mb.outputs = mb.loss = None
        mb.skips_in, mb.skips_out, mb.recv_b = {}, {}, None

    def _send_b(self, i: int) -> None:
        mb = self.mbs[i]
        self._send(mb.input_grads, self.spec.stage - 1, BWD,
                   f"the gradient of micro-batch {i}", grads=False)
        for src, grads in mb.skip_grads.items():
            self._send(grads, src, SKIPG, f"the skip gradients of micro-batch {i}", grads=False)
        mb.input_grads, mb.skip_grads = (), {}


def _scalar_loss(loss: Any) -> Tensor:
    """`loss_fn`'s value as a 0-d tensor, or a `TypeError` that says what it must return."""
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        got = (f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
               if isinstance(loss, Tensor) else type(loss).__name__)
        raise TypeError(f"loss_fn returned {got}; it must return the mean loss of the "
                        "micro-batch as a floating scalar tensor (e.g. F.cross_entropy(out, y) "
                        "with reduction='mean')")
    return loss.reshape(())


def _grad_or_zeros(t: Tensor) -> Tensor:
    """The gradient of a received tensor, sharded like it (so it never travels scattered)."""
    grad = t.grad if t.grad is not None else torch.zeros_like(t)
    tag = get_parallel_dim(t)
    if tag is not None:
        register_parallel_dim(grad, tag)
    return grad
