"""A stage's messages: the SEND / RECV actions of a step, queued and issued in groups.

The messages of a step, on channels named for what they carry (matched by order, not by
channel: `comm`):

    channel     carries                                   direction
    FWD  0      stage output of micro-batch i             s -> s + 1
    BWD  1      gradient of that output                   s + 1 -> s
    SKIP 2      skip tensors stashed on a, popped on b    a -> b
    SKIPG 3     their gradients                           b -> a

The communication actions between two compute actions are queued on the `comm.Wire` and
issued as one group just before the compute that follows them (`schedule.groups`). In one
action the messages go in a fixed order: FWD (or BWD) first, then the skip messages by peer
in route order, so both ends list them alike.

Every floating tensor that crosses a boundary in training gets a gradient back (zeros when
the receiver did not use it), so sender and receiver agree on the messages without asking.
A step whose *signature* (train or not, micro-batch shapes and dtypes) is new sends a header
with each forward-direction message; the specs learned are kept per signature (`SpecBook`)
and later steps of that signature send payloads alone. On a GPU the spec of each new
forward-direction message is checked against the dtypes NCCL carries then (once per new
shapes: `p2p_spec.NCCL_DTYPES`), the error naming the layer and the output or skip.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

from torch import Tensor
from torchgpipe.skip.skippable import Skippable

from hybridpar import trace
from hybridpar.comm import p2p as comm
from hybridpar.device import is_cuda
from hybridpar.pipeline.failures.failure import Aborted, WaitFailed
from hybridpar.pipeline.runtime.step import MicroBatch, Posted, as_tuple, describe_spec, nbytes
from hybridpar.pipeline.runtime.stops import StageStops
from hybridpar.pipeline.schedules.lowering import BWD, FWD, LABELS, SKIP, SKIPG, messages
from hybridpar.pipeline.schedules.schedule import (
    COMPUTE,
    GROUP,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    Comm,
)

__all__ = ["PREFETCH", "StageMessages"]

PREFETCH = 2   # gloo: the computes ahead whose receives are posted (`_prefetch`)


class StageMessages(StageStops):
    """The message half of `executor.StageExecutor` (its state: `self.step`, `self.wire`)."""

    tp: int                          # the tp group's size (scatter-gather of activations)
    recorder: trace.Recorder
    _stages: dict[int, int]          # global rank -> pipeline stage

    def _issue(self, index: int) -> None:
        """Issue the communication queued since the last compute as one group.

        On a new signature the forward-direction receives of the group are headers: wait for
        them, then issue their payload receives as a second group.
        """
        incoming, self.step.incoming = self.step.incoming, []
        self.step.issued_upto = index
        works = self.issue_group(slot=index)
        for message in incoming:
            message.issued(works)
        learning = [m for m in incoming if m.spec is None]
        if not learning:
            # the first stage's first compute waits for nothing and every stage waits for
            # it: its receives are posted as the next compute starts
            if self.spec.device.type == "cpu" and self.step.agreed is not None and \
                    not (self.first and index == 0):
                self._prefetch(index)
            return
        with trace.span("wait"):
            for message in learning:
                self.learn_spec(message)
        works = self.issue_group()
        for message in learning:
            message.issued(works)

    def _idle(self) -> None:
        """Before a wait for another rank: the step's `when_idle` task, the first time."""
        task, self.step.when_idle = self.step.when_idle, None
        if task is not None:
            task()

    def learn_spec(self, message: comm.Incoming) -> None:
        """Wait for `message`'s header; note the spec it says (its payloads get queued)."""
        self._idle()
        stage = message.stage
        self.step.waiting = f"receive {message.label} from stage {stage} (rank {message.src})"
        try:
            spec = message.learn(self._timeout, self.step.signature)
            self.step.waiting = ""   # done: the watchdog must not blame this peer now
        except comm.PeerFailed as e:
            raise Aborted(f"receive {message.label} from", stage, message.src, e) from e
        except ValueError:   # the peer's step has other shapes: this rank's failure
            raise
        except RuntimeError as e:
            raise WaitFailed(f"receive {message.label} from", stage, message.src, e) from e
        self.step.learned[message.channel, stage, message.microbatch] = spec

    def _prefetch(self, index: int) -> None:
        """gloo: post the receives of the next `PREFETCH` computes now, ahead of their slots.

        gloo moves a payload only once its receive is posted, so a receive posted in its
        slot costs a round trip when the message is already there. gloo has no rendezvous (a
        posted receive holds back nothing) and receives keep their order, so posting them
        early is safe there. How far ahead (benchmark 1, sleep-simulated stages, A/B in one
        run): posting the next compute's receives as its predecessor starts leaves 1F1B's
        neighbours posting and sending to each other at the same instants, and the C++ posts
        then take up to 2-4x longer (zero-length stages); two computes ahead was 0.05-0.7%
        faster than one at 20 ms stages and 1.5-3% at 5 ms, three ahead no better than one,
        none (the slot order) up to 0.5% slower than two. NCCL keeps the slot order; the log
        records each receive in the group of its slot (docs/benchmarks.md, benchmark 1).
        """
        actions, prefetched = self.step.actions, self.step.prefetched
        computes = 0
        for k in range(index + 1, len(actions)):
            kind = actions[k].kind
            if kind in COMPUTE or kind == GROUP:   # the slot of the receives queued so far
                self._post_early(k)
                computes += kind in COMPUTE
                if computes == PREFETCH:
                    return
            elif kind in (RECV_F, RECV_B) and k not in prefetched:
                self._communicate(actions[k])
                prefetched.add(k)

    def _post_early(self, slot: int) -> None:
        """Post the receives queued by `_prefetch`, which belong to the group of `slot`."""
        if self.step.incoming:
            incoming, self.step.incoming = self.step.incoming, []
            works = self.issue_group(early=True, slot=slot)
            for message in incoming:
                message.issued(works)

    def issue_group(self, *, early: bool = False, slot: int = -1, hold_payloads: bool = False
                    ) -> list[tuple[comm.Op, list[Any]]]:
        """Issue the wire's queue (`comm.Wire.issue`); keep the works of its sends to wait
        for at the end."""
        group = self.wire.issue(early=early, slot=slot, hold_payloads=hold_payloads)
        for op, works in group:
            if op.send:
                self.step.sends.append((works, op.message, self._stage_of(op.peer)))
            if self.watchdog is not None:
                self.step.issued.append((op.send, op.label, op.peer, works))
        return group

    # waits and messages --------------------------------------------------------------------
    @property
    def _timeout(self) -> datetime.timedelta | None:
        # gloo waits are bounded; a wait on NCCL work only orders streams (no host poll)
        return self.spec.timeout if self.spec.device.type == "cpu" else None

    def _stage_of(self, rank: int) -> int:
        return self._stages[rank]

    def wait_sends(self) -> None:
        """Wait for every send of the step issued so far."""
        self._idle()
        with trace.span("wait"):
            for works, what, stage in self.step.sends:
                self._wait(works, what, stage)

    def _wait(self, works: list[Any], what: str, stage: int) -> None:
        self.step.waiting = f"send {what} to stage {stage} (rank {self._rank(stage)})"
        try:
            for work in works:
                comm.wait(work, self._timeout)
            self.step.waiting = ""
        except RuntimeError as e:
            raise WaitFailed(f"send {what} to", stage, self._rank(stage), e) from e

    def _rank(self, stage: int) -> int:
        return self.spec.rank_of_stage(stage)

    def _recv(self, posted: Posted | None, what: str, stage: int
              ) -> tuple[Tensor | None, ...]:
        assert posted is not None, f"schedule error: {what} was never posted"
        if isinstance(posted, comm.Incoming):
            self._idle()
        self.step.waiting = f"receive {what} from stage {stage} (rank {posted.src})"
        try:
            received = posted.finish(self._timeout)
            self.step.waiting = ""   # done: the watchdog must not blame this peer now
            return received
        except comm.PeerFailed as e:
            raise Aborted(f"receive {what} from", stage, posted.src, e) from e
        except RuntimeError as e:
            raise WaitFailed(f"receive {what} from", stage, posted.src, e) from e

    def _expected(self, channel: int, stage: int, i: int) -> comm.MessageSpec | None:
        """The spec of message (channel, peer stage, micro-batch) as far as it is known: a
        forward message's agreed spec (None: this step learns it from a header), or a
        gradient message's, the floating tensors of its forward message (None: that forward
        message was never exchanged)."""
        if channel in (FWD, SKIP):
            return self._agreed(channel, stage, i)
        forward = self._agreed(FWD if channel == BWD else SKIP, stage, i)
        return None if forward is None else forward.grads()

    def _agreed(self, channel: int, stage: int, i: int) -> comm.MessageSpec | None:
        """The spec of forward message (channel, peer stage, micro-batch) (None: learn it)."""
        key = (channel, stage, i)
        if self.step.agreed is not None:
            return self.step.agreed[key]
        return self.step.learned.get(key)

    def _post(self, stage: int, channel: int, i: int, what: str,
              spec: comm.MessageSpec | None) -> comm.Incoming:
        message = comm.Incoming(self.wire, self._rank(stage), channel, what, spec=spec,
                                tp_group=self.spec.tp_group, device=self.spec.device,
                                step=self.steps, microbatch=i, stage=stage,
                                at=self.spec.stage)
        self.step.incoming.append(message)
        return message

    def _send(self, tensors: Sequence[Tensor | None], stage: int, channel: int, i: int, what: str,
              *, grads: bool, single: bool = False) -> None:
        """Queue a message to `stage`: forward-direction ones (grads=True or eval) are checked
        against, or teach, the agreed spec; gradients follow their forward message's spec."""
        header = None
        if channel in (FWD, SKIP):
            spec = comm.spec_of(tensors, self.tp, grads=grads, single=single)
            agreed = self._agreed(channel, stage, i)
            if self.step.agreed is None:   # new shapes: NCCL's dtypes checked once
                if is_cuda(self.spec.device, branch="nccl dtypes"):
                    comm.check_nccl_dtypes(spec, self._carried(channel, stage, spec),
                                           f"stage {self.spec.stage} sends {what} to stage "
                                           f"{stage}")
                self.step.learned[channel, stage, i] = spec
                header = comm.header(spec, self.step.signature, self.spec.device)
            elif agreed != spec:
                none = " (and a skip stashed as None must be None)" if agreed is not None and \
                    [t.absent for t in spec.tensors] != [t.absent for t in agreed.tensors] \
                    else ""
                raise ValueError(
                    f"{what} is {describe_spec(spec)} but in the first step of these input "
                    f"shapes it was {describe_spec(agreed)}; a stage's outputs must have the same "
                    f"shapes, dtypes and parallel-dim tags whenever its inputs have the same "
                    f"shapes{none} (make them depend on input shapes only, not on values)")
        else:
            expected = self._expected(channel, stage, i)
            assert expected is not None, f"{what}: its forward message was never exchanged"
            spec = expected
        size = sum(nbytes(t) for t in tensors if t is not None) if self.recorder.enabled else 0
        with trace.span("send", peer=self._rank(stage), channel=channel, nbytes=size):
            comm.send_message(self.wire, tensors, spec, self._rank(stage), channel, what,
                              tp_group=self.spec.tp_group, header=header)

    def _carried(self, channel: int, peer: int, spec: comm.MessageSpec) -> list[str]:
        """What each tensor of a FWD or SKIP message to `peer` is, to name it in errors."""
        layers = list(self.spec.partition.named_children())
        if channel == FWD:
            name, layer = layers[-1]
            last = f"layer {name} ({type(layer).__name__})"
            return [f"the output of {last}"] if spec.single else \
                [f"output {k} of {last}" for k in range(len(spec.tensors))]
        named = []
        for r in self.skip_out[peer]:
            stash = [f" of layer {n} ({type(m).__name__})" for n, m in layers
                     if isinstance(m, Skippable) and m.namespaced(r.name) == r.key]
            named.append(f"skip {r.name!r}{stash[0] if stash else ''}")
        return named

    # communication -----------------------------------------------------------------------
    def _communicate(self, action: Action | Comm) -> None:
        """Queue the messages of a SEND / RECV action (`lowering.messages` gives the order;
        those of another virtual stage of this rank are handed over instead: `virtual.py`)."""
        i = action.microbatch
        mb = self.step.mbs[i]
        local = self.spec.local_stages
        for m in messages(action, self.spec.stage, list(self.skip_in), list(self.skip_out)):
            if m.peer in local:
                continue
            what = LABELS[m.channel].format(i)
            if m.send:
                self._send_one(mb, m.peer, m.channel, i, what)
                continue
            expected = self._expected(m.channel, m.peer, i)
            assert expected is not None or m.channel in (FWD, SKIP), \
                f"{what}: its forward message was never exchanged"
            incoming = self._post(m.peer, m.channel, i, what, expected)
            if m.channel == FWD:
                mb.recv_f = incoming
            elif m.channel == SKIP:
                mb.recv_skip[m.peer] = incoming
            elif m.channel == BWD:
                mb.recv_b = incoming
            else:
                mb.recv_skip_grad[m.peer] = incoming
        if isinstance(action, Comm):   # one peer's part: the others' may still be owed
            if action.kind == SEND_B:
                mb.skip_grads.pop(action.peer, None)
                if action.peer == self.spec.stage - 1:
                    mb.input_grads = ()
        elif action.kind == SEND_F and not self.step.train:
            mb.outputs, mb.skips_out = None, {}
        elif action.kind == SEND_B:
            mb.input_grads, mb.skip_grads = (), {}

    def _send_one(self, mb: MicroBatch, peer: int, channel: int, i: int, what: str) -> None:
        """Queue one message of micro-batch `i` to stage `peer`."""
        if channel == FWD:
            assert mb.outputs is not None
            self._send(as_tuple(mb.outputs), peer, FWD, i, what, grads=self.step.train,
                       single=isinstance(mb.outputs, Tensor))
        elif channel == SKIP:
            self._send([mb.skips_out[r.key] for r in self.skip_out[peer]], peer, SKIP, i, what,
                       grads=self.step.train)
        elif channel == BWD:
            self._send(mb.input_grads, peer, BWD, i, what, grads=False)
        else:
            self._send(mb.skip_grads[peer], peer, SKIPG, i, what, grads=False)
