"""The listener: a peer's published failure stops the stage (`stopped`), and breaks its waits
`wake_after` seconds later, once, only while a step runs. (Across processes:
tests/test_torchgpipe_bugs.py::test_exception_no_hang, tests/test_pipe_errors.py.)"""

from __future__ import annotations

import time

from hybridpar.comm import p2p as comm
from hybridpar.pipeline.failures.listener import Listener

BOOM = comm.PeerFailed(2, 2, 2, "stage 2 (rank 2) failed at F(0) of forward: boom")


def _until(condition, timeout=2.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_a_peer_failure_stops_the_step_and_wakes_its_waits_once_after_the_delay():
    published: dict[int, comm.PeerFailed] = {}
    woken: list[tuple[float, list[object]]] = []
    listener = Listener(published.get, lambda failed, groups: woken.append(
        (time.monotonic(), list(groups))), poll=0.01, wake_after=0.2)
    group = object()
    listener.enter(3, group)    # type: ignore[arg-type]   # a collective after step 3
    time.sleep(0.1)
    assert listener.stopped is None and woken == []
    published[3] = BOOM
    seen = time.monotonic()
    assert _until(lambda: listener.stopped is BOOM)
    stopped = time.monotonic()
    assert woken == [] or woken[0][0] - seen >= 0.2     # stopped at once, woken later
    assert _until(lambda: woken != [])
    time.sleep(0.1)
    listener.leave()
    listener.close()
    assert len(woken) == 1 and woken[0][1] == [None, group]   # the default group and its own
    assert stopped - seen < 0.2 <= woken[0][0] - seen


def test_nothing_is_read_or_woken_between_steps_or_for_another_step():
    reads: list[int] = []
    woken: list[object] = []

    def check(step: int) -> comm.PeerFailed | None:
        reads.append(step)
        return BOOM if step == 1 else None

    listener = Listener(check, lambda failed, groups: woken.append(failed), poll=0.01,
                        wake_after=0.0)
    time.sleep(0.1)
    assert reads == []                    # asleep until a step enters
    listener.enter(0)
    time.sleep(0.1)
    listener.leave()
    count = len(reads)
    time.sleep(0.1)
    assert count > 0 and len(reads) <= count + 1 and set(reads) == {0}
    assert listener.stopped is None and woken == []
    listener.enter(1)
    assert _until(lambda: woken != [])
    listener.leave()
    listener.close()
    assert listener.stopped is BOOM and woken == [BOOM]


def test_an_off_listener_runs_no_thread_and_never_stops():
    listener = Listener()
    listener.enter(0)
    listener.leave()
    listener.close()
    assert not listener.on and listener.stopped is None


def _closed_pipe():
    import threading

    import torch
    from torch import nn

    import hybridpar

    topo = hybridpar.init(pp=2, timeout=30)
    pipe = hybridpar.HybridPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1],
                                chunks=2, topology=topo, loss_fn=lambda o, y: o.pow(2).mean())
    x = torch.randn(4, 4)
    pipe.train_step(x, x)
    listening = any(t.name == "hybridpar-listener" for t in threading.enumerate())
    pipe.close()
    left = any(t.name == "hybridpar-listener" and t.is_alive() for t in threading.enumerate())
    return [listening, left, pipe.train_step(x, x).item() > 0]


def test_closing_a_pipe_stops_its_listener_and_steps_still_run():
    """The trainer closes its pipe before the process group goes: a listener thread inside a
    store read while the interpreter exits aborts the process."""
    import hybridpar

    for listening, left, trained in hybridpar.spawn(_closed_pipe, 2, timeout=60):
        assert listening and not left and trained
