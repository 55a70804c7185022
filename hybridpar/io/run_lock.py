"""A run directory held by one run at a time: an flock on RUN_DIR/.lock that names its holder.

    RUN_DIR/.lock     {"pid": 4242, "host": "node7", "since": "2026-11-28T06:30:01Z", ...}
                      while a run holds it; empty once that run released it

The lock is the kernel's (``fcntl.flock`` on the open file): it goes with the process that
holds it, however that process ends, kill -9 included, so a dead run never blocks the next
one. What the file says is only the record of who holds it: a record left in a file nobody
holds names a run that ended without releasing it (killed), which the next holder reports
and replaces. The file is never removed (removing a lock file lets two runs each lock a file
of their own under the same name), only emptied.

Readers (`hybridpar check`, `hybridpar export`, a resumed run's own checkpoint loading) take
no lock: every file a run writes is complete where it can be seen (renamed into place).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["LOCK_NAME", "RunDirInUse", "hold_run_dir", "holder"]

LOCK_NAME = ".lock"

log = logging.getLogger(__name__)


class RunDirInUse(OSError):
    """Another run holds the run directory; the message names its pid and host."""


def _record() -> dict[str, Any]:
    since = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": since,
            "command": " ".join(sys.argv)[:500]}


def _read(fd: int) -> dict[str, Any] | None:
    """The record in the lock file: None when empty, {} when unreadable (half-written)."""
    data = os.pread(fd, 1 << 16, 0)
    if not data.strip():
        return None
    try:
        record = json.loads(data)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def _describe(record: dict[str, Any] | None) -> str:
    if not record or "pid" not in record:
        return "a run that is starting (its pid is not recorded yet)"
    text = f"pid {record['pid']} on host {record.get('host', '?')}"
    if record.get("since"):
        text += f", since {record['since']}"
    return text


def holder(run_dir: str | os.PathLike[str], *, name: str = LOCK_NAME
           ) -> dict[str, Any] | None:
    """The record of the run holding `run_dir` (pid, host, since, command; {} when not yet
    written); None when no run holds it (no lock file, or a lock file nobody holds)."""
    path = Path(run_dir) / name
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read(fd) or {}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def hold_run_dir(run_dir: str | os.PathLike[str], *, name: str = LOCK_NAME,
                 wait: float = 1.0) -> Iterator[None]:
    """Hold `run_dir` (created if needed) while inside; raises `RunDirInUse` naming the holder
    when another run holds it. Nothing in the folder is written before the lock is taken.

    `name`: the lock file in `run_dir`. `wait`: how long to wait for a holder that has locked
    but not yet written its record, so the error can name it.
    """
    folder = Path(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise OSError(e.errno, f"cannot open the run directory's lock {path}: "
                      f"{os.strerror(e.errno or errno.EIO)}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            record = _read(fd)
            deadline = time.monotonic() + wait
            while not (record and "pid" in record) and time.monotonic() < deadline:
                time.sleep(0.05)      # locked a moment ago: its record comes next
                record = _read(fd)
            raise RunDirInUse(
                f"the run directory {folder} is in use by another run "
                f"({_describe(record)}): wait for it to end or stop it, or give another "
                "--run-dir") from None
        previous = _read(fd)
        if previous is not None:
            # Held by nobody, yet not emptied: that run ended without releasing it.
            log.warning("the run directory %s was held by %s, which ended without releasing "
                        "it (killed?); taking it over", folder, _describe(previous))
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_record()) + "\n").encode(), 0)
        os.fsync(fd)
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)   # released: the next holder has nothing to report
    finally:
        os.close(fd)                  # the kernel's lock goes with the last close
