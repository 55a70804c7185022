"""How a stage stops: its failures raised with the step's place, aborts sent to the peers
still owed a message, the listener's and the watchdog's questions (what is pending, who
failed).

    this rank's own error     re-raised, the step's block added as a note (as torchgpipe)
    a wait that failed        a `PipelineError` block (a timeout, a peer gone or aborted)
    a peer's failure seen     a `PipelineError` block before the next action, or out of the
    by the listener (gloo)    wait it broke (`listener.py`): the stage "stopped"
    before raising            an abort to every peer owed a message this step (`failure`);
                              an own error is also published for the whole pipeline

`StageStops` is a base of `StageExecutor`: these methods read the step it runs.
"""

from __future__ import annotations

import datetime
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NoReturn

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar.comm import p2p as comm
from hybridpar.pipeline.failures import failure
from hybridpar.pipeline.failures.failure import (
    PEER_GRACE,
    Aborted,
    PeerStopped,
    PipelineError,
    WaitFailed,
)
from hybridpar.pipeline.failures.listener import Listener
from hybridpar.pipeline.failures.watchdog import Watchdog, inside
from hybridpar.pipeline.runtime.skip import SkipRoute
from hybridpar.pipeline.runtime.step import StageSpec, StepState, as_tuple
from hybridpar.pipeline.schedules.lowering import FWD, SKIP, messages
from hybridpar.pipeline.schedules.schedule import (
    BACKWARD,
    COMPUTE,
    FORWARD,
    INPUT,
    WEIGHT,
    Action,
)
from hybridpar.process import generation

__all__ = ["StageStops"]

# executors made in this process, in the same order on every rank (a HybridPipe is built by
# every rank together): keys a pipeline's failures in the store, so that an earlier pipe's
# failure at step k never stops a later pipe's step k
_executors = itertools.count()


