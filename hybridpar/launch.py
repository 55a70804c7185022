"""spawn(fn, nprocs): run a function on N local ranks with the torchrun variables set.

For tests, notebooks and examples. Each child gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1`` and a free ``MASTER_PORT``, so `fn` can call
`hybridpar.init`. The parent returns the children's return values in rank order, re-raises the
first child exception with its rank and traceback, and kills every child when one fails or
when the timeout passes (a hang fails the call instead of blocking it).

Rank 0 hosts the job's store (`hybridpar.init` with a loopback ``MASTER_ADDR``), where a rank
that fails publishes its abort for its peers to read. So a child whose function has returned
or raised keeps its process, its process group and so the store, until the parent has every
rank's result (or gives up: a failure, a dead child, the timeout) and says so through an
event; a child waits for it no longer than `timeout`. Without that, rank 0 failing at once
took the store down before its peers read why (they failed on the store instead).
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import random
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["SpawnError", "SpawnTimeout", "free_port", "preload", "preloaded", "spawn"]

# Children are forked from a server that has already imported torch: starting one costs
# milliseconds instead of the seconds its imports take (torch; torch._dynamo, which the
# optimizers import, about 3 s of CPU on 2 cores; DCP and the trainer), and the server never
# ran an OpenMP region, so forking it is safe.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.checkpoint",
            "hybridpar", "hybridpar.train.trainer"]


def preload(*modules: str) -> None:
    """Have `spawn`'s forkserver import `modules` too, before it starts (e.g. a model family
    every rank imports): each rank then finds them imported. No effect once it runs."""
    _PRELOAD.extend(name for name in modules if name not in _PRELOAD)


def preloaded() -> list[str]:
    """The modules `spawn`'s forkserver imports before forking (`hybridpar run`'s too)."""
    return list(_PRELOAD)


class SpawnError(RuntimeError):
    """A child rank raised; the message holds its rank and traceback."""

    def __init__(self, rank: int, trace: str) -> None:
        super().__init__(f"rank {rank} failed:\n{trace}")
        self.rank = rank
        self.trace = trace


class SpawnTimeout(TimeoutError):
    """The children did not all finish before the timeout."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, below the kernel's ephemeral range.

    A port from ``bind(0)`` comes from the ephemeral range, where the kernel also picks the
    source port of every outgoing connection (gloo opens many): between this call and the
    store's bind another process may take it. A random free port below the range is taken
    only by someone who asks for it by number; the draw does not touch `random`'s state.
    """
    low = _ephemeral_low()
    draw = random.Random(os.urandom(8))
    for _ in range(64 if low > 11000 else 0):
        port = draw.randrange(10000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _encode(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _decode(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _child(fn: Callable[..., Any], args: Sequence[Any], rank: int, env: dict[str, str],
           threads: int, results: Any, done: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    os.environ.update(env)
    torch.set_num_threads(threads)
    try:
        value = fn(*args)
        results.put((rank, True, _encode(value)))
    except BaseException:  # every failure, even SystemExit, must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        from hybridpar.topology import shutdown

        try:
            # Keep the process group, and rank 0 the store its peers may still read (an
            # abort this rank published), until the parent has heard from every rank.
            done.wait(max(deadline - time.monotonic(), 0.0))
        except BaseException:  # the child is exiting anyway
            pass
        try:
            shutdown()   # forget the topology, destroy the process group
        except Exception:  # the child is exiting anyway
            pass


def spawn(fn: Callable[..., Any], nprocs: int, *, args: Sequence[Any] = (),
          backend: str = "gloo", timeout: float = 120.0, threads: int = 1,
          env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on `nprocs` ranks; returns their return values in rank order.

    `fn` must be importable by name (defined at module level). Return values travel through
    `torch.save` and must load with ``weights_only=True`` (tensors, numbers, strings, lists,
    dicts). `threads` is ``torch.set_num_threads`` of each child. `env` adds variables.
    Raises `SpawnError` for the first child that raised, `SpawnTimeout` after `timeout`
    seconds. A child that is done waits (keeping rank 0's store up for its peers) until all
    have reported or the call fails, then ends.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    results = ctx.Queue()
    done = ctx.Event()   # set by the parent: every rank reported, or the call fails
    port = free_port()
    base = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "HYBRIDPAR_BACKEND": backend,
        "OMP_NUM_THREADS": str(threads),
        **(env or {}),
    }
    procs = []
    for rank in range(nprocs):
        child_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        p = ctx.Process(target=_child, name=f"hybridpar-rank{rank}", daemon=True,
                        args=(fn, tuple(args), rank, child_env, threads, results, done, timeout))
        p.start()
        procs.append(p)

    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < nprocs:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(nprocs)) - set(values))
                raise SpawnTimeout(
                    f"ranks {missing} of {nprocs} did not finish within {timeout:g} s "
                    f"(a hang: a rank waits for a peer that never sends or never joins)"
                )
            try:
                rank, ok, payload = results.get(timeout=min(left, 0.5))
            except queue.Empty:
                for rank, p in enumerate(procs):
                    if rank not in values and not p.is_alive() and p.exitcode not in (0, None):
                        # It died without reporting (killed, segfault): a last look at the queue.
                        try:
                            rank2, ok2, payload2 = results.get(timeout=0.5)
                        except queue.Empty:
                            raise SpawnError(rank, f"exited with code {p.exitcode} "
                                                   "without a Python traceback") from None
                        if not ok2:
                            raise SpawnError(rank2, payload2) from None
                        values[rank2] = _decode(payload2)
                continue
            if not ok:
                raise SpawnError(rank, payload)
            values[rank] = _decode(payload)
    finally:
        done.set()   # the children may shut down and end now
        for p in procs:
            p.join(timeout=5 if len(values) == nprocs else 0.1)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
    return [values[r] for r in range(nprocs)]
