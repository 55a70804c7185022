"""How a pipeline stage stops: one `PipelineError` block per rank, and aborts to its peers.

Every wait is bounded by the topology's timeout. Whatever stops a stage, it raises one
`PipelineError` whose message is a block (stage, action, micro-batch, the peer and the
operation it waited for, the last action it completed), and first tells the peers that still
expect messages from it, so they stop at once instead of waiting out the timeout:

    what stopped this stage          headline                       aborts sent to
    an exception in its own action   "failed at F(3): TypeError: …" every peer still owed a
    a wait past the timeout          "gave up at F(3) after …"      message this step,
    a peer's process that ended      "lost stage 1 (rank 1) at …"   except the one it
    an abort from a peer             "stopped at F(3); a peer       waited for and the
                                      failed first: stage 0 …"      rank that failed first

An abort carries the headline (and hint) of the rank that failed first, so every peer's error
quotes it: it is published in the store, then a dummy of the size the peer expects takes the
place of the next message owed (`comm`). A rank's own exception is also published for its
whole pipeline, owed or not: the peers' listeners (`listener.py`, gloo) stop them with it
(`PeerStopped`, "stopped by: ... (listener)"). Sends of aborts are awaited within the
timeout (a gloo send completes when it is received), or, with listeners, `WAKE_AFTER`
seconds: a peer stopped between actions never receives it. A stage stopped by a peer raises
`PEER_GRACE` seconds later, so a launcher that reports the first failure by time shows the
original error. After a `PipelineError` the P2P channels hold unmatched messages (and a
listener may have broken the process group): end the job (launchers restart it from a
checkpoint).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist
from torch import Tensor

from hybridpar.comm import p2p as comm
from hybridpar.pipeline.schedules.schedule import Action

__all__ = ["PEER_GRACE", "Aborted", "PeerStopped", "PipelineError", "Report", "StepPlace",
           "WaitFailed", "action_name", "collective_error", "collective_stopped",
           "compute_hang_report", "describe", "hang_report", "peer_abort_report",
           "send_aborts"]

PEER_GRACE = 0.5  # seconds a stage stopped by a peer's abort waits before raising


class PipelineError(RuntimeError):
    """A stage stopped: the message names the stage, action, micro-batch, the peer and
    operation it waited for, and the last action it completed (one block per rank)."""


class WaitFailed(Exception):
    """A wait on a peer that ended without the message (timeout, or the peer's process died)."""

    def __init__(self, op: str, peer_stage: int, peer_rank: int, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.op, self.peer_stage, self.peer_rank, self.cause = op, peer_stage, peer_rank, cause


class Aborted(WaitFailed):
    """The peer waited for sent an abort: `cause` is the `comm.PeerFailed` it carried."""

    cause: comm.PeerFailed


class PeerStopped(Aborted):
    """The listener found a pipeline peer's failure in the store (`cause`): the stage stops
    before its next action (`op` empty), or a wait it broke (`op`, the peer waited for)."""


def action_name(action: Action) -> str:
    return f"{action.kind}({action.microbatch})"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


@dataclass
class StepPlace:
    """Where a stage is in its step when it stops."""

    stage: int
    num_stages: int
    rank: int
    what: str                         # "train_step", "eval_step", "forward"
    timeout: datetime.timedelta
    actions: Sequence[Action] = ()
    index: int = 0                    # the action that failed; len(actions): the final wait
    last_done: Action | None = None

    @property
    def who(self) -> str:
        return f"stage {self.stage} (rank {self.rank})"

    @property
    def action(self) -> Action | None:
        return self.actions[self.index] if self.index < len(self.actions) else None


@dataclass
class Report:
    """A failure described: the message, what peers are told, whom not to tell."""

    message: str
    origin: tuple[int, int, str]       # (rank, stage, text) of the rank that failed first
    skip: set[int] = field(default_factory=set)
    by_peer: bool = False              # stopped by a peer's abort


def _block(headline: str, place: StepPlace, details: list[tuple[str, str]],
           doing: str = "") -> str:
    action = place.action
    if doing:
        pass
    elif action is not None:
        doing = (f"{action_name(action)}, micro-batch {action.microbatch} (action "
                 f"{place.index + 1} of {len(place.actions)} of this {place.what})")
    else:
        doing = f"none: every action of this {place.what} ran; waiting for its sends to arrive"
    last = action_name(place.last_done) if place.last_done else \
        f"none (the first action of this {place.what})"
    rows = [("stage", f"{place.stage} of {place.num_stages} (rank {place.rank})"),
            ("action", doing)]
    waiting = [d for d in details if d[0] == "waiting for"]
    rows += waiting + [("last completed", last)] + [d for d in details if d not in waiting]
    return "\n".join([headline, *(f"  {key + ':':<15} {value}" for key, value in rows)])


def describe(error: Exception, place: StepPlace, *, hint: str = "") -> Report:
    """The report of `error` stopping the stage at `place` (`hint`: how to fix own errors)."""
    action = place.action
    at = f"{action_name(action)} of {place.what}" if action else f"the end of {place.what}"
    details: list[tuple[str, str]] = []
    if isinstance(error, Aborted):
        first = error.cause
        peer_head, _, peer_hint = first.message.partition("\n")
        headline = f"{place.who} stopped at {at}; a peer failed first: {peer_head}"
        peer = f"stage {error.peer_stage} (rank {error.peer_rank})"
        knows = {error.peer_rank, first.origin_rank}   # whom not to send an abort
        if not isinstance(error, PeerStopped):
            details.append(("waiting for", f"{error.op} {peer}, which sent an abort instead"))
        else:   # the listener: a peer told by the store, not by the one waited for
            knows = {first.origin_rank}
            if error.op:
                details.append(("waiting for", f"{error.op} {peer}"))
            details.append(("stopped by", f"stage {first.origin_stage} (rank "
                                          f"{first.origin_rank})'s failure in the store "
                                          "(listener)"))
        if peer_hint:
            details.append(("peer's hint", peer_hint))
        return Report(_block(headline, place, details),
                      (first.origin_rank, first.origin_stage, first.message), knows,
                      by_peer=True)
    skip: set[int] = set()
    if isinstance(error, WaitFailed):
        skip.add(error.peer_rank)
        peer = f"stage {error.peer_stage} (rank {error.peer_rank})"
        cause = str(error.cause).lower()
        if "closed" in cause or "reset" in cause:
            headline = (f"{place.who} lost {peer} at {at}: its process ended while this stage "
                        f"waited to {error.op} it")
            hint = f"{peer} crashed, was killed, or failed first: see its own error"
        else:
            headline = (f"{place.who} gave up at {at} after {place.timeout} waiting to "
                        f"{error.op} {peer}")
            hint = (f"{peer} is stuck, died, or failed before this message (see its own "
                    "error); if it is only slow, raise the topology timeout "
                    "(hybridpar.init(timeout=...), parallel.timeout)")
        details += [("waiting for", f"{error.op} {peer}"),
                    ("cause", _first_line(error.cause))]
    else:
        headline = f"{place.who} failed at {at}: {type(error).__name__}: {error}"
    if hint:
        details.append(("hint", hint))
    told = f"{headline}\n{hint}" if hint else headline   # what the peers' errors quote
    return Report(_block(headline, place, details), (place.rank, place.stage, told), skip)


def hang_report(place: StepPlace, stuck_for: float, waiting: str,
                timeout: datetime.timedelta) -> str:
    """The watchdog's report of a stage with no progress for `stuck_for` seconds."""
    at = f"{action_name(place.action)} of {place.what}" if place.action else \
        f"the end of {place.what}"
    headline = (f"{place.who} is stuck at {at}: no progress for {stuck_for:.0f} s "
                f"(watchdog, timeout {timeout})")
    details = [("waiting for", waiting),
               ("hint", "the peer of that operation is stuck, died, or failed first (see its "
                        "error); if it is only slow, raise the topology timeout")]
    return _block(headline, place, details)


def compute_hang_report(place: StepPlace, stuck_for: float, computing: str,
                        timeout: datetime.timedelta) -> str:
    """The watchdog's report of a stage stuck in its own compute: no P2P of the pipeline
    pending (its receives done, its sends not due yet), so no peer is to blame."""
    action = place.action
    assert action is not None
    headline = (f"{place.who} is stuck in its own compute at {action_name(action)} of "
                f"{place.what}: no progress for {stuck_for:.0f} s (watchdog, timeout "
                f"{timeout})")
    details = [("waiting for", "nothing from a peer: no communication of the pipeline is "
                               "pending"),
               ("computing", computing),
               ("hint", "this rank's own work is stuck or slow, not a peer: a layer that "
                        "loops or blocks (a lock, a file, a device), or a collective inside "
                        "the layer that a tensor-parallel peer never joined; `py-spy dump "
                        "--pid PID` shows its stack; if it is only slow, raise the topology "
                        "timeout")]
    return _block(headline, place, details)


def peer_abort_report(place: StepPlace, failed: comm.PeerFailed) -> str:
    """The watchdog's report of a stage stopped by a peer's published abort."""
    at = f"{action_name(place.action)} of {place.what}" if place.action else \
        f"the end of {place.what}"
    head, _, hint = failed.message.partition("\n")
    details = [("stopped by", f"rank {failed.src}'s abort in the store (watchdog)")]
    if hint:
        details.append(("peer's hint", hint))
    return _block(f"{place.who} stopped at {at}; a peer failed first: {head}", place, details)


def collective_error(operation: str, ranks: Sequence[int], place: StepPlace,
                     cause: BaseException) -> PipelineError:
    """A collective after the schedule (loss, dp gradients, norm) that failed or timed out."""
    headline = (f"{place.who} gave up in {operation} (ranks {list(ranks)}) after its schedule "
                f"of {place.what} ran, within {place.timeout}")
    details = [("waiting for", f"ranks {list(ranks)} to join {operation}"),
               ("cause", _first_line(cause)),
               ("hint", "a rank of that group is stuck, died, or failed first (see its error); "
                        "if it is only slow, raise the topology timeout")]
    doing = f"{operation}, after every action of this {place.what}"
    return PipelineError(_block(headline, place, details, doing))


def collective_stopped(operation: str, ranks: Sequence[int], place: StepPlace,
                       failed: comm.PeerFailed) -> PipelineError:
    """A collective after the schedule broken by the listener: a peer failed in the step."""
    head, _, hint = failed.message.partition("\n")
    headline = (f"{place.who} stopped in {operation} (ranks {list(ranks)}) after its schedule "
                f"of {place.what} ran; a peer failed first: {head}")
    details = [("waiting for", f"ranks {list(ranks)} to join {operation}"),
               ("stopped by", f"stage {failed.origin_stage} (rank {failed.origin_rank})'s "
                              "failure in the store (listener)")]
    if hint:
        details.append(("peer's hint", hint))
    doing = f"{operation}, after every action of this {place.what}"
    return PipelineError(_block(headline, place, details, doing))


def send_aborts(targets: Iterable[tuple[int, int, Tensor]], report: Report,
                timeout: datetime.timedelta, *, step: int, dummies: bool = True,
                pipeline: str | None = None, awaited: float | None = None) -> None:
    """Tell each peer of `targets` (rank, tag, abort dummy) not skipped that this rank
    stopped: publish `report`'s origin in the store, then send the dummies; await them
    within the timeout, or `awaited` seconds (gloo's timed-out wait then breaks the group:
    the peers' listeners tell them).

    `pipeline`: this rank's own failure, published under the pipeline's key even when no
    message is owed, for every peer's listener (or watchdog). Without `dummies` (NCCL: a
    send would hold the stream, and the peer could not read the marker without a host sync)
    the store alone tells the peers' watchdogs. A stage stopped by a peer then waits
    `PEER_GRACE` seconds, so the first failure is reported first.
    """
    rank, stage, text = report.origin
    targets = [t for t in targets if t[0] not in report.skip]
    if targets or pipeline is not None:
        try:
            comm.publish_abort(step, origin_rank=rank, origin_stage=stage, message=text,
                               pipeline=pipeline)
        except RuntimeError:  # the store is gone: the peers will time out
            targets = []
    if dummies and targets:
        _send_dummies(targets, timeout if awaited is None else min(
            timeout, datetime.timedelta(seconds=awaited)))
    if report.by_peer:
        time.sleep(PEER_GRACE)


def _send_dummies(targets: Sequence[tuple[int, int, Tensor]],
                  timeout: datetime.timedelta) -> None:
    works = []
    for dst, tag, dummy in targets:
        try:
            works.append(dist.isend(dummy, dst, tag=tag))
        except RuntimeError:  # the peer is gone: nothing to tell
            pass
    deadline = time.monotonic() + timeout.total_seconds()
    for work in works:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            if work is not None:
                work.wait(datetime.timedelta(seconds=left))
        except RuntimeError:  # not received in time, or the peer's process ended
            pass
