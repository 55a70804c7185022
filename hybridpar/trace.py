"""Instrumentation of one process: a timeline recorder (off by default) and traffic counters.

Two independent tools, both leaves that import nothing else of hybridpar:

- **Counters**, always on: bytes and calls per operation kind since the last reset
  (`comm_stats`, `reset_comm_stats`; also exported as ``hybridpar.comm_stats``):

      kind            bytes counted                                        calls
      p2p_send        payload sent (the 1/tp slice under scatter-gather)   one per tensor
      p2p_recv        payload received (the same slice)                    one per tensor
      p2p_header      the 1 KiB shape header (a step of new shapes only)   one per message
      all_reduce      the tensor reduced                                   one per collective
      all_gather      the gathered result (full, unpadded)                 one per collective
      reduce_scatter  the whole tensor before the scatter                  one per collective
      reduce          the tensor reduced to one rank (zero 2's gradients)  one per collective
      broadcast       the tensor broadcast                                 one per collective

  Counted where they happen: `comm` (P2P), `sharded.mappings` and `.loss` (tp
  collectives, the vocab-parallel loss's all-reduces of b·s scalars included),
  `pipeline.parameters.reduce` (dp buckets), `pipeline.parameters.tied` (tied gradients),
  `pipeline.runtime.loss` (the
  loss: a broadcast on NCCL, point to point on gloo, counted as one broadcast per rank) and
  `pipeline.parameters.clip` (grad-norm all-reduces). hybridpar issues no object collective.

- **Timeline**, while a `Recorder` records: spans with wall-clock ends (``time.time_ns``, so
  ranks of one host share a clock; on a GPU, CUDA events anchored to that clock:
  `DeviceClock`), each tagged with the stage and micro-batch the executor is at
  (`Recorder.stage`, `Recorder.microbatch`):

      kind        span of                                       nested in
      step        one schedule run on this rank                 -
      forward     a stage's forward of micro-batch i (+ loss)   step
      backward    its autograd backward (I, under a split one)  step
      weight      the deferred weight gradients (W)             step
      recompute   the forward again, for a checkpointed i       step
      send        posting a message to `peer` on `channel`      step
      recv        taking a message: waiting, payload, gather    step
      wait        blocked on a peer: header, payload; sends     recv, step
      collective  one collective `op` (all_reduce, ...)         forward, backward, recv, -

  Each `HybridPipe`'s executor owns a `Recorder` (`pipe.recorder`); `Recorder.recording`
  makes it the *active* one for the block, and `span` / `collective` (called from layers,
  `comm` and the reductions, which know no pipe) record into the active recorder. The
  active slot is process-wide rather than a context variable because backward may run on
  autograd's device threads; it is set only inside `recording`. Not recording, `span`
  costs one global read and returns a shared no-op context (~0.2 us).
  `HybridPipe(trace=True)` records its steps; `HybridPipe.write_trace` (in
  `hybridpar.pipeline.tracing.trace_report`) turns the events of all ranks into files.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from hybridpar.device import cuda

__all__ = ["COLUMNS", "KINDS", "OPS", "CommStats", "DeviceClock", "Recorder", "Span", "active",
           "collective", "comm_stats", "count", "reset_comm_stats", "span"]

# counters ------------------------------------------------------------------------------------


@dataclass
class CommStats:
    """Bytes and calls per operation kind since the last reset."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {kind: {"bytes": self.bytes[kind], "calls": self.calls[kind]}
                for kind in sorted(self.calls)}


_STATS = CommStats()


def count(kind: str, nbytes: int) -> None:
    """Count one call of `kind` moving `nbytes` bytes."""
    _STATS.bytes[kind] += nbytes
    _STATS.calls[kind] += 1


def comm_stats() -> dict[str, dict[str, int]]:
    """``{kind: {"bytes": ..., "calls": ...}}`` counted on this rank since the last reset."""
    return _STATS.snapshot()


def reset_comm_stats() -> None:
    """Zero the counters of `comm_stats`."""
    _STATS.bytes.clear()
    _STATS.calls.clear()


# timeline ------------------------------------------------------------------------------------

KINDS = ("step", "forward", "backward", "recompute", "send", "recv", "wait", "collective",
         "weight")
OPS = ("", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "other", "reduce")
# One event is one row of int64s, so that rank 0 can gather them as a tensor:
COLUMNS = ("kind", "op", "stage", "microbatch", "peer", "channel", "nbytes", "start", "end")
_KIND_ID = {k: i for i, k in enumerate(KINDS)}
_OP_ID = {k: i for i, k in enumerate(OPS)}


class Span:
    """A context manager timing one event; this base is the no-op one used while not recording."""

    __slots__ = ()

    def __enter__(self) -> Span:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def add_bytes(self, nbytes: int) -> None:
        """Bytes learned inside the span (a receive knows its size after the header)."""


