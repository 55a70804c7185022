"""A thread that reports a stage stuck past the timeout, and stops it when a peer failed.

On gloo every wait of a step is bounded, so a stuck stage raises its own `PipelineError`. On
NCCL a wait only orders GPU streams: the host runs ahead and the step hangs on the device,
where no timed wait can see it, and a failed peer's abort marker cannot be read without a
host sync. The watchdog covers both from a background thread:

    check, every `poll` seconds while a step runs    then
    no progress for `timeout`                        report where the stage is stuck: the
                                                     step's first P2P operation that has not
                                                     completed (NCCL works can be polled),
                                                     or the action the host is blocked in
    a peer of the pipeline published an abort        report "a peer failed first" with its
    in the store (`comm.publish_abort`)              error

and `on_hang(report)`: by default the report goes to stderr and the process exits with
`EXIT_CODE`, as NCCL's own watchdog would tear it down later without saying why. Progress is
an action completed on the host or a P2P operation completed on the device.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

__all__ = ["EXIT_CODE", "Watchdog"]

EXIT_CODE = 75   # a stage stopped by its watchdog (EX_TEMPFAIL: a launcher may restart it)


def _report_and_exit(report: str) -> None:
    sys.stderr.write(report + "\n")
    sys.stderr.flush()
    os._exit(EXIT_CODE)


class Watchdog:
    """Watches one stage's steps: `enter` / `beat` / `leave` from the executor's thread.

    `describe(stuck_for)` returns the report of where the stage is; `pending()` the labels of
    P2P operations issued and not completed yet (progress when it shrinks); `peer_failed()`
    the text of a peer's abort, or None.
    """

    def __init__(self, timeout: datetime.timedelta, *, describe: Callable[[float], str],
                 pending: Callable[[], Sequence[str]] = tuple,
                 peer_failed: Callable[[], str | None] = lambda: None,
                 on_hang: Callable[[str], None] = _report_and_exit,
                 poll: float = 1.0) -> None:
        self.timeout = timeout.total_seconds()
        self.describe, self.pending, self.peer_failed = describe, pending, peer_failed
        self.on_hang, self.poll = on_hang, poll
        self._lock = threading.Lock()
        self._armed = False
        self._last = time.monotonic()
        self._left = -1                      # pending ops at the last check
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridpar-watchdog",
                                        daemon=True)
        self._thread.start()

    def enter(self) -> None:
        """A step starts."""
        with self._lock:
            self._armed, self._last, self._left = True, time.monotonic(), -1

    def beat(self) -> None:
        """The host completed an action."""
        self._last = time.monotonic()

    def leave(self) -> None:
        """The step ended (or failed on this rank: it reports by itself)."""
        with self._lock:
            self._armed = False

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        self._thread.join(timeout=self.poll + 1)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            with self._lock:
                if not self._armed:
                    continue
                report = self._check()
                if report is not None:
                    self._armed = False
            if report is not None:
                self.on_hang(report)

    def _check(self) -> str | None:
        failed = self.peer_failed()
        if failed is not None:
            return failed
        left = len(self.pending())
        now = time.monotonic()
        if 0 <= left < self._left:       # the device completed operations: progress
            self._last = now
        self._left = left
        stuck = now - self._last
        return self.describe(stuck) if stuck > self.timeout else None
