"""A thread that stops a stage when a peer of its pipeline failed (gloo): between actions, or
out of a wait that would otherwise last the timeout.

A rank whose own action raises publishes its error under its pipeline's key in the store
(`comm.publish_abort(pipeline=...)`). The aborts it sends (`failure.send_aborts`) reach only
the peers it still owes a message; the listener tells every other one:

    while a step (or a collective after it) runs,    then
    every `poll` seconds
    the pipeline's key is set by a peer              `stopped` = its error: the executor reads
                                                     it before each action (a stage busy
                                                     computing stops at its next action)
    ... and `wake_after` seconds later, still armed  `wake(groups)`: break the waits of the
                                                     step's groups (a stage that only sends to
                                                     the failed one, or waits in the output
                                                     broadcast or the loss), which then raise

`wake_after` leaves the aborts time to arrive first: they name the peer waited for, and break
no process group. Between steps the thread sleeps on an event: one store read per `poll`
while armed, nothing on the executor's hot path but reading `stopped`.

torch 2.13 binds no `Work.abort` in Python; `comm.interrupt` breaks a group's waits instead,
as gloo's own timeout does (the group is unusable afterwards: the job ends after a
`PipelineError` anyway). On NCCL the listener is off (`Listener()`): the watchdog reports a
peer's failure and ends the process (`watchdog.py`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from torch.distributed import ProcessGroup

from hybridpar.comm import p2p as comm

__all__ = ["POLL", "WAKE_AFTER", "Listener"]

POLL = 0.02        # seconds between two reads of the store while a step runs
WAKE_AFTER = 0.25  # seconds between seeing a peer's failure and breaking a wait

Check = Callable[[int], "comm.PeerFailed | None"]
Wake = Callable[["comm.PeerFailed", Sequence["ProcessGroup | None"]], None]


class Listener:
    """Listens for a pipeline peer's failure: `enter` / `leave` from the executor's thread.

    `check(step)` returns the failure a peer published for `step` (one store read), or None;
    `wake(failed, groups)` breaks this rank's waits on `groups` (None: the default group).
    """

    def __init__(self, check: Check | None = None, wake: Wake | None = None, *,
                 poll: float = POLL, wake_after: float = WAKE_AFTER) -> None:
        self.check, self.wake = check, wake
        self.poll, self.wake_after = poll, wake_after
        self.on = check is not None and wake is not None   # off: NCCL, one stage, a watchdog
        self.stopped: comm.PeerFailed | None = None   # the executor reads it between actions
        self._lock = threading.Lock()
        self._armed = threading.Event()
        self._closed = False
        self._step = 0
        self._groups: list[ProcessGroup | None] = [None]
        self._entered = 0             # counts enter(): a check of an earlier one is dropped
        self._since = 0.0             # when `stopped` was set
        self._woken = False
        self._thread = threading.Thread(target=self._run, name="hybridpar-listener",
                                        daemon=True)
        if self.on:
            self._thread.start()

    def enter(self, step: int, group: ProcessGroup | None = None) -> None:
        """Listen for failures of `step`; a wait broken then is on the default group (and on
        `group`: a collective after the schedule)."""
        if not self.on:
            return
        with self._lock:
            self.stopped, self._woken = None, False
            self._step, self._entered = step, self._entered + 1
            self._groups = [None] if group is None else [None, group]
            self._armed.set()

    def leave(self) -> None:
        if not self.on:
            return
        with self._lock:
            self._armed.clear()

    def close(self) -> None:
        """Stop the thread."""
        if not self.on:
            return
        self._closed = True
        self._armed.set()
        self._thread.join(timeout=self.poll + 1)

    def _run(self) -> None:
        while True:
            self._armed.wait()            # between steps: asleep, no store reads
            time.sleep(self.poll)
            if self._closed:
                return
            with self._lock:
                if not self._armed.is_set():
                    continue
                step, entered, failed = self._step, self._entered, self.stopped
            if failed is None:
                assert self.check is not None
                try:
                    failed = self.check(step)
                except RuntimeError:      # the store is gone: the waits time out
                    failed = None
            with self._lock:
                if not self._armed.is_set() or entered != self._entered or failed is None:
                    continue
                now = time.monotonic()
                if self.stopped is None:
                    self.stopped, self._since = failed, now
                if not self._woken and now - self._since >= self.wake_after:
                    self._woken = True    # under the lock: never once the step has left
                    assert self.wake is not None
                    self.wake(failed, self._groups)