class StageStops:
    """Failure handling of a stage executor (see the module docstring)."""

    spec: StageSpec
    step: StepState
    wire: comm.Wire
    book: comm.SpecBook
    steps: int
    first: bool
    watchdog: Watchdog | None
    listener: Listener
    pipeline_key: str
    skip_in: dict[int, list[SkipRoute]]
    skip_out: dict[int, list[SkipRoute]]
    _rank: Callable[[int], int]
    _expected: Callable[[int, int, int], comm.MessageSpec | None]
    # virtual stages: the stage of this rank acting now, whose place the watchdog reports
    # (set on the rank's first stage by `virtual.RankStages`; None: this one)
    acting: StageStops | None = None

    @property
    def _timeout(self) -> datetime.timedelta | None:
        raise NotImplementedError   # StageMessages's

    def _pending(self) -> list[str]:
        """Issued P2P operations not completed yet (NCCL works can be polled; gloo's say
        False until waited on, so on gloo only the host's progress counts)."""
        return [f"{'send' if send else 'receive'} {label} {'to' if send else 'from'} rank {peer}"
                for send, label, peer, works in list(self.step.issued)
                if not all(w.is_completed() for w in works)]

    def _hang_report(self, stuck_for: float) -> str:
        # on a GPU the first operation the device has not completed; on gloo (works say
        # nothing until waited on) what the host waits for
        acting = self.acting or self
        assert self.watchdog is not None
        pending = self._pending() if self.spec.device.type != "cpu" else []
        place = acting._place(acting.step.at)
        timeout = datetime.timedelta(seconds=self.watchdog.timeout)
        if not pending and not acting.step.waiting and not self.watchdog.host_done and \
                place.action is not None and place.action.kind in COMPUTE:
            return failure.compute_hang_report(place, stuck_for,
                                               acting._computing(place.action), timeout)
        waiting = pending[0] if pending else acting.step.waiting or (
            "the device to finish the step's queued work (its collectives: loss, gradients, "
            "norm); the host has left the step" if self.watchdog.host_done
            else "an operation on the host")
        return failure.hang_report(place, stuck_for, waiting, timeout)

    def _computing(self, action: Action) -> str:
        """What this stage computes in `action`, the layer its thread runs in when its
        Python stack shows it (`watchdog.inside`)."""
        kinds = {FORWARD: "the forward", BACKWARD: "the backward",
                 INPUT: "the input gradients", WEIGHT: "the weight gradients"}
        text = f"{kinds.get(action.kind, action.kind)} of micro-batch {action.microbatch} " \
               f"on stage {self.spec.stage}"
        assert self.watchdog is not None
        layers = {id(m): f"layer {name} ({type(m).__name__})"
                  for name, m in self.spec.partition.named_children()}
        layer, collective = inside(self.watchdog.thread, layers)
        if layer is not None:
            text += f", in {layer}"
        if collective is not None:
            text += f", blocked in torch.distributed's {collective} (a collective of the layer)"
        return text

    def _peer_abort(self) -> str | None:
        """A published abort of this step by a peer of the pipeline, or a hang any rank's
        watchdog published, as a report."""
        acting = self.acting or self
        me = dist.get_rank()
        hang = comm.read_hang()
        if hang is not None and hang.src != me:
            return failure.peer_abort_report(acting._place(acting.step.at), hang)
        for rank in dict.fromkeys(self._rank(t) for t in range(self.spec.num_stages)):
            if rank == me:
                continue
            failed = comm.read_abort(self.steps, rank)
            if failed is not None:
                return failure.peer_abort_report(acting._place(acting.step.at), failed)
        return None

    # the listener (gloo) -------------------------------------------------------------------
    def _listener(self) -> Listener:
        """This stage's listener: on gloo with peers and no watchdog (which, when asked for,
        answers a peer's failure as on NCCL: it reports and ends the process)."""
        self.pipeline_key = f"{next(_executors)}.{self._rank(0)}"   # its key in the store
        if not self.spec.listen or self.spec.device.type != "cpu" or \
                self.spec.num_stages == 1 or \
                self.spec.watchdog is not None or "gloo" not in str(dist.get_backend()):
            return Listener()
        return Listener(self._peer_failure, self._wake)

    def _peer_failure(self, step: int) -> comm.PeerFailed | None:
        """The failure a pipeline peer published for `step` (one store read)."""
        failed = comm.read_pipeline_abort(step, self.pipeline_key)
        return None if failed is None or failed.src == dist.get_rank() else failed

    def _wake(self, failed: comm.PeerFailed, groups: Sequence[ProcessGroup | None]) -> None:
        """Break this rank's waits on `groups` (the listener's thread; the stage stops)."""
        me = dist.get_rank()
        for group in groups:
            ranks = dist.get_process_group_ranks(group) if group is not None else \
                [failed.src]
            peer = failed.src if failed.src in ranks else next(
                (r for r in ranks if r != me), None)
            if peer is not None and peer != me:
                comm.interrupt(group, peer)

    def peer_stopped(self) -> PeerStopped:
        """The error of a stage stopped between actions by the listener."""
        failed = self.listener.stopped
        assert failed is not None
        return PeerStopped("", failed.origin_stage, failed.origin_rank, failed)

    def _stopped_by(self, step: int) -> comm.PeerFailed | None:
        """A pipeline peer's failure of `step`, when a wait broke: the listener's, or read now
        (a peer's process may have closed the connection first)."""
        if not self.listener.on:
            return None
        if self.listener.stopped is not None:
            return self.listener.stopped
        try:
            return self._peer_failure(step)
        except RuntimeError:
            return None


    # failures ----------------------------------------------------------------------------
    def _place(self, index: int = 0) -> failure.StepPlace:
        return failure.StepPlace(self.spec.stage, self.spec.num_stages, dist.get_rank(),
                                 self.step.what, self.spec.timeout,
                                 self.step.actions, index,
                                 self.step.last_done)

    @contextmanager
    def guard(self, operation: str, ranks: Sequence[int],
              group: ProcessGroup | None = None) -> Iterator[None]:
        """Run a collective of the step outside the schedule (loss, dp gradients, norm) on
        `group`; its failure (a timeout, a peer gone, a pipeline peer's failure the listener
        saw) becomes a `PipelineError` block."""
        step = self.steps - 1   # the step just run
        self.listener.enter(step, group)
        self.step.waiting = f"{operation} (ranks {list(ranks)})"   # the watchdog's report
        try:
            yield
            if self.watchdog is not None:
                self.watchdog.beat()
        except PipelineError:
            raise
        except RuntimeError as e:
            self.book.clear()
            failed = self._stopped_by(step)
            if failed is not None:
                time.sleep(PEER_GRACE)   # the failing rank reports first
                raise failure.collective_stopped(operation, ranks, self._place(), failed) \
                    from e
            raise failure.collective_error(operation, ranks, self._place(), e) from e
        finally:
            self.step.waiting = ""
            self.listener.leave()

    def raise_at(self, error: Exception, index: int,
               owed: list[tuple[int, int, Tensor]] | None = None) -> NoReturn:
        """Raise the failure at action `index` after telling the peers (as torchgpipe, the
        failing rank raises its own exception, the step's block added as a note; a wait on a
        peer that failed or went away raises the `PipelineError` block). `owed`: the aborts
        to send (default: this stage's `owed`)."""
        failed = self._fail(error, index, owed)
        generation.mark_broken(f"{self.step.what or 'a step'} failed: {type(error).__name__}: "
                               f"{str(error).splitlines()[0] if str(error) else ''}")
        if failed is error:
            raise error
        raise failed from error

    def _fail(self, error: Exception, index: int,
              owed: list[tuple[int, int, Tensor]] | None = None) -> Exception:
        """The exception a failure at action `index` raises, after telling the peers (aborts):
        this rank's own error with the step's block as a note, or a `PipelineError` block."""
        self.book.clear()  # this step's messages were not all exchanged
        self.wire.pending.clear()
        self.step.incoming = []
        if isinstance(error, PipelineError):
            return error
        if isinstance(error, WaitFailed) and not isinstance(error, Aborted):
            failed = self._stopped_by(self.steps)   # the wait the listener broke, or lost
            if failed is not None:                  # a peer that failed first
                error = PeerStopped(error.op, error.peer_stage, error.peer_rank, failed)
        place = self._place(index)
        hint = "" if isinstance(error, WaitFailed) else self._hint(error, place.action)
        report = failure.describe(error, place, hint=hint)
        failure.send_aborts(self.owed() if owed is None else owed, report, self.spec.timeout,
                            step=self.steps,
                            dummies=self.spec.device.type == "cpu",
                            pipeline=None if isinstance(error, WaitFailed) else self.pipeline_key,
                            awaited=self.listener.wake_after if self.listener.on else None)
        if isinstance(error, WaitFailed):
            return PipelineError(report.message)
        error.add_note(report.message)
        return error

    def owed(self) -> list[tuple[int, int, Tensor]]:
        """(rank, channel, abort dummy) of the next message this stage owes each peer.

        Messages match by order, so one dummy in place of the next message owed to a peer
        stops it (with `p2p_tags`, the next on each channel: it may wait on any of them).
        """
        owed: dict[tuple[int, int], Tensor] = {}
        for action in self.step.actions[self.step.issued_upto:]:
            for m in messages(action, self.spec.stage, list(self.skip_in), list(self.skip_out)):
                key = (self._rank(m.peer), m.channel if self.spec.p2p_tags else 0)
                if not m.send or key in owed or m.peer in self.spec.local_stages:
                    continue
                spec = self._expected(m.channel, m.peer, action.microbatch)
                if spec is None and m.channel in (FWD, SKIP):   # the peer waits for a header
                    owed[key] = comm.header_dummy(self.spec.device)
                elif spec is None:   # a gradient whose size this stage never learned
                    owed[key] = comm.abort_dummy(None, None, self.spec.device)
                else:   # absent tensors never travel: the first that does stands for it
                    first = next((t for t in spec.tensors if not t.absent), None)
                    if first is not None:
                        owed[key] = comm.abort_dummy(first, self.spec.tp_group,
                                                     self.spec.device)
        return [(rank, channel, dummy) for (rank, channel), dummy in owed.items()]

    def _hint(self, error: Exception, action: Action | None) -> str:
        """How to fix a failure inside this stage's own computation (empty: no advice)."""
        if "Timed out" in str(error):
            return ("a collective inside the stage timed out: a tensor-parallel peer of this "
                    "stage is stuck or failed (see its error)")
        if action is None or action.kind != FORWARD or self.first or not isinstance(
                error, (RuntimeError, ValueError)):
            return ""
        mb = self.step.mbs[action.microbatch]
        shapes = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in as_tuple(mb.inputs)) \
            if isinstance(mb.inputs, (Tensor, tuple)) else "?"
        return (f"stage {self.spec.stage}'s input came from stage {self.spec.stage - 1} as "
                f"{shapes}; check that the layers on both sides of the stage boundary fit (run "
                "the model on one device: model(x) must work)")
