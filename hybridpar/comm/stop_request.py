"""A stop asked for by a signal (SIGTERM, SIGINT) on any rank, agreed by every rank at the
same step boundary.

A launcher that is told to stop (a scheduler's preemption, Ctrl-C, ``kill``) signals every
worker, but not at the same instant: one rank may see its signal after step s, its peer
after step s + 1, and a rank that left the loop alone would leave the others waiting in the
next step's collectives. So a signal only sets a flag; at the end of every step the ranks
all-reduce the flags (MAX, one int over the world group, on the CPU where the group has gloo:
no GPU sync), and all stop after the first step where any rank had one:

    rank 0   step 5 | SIGTERM | step 6 end: agree -> 15 | save, exit
    rank 1   step 5 |         | step 6 end: agree -> 15 | save, exit   (its SIGTERM comes later)
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from hybridpar.comm.agreement import agreement_device

__all__ = ["STOP_SIGNALS", "StopRequest", "stop_on_signals"]

#: the signals that ask a run to stop at the next step boundary
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """The signal this rank received (0: none) and the agreement on it across ranks."""

    def __init__(self) -> None:
        self.received = 0

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signum   # a second signal does not undo the first

    def agreed(self, group: ProcessGroup | None = None) -> str | None:
        """The name of the signal any rank of `group` received (every rank gets the same
        answer), or None. A collective: every rank calls it after the same step."""
        if not dist.is_initialized():
            return signal.Signals(self.received).name if self.received else None
        flag = torch.tensor([self.received], dtype=torch.int64,
                            device=agreement_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        signum = int(flag.item())
        return signal.Signals(signum).name if signum else None


@contextmanager
def stop_on_signals(enabled: bool = True) -> Iterator[StopRequest]:
    """Within the block, SIGTERM and SIGINT set the request's flag instead of ending the
    process (the previous handlers come back after it). Without `enabled`, or off the main
    thread (where Python cannot install handlers), the request stays empty and the signals
    keep their handlers."""
    request = StopRequest()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.signal(s, request._note) for s in STOP_SIGNALS}
    try:
        yield request
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
