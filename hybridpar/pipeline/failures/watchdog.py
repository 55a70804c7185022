"""A thread that reports a stage stuck past the timeout, and stops it when a peer failed.

On gloo every wait of a step is bounded, so a stuck stage raises its own `PipelineError`. On
NCCL a wait only orders GPU streams: the host runs ahead and the step hangs on the device,
where no timed wait can see it, and a failed peer's abort marker cannot be read without a
host sync. The watchdog covers both from a background thread:

    check, every `poll` seconds while a step runs    then
    no progress for `timeout`                        report where the stage is stuck: the
                                                     step's first P2P operation that has not
                                                     completed (NCCL works can be polled),
                                                     or the action the host is blocked in;
                                                     with no P2P pending, its own compute
                                                     (the layer and a collective in it, read
                                                     from the thread's stack: `inside`)
    a peer of the pipeline published an abort        report "a peer failed first" with its
    in the store (`comm.publish_abort`)              error

and `on_hang(report)`: by default the report goes to stderr and the process exits with
`EXIT_CODE`, as NCCL's own watchdog would tear it down later without saying why. Progress is
an action completed on the host or a P2P operation completed on the device.

A step is watched as the host sees it, not only its schedule: `HybridPipe` enters around the
whole `train_step` (the loss, dp buckets, partial and tied gradients) and `clip_grad_norm_`;
entries nest, and the last `leave(until=done)` keeps it armed until `done()` is true, on a GPU
until an event recorded at the end of the host's work has completed, so a host that blocks
later (the trainer's ``float(loss)``) is still covered. A `peer_failed` that raises (the
store is gone) is reported once through `on_warning` and the watchdog goes on with timeouts
alone; nothing the thread meets ends it silently.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

__all__ = ["EXIT_CODE", "Watchdog", "inside"]

EXIT_CODE = 75   # a stage stopped by its watchdog (EX_TEMPFAIL: a launcher may restart it)


def _report_and_exit(report: str) -> None:
    _warn(report)
    os._exit(EXIT_CODE)


def _warn(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


class Watchdog:
    """Watches one rank's steps: `enter` / `beat` / `leave` from the training thread.

    `describe(stuck_for)` returns the report of where the stage is; `pending()` the labels of
    P2P operations issued and not completed yet (progress when it shrinks); `peer_failed()`
    the text of a peer's abort, or None; `publish(report)` tells the other ranks of this
    rank's own hang (before `on_hang`); `on_warning(text)` hears what the thread cannot
    watch any more (default: stderr).
    """

    def __init__(self, timeout: datetime.timedelta, *, describe: Callable[[float], str],
                 pending: Callable[[], Sequence[str]] = tuple,
                 peer_failed: Callable[[], str | None] = lambda: None,
                 on_hang: Callable[[str], None] = _report_and_exit,
                 on_warning: Callable[[str], None] = _warn,
                 publish: Callable[[str], None] = lambda report: None,
                 poll: float = 1.0) -> None:
        self.timeout = timeout.total_seconds()
        self.describe, self.pending, self.peer_failed = describe, pending, peer_failed
        self.on_hang, self.on_warning, self.poll = on_hang, on_warning, poll
        self.publish = publish
        self._lock = threading.Lock()
        self._armed = False
        self._depth = 0                      # nested enters (a step inside train_step)
        self._until: Callable[[], bool] | None = None   # after the last leave: armed until true
        self._store_ok = True
        self._last = time.monotonic()
        self._left = -1                      # pending ops at the last check
        self.thread: int | None = None       # the thread that entered the step (its stack)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hybridpar-watchdog",
                                        daemon=True)
        self._thread.start()

    def enter(self) -> None:
        """A step (or a part of one: entries nest) starts."""
        with self._lock:
            if self._depth == 0:
                self._armed, self._last, self._left = True, time.monotonic(), -1
                self._until = None
                self.thread = threading.get_ident()
            self._depth += 1

    def beat(self) -> None:
        """The host completed an action."""
        self._last = time.monotonic()

    def leave(self, *, until: Callable[[], bool] | None = None) -> None:
        """The host's part ended (or failed on this rank: it reports by itself). The last
        leave disarms, or with `until` keeps watching until ``until()`` is true (the device's
        part done)."""
        with self._lock:
            self._depth = max(0, self._depth - 1)
            if self._depth == 0:
                self._armed = until is not None
                self._until = until
                self._last = time.monotonic()

    @property
    def armed(self) -> bool:
        """Whether a step is being watched."""
        return self._armed

    @property
    def host_done(self) -> bool:
        """Armed after the last `leave`: the host left the step, the device has not."""
        return self._armed and self._depth == 0

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        self._thread.join(timeout=self.poll + 1)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            report: str | None = None
            try:
                with self._lock:
                    if not self._armed:
                        continue
                    if self._depth == 0 and self._until is not None and self._until():
                        self._armed, self._until = False, None   # the device finished
                        continue
                    report, own = self._check()
                    if report is not None:
                        self._armed = False
                if report is not None and own:
                    self.publish(report)
            except Exception as e:   # a bug here must not leave the rank unwatched silently
                self.on_warning(f"hybridpar watchdog: {type(e).__name__}: {e}")
                if report is None:
                    continue
            if report is not None:
                self.on_hang(report)

    def _peer(self) -> str | None:
        """`peer_failed()`, or None once it failed (reported once: the store is gone)."""
        if not self._store_ok:
            return None
        try:
            return self.peer_failed()
        except Exception as e:
            self._store_ok = False
            self.on_warning(
                f"hybridpar watchdog: the rendezvous store is unreachable ({type(e).__name__}: "
                f"{e}); a peer's failure can no longer be seen from here, a stuck step still "
                f"is (timeout {self.timeout:.0f} s). If the rank hosting the store (rank 0, "
                "or the launcher's agent) died, its error is the first one")
            return None

    def _check(self) -> tuple[str | None, bool]:
        """(a report or None, whether it is this rank's own hang)."""
        failed = self._peer()
        if failed is not None:
            return failed, False
        left = len(self.pending())
        now = time.monotonic()
        if 0 <= left < self._left:       # the device completed operations: progress
            self._last = now
        self._left = left
        stuck = now - self._last
        return (self.describe(stuck) if stuck > self.timeout else None), True


def inside(thread: int | None, modules: Mapping[int, str]) -> tuple[str | None, str | None]:
    """Where `thread` is now, read from its Python stack (no cost to the watched thread):
    the name `modules` gives (``{id(module): name}``) of the innermost of those modules whose
    code runs, and the ``torch.distributed`` function it is blocked in, if any (a collective
    inside the layer). ``(None, None)`` when neither shows (a kernel on the device, C++
    autograd with no module of ours in Python)."""
    frame = sys._current_frames().get(thread) if thread is not None else None
    collective: str | None = None
    while frame is not None:
        code = frame.f_code
        if collective is None and "torch/distributed/" in code.co_filename.replace("\\", "/"):
            collective = code.co_name    # the innermost: the collective, not its wrappers
        owner = frame.f_locals.get("self") if "self" in code.co_varnames else None
        if owner is not None and id(owner) in modules:
            return modules[id(owner)], collective
        frame = frame.f_back
    return None, collective
