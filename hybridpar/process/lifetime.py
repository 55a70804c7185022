"""A process that ends with its parent or another process it names; a pid told by start time."""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from pathlib import Path

__all__ = ["die_with_parent", "end_with", "is_running", "start_time"]

_PR_SET_PDEATHSIG = 1   # <linux/prctl.h>


def start_time(pid: int | str) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat), or None if gone
    (or no /proc). A pid and its start time name one process: a pid taken again later by
    another process comes with another start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]   # field 22, counted after the command's name


def is_running(pid: int, started: str) -> bool:
    """Whether the process `pid` that started at `started` (`start_time`) still runs."""
    return start_time(pid) == started


def die_with_parent(parent: int) -> bool:
    """End this process with SIGKILL when its parent ends, even by SIGKILL; False where the
    platform has no parent-death signal (not Linux), True once armed.

    `parent` is the pid this process was started by, read before the call (``os.getppid()``
    in the parent's code, or at the child's start): a parent that ended before the signal was
    armed sends none, so the child then ends here at once instead of living on as an orphan.
    The signal is the kernel's: it comes whatever killed the parent, with no thread or pipe
    to watch. It is cleared in the children of this process (they arm their own).
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            return False
    except (OSError, AttributeError):   # no libc, or a libc without prctl
        return False
    if os.getppid() != parent:          # it ended before the prctl: reparented already
        os._exit(1)
    return True


def end_with(pid: int, started: str | None) -> None:
    """End this process (SIGKILL) as soon as process `pid`, started at `started`
    (`start_time`; None: not checked), ends, whoever its parent is; at once if it has ended.

    A thread waits on a pidfd of `pid` (Linux 5.3+; elsewhere it looks every 0.2 s), so the
    end is seen within milliseconds, with no signal to arm in `pid`'s other children and
    nothing asked of `pid`. Where no start time can be read (no /proc), nothing is done.
    """
    if started is None or start_time("self") is None:
        return
    fd: int | None
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(1)
    except (AttributeError, OSError):   # no pidfd here: look at /proc instead
        fd = None
    if start_time(pid) != started:      # ended already, and its pid may be another's now
        os._exit(1)
    threading.Thread(target=_die_when_ended, args=(fd, pid, started), daemon=True,
                     name=f"hybridpar-end-with-{pid}").start()


def _die_when_ended(fd: int | None, pid: int, started: str) -> None:
    if fd is not None:
        select.select([fd], [], [])     # readable once the process has ended
    else:
        while is_running(pid, started):
            time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)
