"""A pytest plugin: each test's wall time and CPU, its ranks included, one line per test.

    PYTHONPATH=scripts CPU_PER_TEST=cpu.tsv PYTEST_ADDOPTS="-p cpu_per_test" make test

writes ``node id <TAB> wall s <TAB> CPU s`` for every test to cpu.tsv (each xdist worker
appends its own). A test's CPU is its worker's own and its waited children's (`getrusage`)
plus the CPU of the worker's live child processes with what they reaped (/proc: utime,
stime, cutime, cstime): the forkserver that `hybridpar.spawn` forks every rank from is such
a child, so the ranks count. Used to find the suite's costliest tests (tests/tiers.py).
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Generator
from typing import Any

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    """Seconds of CPU of this process's live children and of what they reaped."""
    me, total = os.getpid(), 0.0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:                                   # its parent
            total += sum(int(x) for x in fields[11:15]) / _TICK    # utime .. cstime
    return total


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime + _children_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: Any) -> Generator[None, None, None]:
    start, cpu = time.monotonic(), _cpu()
    yield
    out = os.environ.get("CPU_PER_TEST")
    if out:
        with open(out, "a") as f:
            f.write(f"{item.nodeid}\t{time.monotonic() - start:.2f}\t{_cpu() - cpu:.2f}\n")