class _Timed(Span):
    """One open span; appended to the recorder's events when it closes."""

    __slots__ = ("channel", "kind", "nbytes", "op", "peer", "recorder", "start")

    def __init__(self, recorder: Recorder, kind: int, op: int, peer: int, channel: int,
                 nbytes: int) -> None:
        self.recorder, self.kind, self.op = recorder, kind, op
        self.peer, self.channel, self.nbytes = peer, channel, nbytes
        self.start = 0

    def __enter__(self) -> _Timed:
        self.start = self.recorder.now()
        return self

    def __exit__(self, *exc: object) -> None:
        r = self.recorder
        r.events.append((self.kind, self.op, r.stage, r.microbatch, self.peer, self.channel,
                         self.nbytes, self.start, r.now()))

    def add_bytes(self, nbytes: int) -> None:
        self.nbytes += nbytes


_NULL = Span()


class DeviceClock:
    """Span ends as CUDA events, turned into wall-clock ns when the recording ends.

    On a GPU the host runs ahead of the kernels it launches, so `time.time_ns` around a
    forward measures the launch. Each end is an event on the current stream instead; `now`
    returns a placeholder (-1 - index) and `resolve` maps it to the anchor's wall clock plus
    the GPU time elapsed since the anchor event (one synchronize, at the end of the step).
    `event` makes the events (CUDA's, ``hybridpar.device.cuda().event(timing=True)``, by
    default).
    """

    def __init__(self, event: Callable[[], Any] | None = None) -> None:
        self.event = event or (lambda: cuda().event(timing=True))
        self.anchor = self.event()
        self.anchor.record()
        self.anchor_ns = time.time_ns()
        self.marks: list[Any] = []

    def now(self) -> int:
        mark = self.event()
        mark.record()
        self.marks.append(mark)
        return -len(self.marks)

    def resolve(self, t: int) -> int:
        if t >= 0:
            return t
        self.marks[-1].synchronize()
        return self.anchor_ns + round(self.anchor.elapsed_time(self.marks[-1 - t]) * 1e6)


class Recorder:
    """The timeline of this process: rows of `COLUMNS`, recorded while `enabled`."""

    def __init__(self) -> None:
        self.enabled = False
        self.stage = -1                    # where the executor is: every span is tagged
        self.microbatch = -1               # with these (-1: none)
        self.events: list[tuple[int, ...]] = []
        self.meta: dict[str, Any] = {}
        self.clock: DeviceClock | None = None   # None: the host clock

    def now(self) -> int:
        """A span end: wall-clock ns, or a CUDA-event placeholder resolved at the end."""
        return time.time_ns() if self.clock is None else self.clock.now()

    def span(self, kind: str, *, op: str = "", peer: int = -1, channel: int = -1,
             nbytes: int = 0) -> Span:
        """A context manager timing one `kind` of `KINDS` (a no-op while disabled)."""
        if not self.enabled:
            return _NULL
        return _Timed(self, _KIND_ID[kind], _OP_ID.get(op, _OP_ID["other"]), peer, channel,
                     nbytes)

    @contextmanager
    def recording(self, *, clock: DeviceClock | None = None, **meta: Any) -> Iterator[None]:
        """Forget the previous events, record those inside; `meta` describes the run.

        `clock`: time spans with CUDA events (`DeviceClock`), resolved when the block ends.
        """
        global _ACTIVE
        outer, _ACTIVE = _ACTIVE, self   # nested recordings: the inner one is active
        self.events, self.meta = [], dict(meta)
        self.enabled, self.clock = True, clock
        try:
            yield
        finally:
            _ACTIVE = outer
            self.enabled = False
            self.microbatch = -1
            if clock is not None:
                self.events = [(*e[:7], clock.resolve(e[7]), clock.resolve(e[8]))
                               for e in self.events]
            self.clock = None


_ACTIVE: Recorder | None = None   # the recorder inside its `recording` block, if any


def active() -> Recorder | None:
    """The recorder recording now (inside its `Recorder.recording`), or None."""
    return _ACTIVE


def span(kind: str, *, op: str = "", peer: int = -1, channel: int = -1,
         nbytes: int = 0) -> Span:
    """Time one `kind` of `KINDS` into the active recorder (a no-op when none records)."""
    recorder = _ACTIVE
    if recorder is None:
        return _NULL
    return recorder.span(kind, op=op, peer=peer, channel=channel, nbytes=nbytes)


def collective(op: str, nbytes: int) -> Span:
    """Count one collective `op` of `nbytes` bytes, and time it while recording."""
    count(op, nbytes)
    recorder = _ACTIVE
    if recorder is None:
        return _NULL
    return recorder.span("collective", op=op, nbytes=nbytes)
