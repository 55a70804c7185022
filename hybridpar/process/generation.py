"""Process-group generations: a failed step ends one, `hybridpar.init` starts the next (gloo).

A step that fails leaves the process groups unusable: a wait broken to stop a stage closes
every gloo pair of its group (torch binds no `Work.abort`; `comm.interrupt` breaks a wait as
gloo's own timeout does), and a message a failed peer never took may still be queued. So:

    event                                   state                 what a pipe call does
    a step fails (`mark_broken`)            this generation       raises `GroupsBroken` at
                                            broken                once: how to recover
    hybridpar.init(...) on every rank       gloo: next            a new HybridPipe (on the
    (`renew`)                               generation            new topology) trains
                                            NCCL: stays broken    raises: restart the
                                                                  processes

The next generation is a new default process group over the same store, under a prefix of
its number (``hybridpar/generation/<n>/``: the keys of the broken one, aborts included, stay
behind), and new dp / pp / tp groups. Every rank of the job must call `hybridpar.init` again:
after a failure they all raised (the failing rank its own error, the others `PipelineError`).
On NCCL the communicators of a failed collective cannot be trusted again in-process (torch
tears the process down on a timeout with async error handling on), so the way back there is
a restart: ``hybridpar run --max-restarts N`` resumes from the last checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["GroupsBroken", "check_usable", "current", "kept", "mark_broken", "renew"]


class GroupsBroken(RuntimeError):
    """A pipe call on process groups that a failed step left unusable."""


_generation = 0                 # this process's generation of process groups
_broken: str | None = None      # why the current generation is unusable (None: it is not)


def current() -> int:
    """The current generation (0 until a failure was recovered from)."""
    return _generation


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """The generation and its state as they were before the block (`hybridpar check` runs
    fake ranks, whose failed steps break no real group, in this process)."""
    global _generation, _broken
    before = _generation, _broken
    try:
        yield
    finally:
        _generation, _broken = before


def mark_broken(reason: str) -> None:
    """The current generation's groups are unusable: a step failed (`reason`: its error). A
    process alone in its world has no peer: nothing of it breaks."""
    global _broken
    if _broken is None and dist.is_initialized() and dist.get_world_size() > 1:
        _broken = reason


def check_usable(generation: int, what: str) -> None:
    """Raise `GroupsBroken` if `generation` (a pipe's) is not the current, usable one."""
    if generation == _generation and _broken is None:
        return
    why = _broken if generation == _generation else \
        f"it was built on generation {generation} of the process groups, now {_generation}"
    nccl = dist.is_initialized() and "nccl" in str(dist.get_backend())
    how = ("restart the processes (hybridpar run --max-restarts N resumes from the last "
           "checkpoint): NCCL's communicators cannot be rebuilt in-process" if nccl else
           "call hybridpar.init(...) again on every rank (it rebuilds the process groups) and "
           "build a new HybridPipe, or restart the processes (hybridpar run --max-restarts N)")
    raise GroupsBroken(f"{what} cannot run: the process groups are unusable after a failed "
                       f"step ({why}); {how}")


def renew(timeout: datetime.timedelta) -> bool:
    """If the current generation is broken, start the next one (gloo); True if it did.

    Collective: every rank of the job calls it (through `hybridpar.init`); the ranks that
    came raise `GroupsBroken` naming those that did not within `timeout`. On NCCL it raises
    `GroupsBroken` with how to restart.
    """
    global _generation, _broken
    if _broken is None or not dist.is_initialized():
        return False
    backend = str(dist.get_backend())
    if "nccl" in backend:
        check_usable(_generation, "hybridpar.init")
    base = dist.distributed_c10d._get_default_store()
    while isinstance(base, dist.PrefixStore):   # torch's "default_pg/", a generation's prefix
        base = base.underlying_store
    rank, world = dist.get_rank(), dist.get_world_size()
    _arrive(base, _generation + 1, rank, world, timeout)
    dist.destroy_process_group()
    _generation += 1
    _broken = None
    dist.init_process_group(backend, store=dist.PrefixStore(
        f"hybridpar/generation/{_generation}", base), rank=rank, world_size=world,
        timeout=timeout)
    return True


def _arrive(store: dist.Store, generation: int, rank: int, world: int,
            timeout: datetime.timedelta) -> None:
    """Note this rank's arrival at `generation`, then wait up to `timeout` for every rank's;
    `GroupsBroken` naming the ranks that did not come (else torch's own barrier in
    `init_process_group` ends in a bare ``DistStoreError: wait timeout`` naming store keys)."""
    keys = [f"hybridpar/arrived/{generation}/{r}" for r in range(world)]
    store.set(keys[rank], "1")
    try:
        store.wait(keys, timeout)
        return
    except RuntimeError:   # DistStoreError: a timeout (or the store went away)
        pass
    try:
        absent = [r for r, key in enumerate(keys) if not store.check([key])]
    except RuntimeError:   # the store itself is gone: its host (rank 0, the agent) ended
        absent = []
    if not absent:
        raise GroupsBroken(
            f"hybridpar.init on rank {rank} could not rebuild the process groups: the "
            "rendezvous store stopped answering while it waited for the other ranks (the "
            "process hosting it, rank 0 or the launcher's agent, ended?); restart the "
            "processes (hybridpar run --max-restarts N resumes from the last checkpoint)")
    raise GroupsBroken(
        f"hybridpar.init on rank {rank} waited {timeout} for every rank to rebuild the "
        f"process groups after the failed step; rank(s) {absent} of {world} did not call "
        "hybridpar.init again. Every rank raised the step's error: each must catch it and "
        "call hybridpar.init(...) again (then build a new HybridPipe), or let it end the "
        "process so that the job restarts (hybridpar run --max-restarts N resumes from the "
        "last checkpoint)")
