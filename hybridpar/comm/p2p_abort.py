"""Aborts between stages: a failed rank's error in the store, dummies in place of messages.

Aborts need no header. A rank that fails publishes its error in the process group's store
under ``hybridpar/abort/<step>/<rank>``, then sends each peer it still owes a message a dummy
of exactly the size that peer expects, whose first bytes are `MAGIC`. A receiver that finds
`MAGIC` at the start of a payload reads the store: an entry means `PeerFailed`, none means
the payload was real data. The receiver checks the first byte only: a peer that does not
know the size the receiver expects (it failed before learning it) sends one byte, which gloo
delivers into a larger receive. This check is a CPU read, done on gloo; on NCCL it would
synchronise the host, so there the receiver relies on the process group's timeout.
A rank whose own action failed also stores its error under its pipeline's key
(``hybridpar/abort/<step>/pipeline-<id>``), which the peers it owes nothing find from a
thread (`pipeline.failures.listener`); `interrupt` breaks their waits on gloo. A watchdog that
reports a hang stores it under ``hybridpar/hang``, one key every rank's watchdog reads, so the
ranks it cannot reach through the pipeline (dp and tp peers) stop with its report too.
"""

from __future__ import annotations

import ctypes
import datetime
import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar.comm.p2p_spec import HEADER_LEN, TensorSpec
from hybridpar.sharded.mappings import group_rank, group_size, shard_range

__all__ = [
    "MAGIC",
    "WAKE_TAG",
    "PeerFailed",
    "abort_dummy",
    "header_dummy",
    "interrupt",
    "publish_abort",
    "publish_hang",
    "read_abort",
    "read_hang",
    "read_pipeline_abort",
    "starts_with_magic",
]

MAGIC = bytes.fromhex("f47fadbadea1ed5e")  # the first bytes of an abort dummy (a NaN in f64)
WAKE_TAG = (1 << 13) + 1   # gloo only: the receive `interrupt` times out (nothing is sent on it)


class PeerFailed(RuntimeError):
    """A peer sent an abort instead of the message: rank `origin_rank` failed first."""

    def __init__(self, src: int, origin_rank: int, origin_stage: int, message: str) -> None:
        super().__init__(message)
        self.src, self.origin_rank, self.origin_stage = src, origin_rank, origin_stage
        self.message = message


def starts_with_magic(t: Tensor) -> bool:
    """Whether `t` may be an abort dummy: its first byte is `MAGIC`'s."""
    # one byte: an abort of unknown size is a 1-byte dummy (gloo takes a short message into
    # a larger receive); real data that starts so costs one store lookup
    return t.numel() > 0 and ctypes.string_at(t.data_ptr(), 1) == MAGIC[:1]


def _abort_key(step: int, rank: int | str) -> str:
    return f"hybridpar/abort/{step}/{rank}"


def publish_abort(step: int, *, origin_rank: int, origin_stage: int, message: str,
                  pipeline: str | None = None) -> None:
    """Store this rank's abort of `step` (before sending any dummy): the origin and text;
    with `pipeline`, under that pipeline's key too, where its peers' listeners look."""
    store = dist.distributed_c10d._get_default_store()
    value = f"{origin_rank}\n{origin_stage}\n{message}"
    store.set(_abort_key(step, dist.get_rank()), value)
    if pipeline is not None:
        store.set(_abort_key(step, f"pipeline-{pipeline}"), f"{dist.get_rank()}\n{value}")


def read_abort(step: int, src: int) -> PeerFailed | None:
    """The abort `src` published for `step`, or None when it did not abort."""
    store = dist.distributed_c10d._get_default_store()
    key = _abort_key(step, src)
    if not store.check([key]):
        return None
    rank, stage, text = store.get(key).decode(errors="replace").split("\n", 2)
    return PeerFailed(src, int(rank), int(stage), text)


def publish_hang(report: str) -> None:
    """Store this rank's hang report where every rank's watchdog looks (the first one wins)."""
    store = dist.distributed_c10d._get_default_store()
    store.compare_set(_HANG_KEY, "", f"{dist.get_rank()}\n{report}")


def read_hang() -> PeerFailed | None:
    """The hang a rank's watchdog published, or None (one store read when none did)."""
    store = dist.distributed_c10d._get_default_store()
    if not store.check([_HANG_KEY]):
        return None
    src, _, report = store.get(_HANG_KEY).decode(errors="replace").partition("\n")
    return PeerFailed(int(src), int(src), -1, report.splitlines()[0] if report else "")


_HANG_KEY = "hybridpar/hang"


def read_pipeline_abort(step: int, pipeline: str) -> PeerFailed | None:
    """The failure a rank of `pipeline` published for `step` (one store read when none did;
    `PeerFailed.src` is the rank that published it)."""
    store = dist.distributed_c10d._get_default_store()
    key = _abort_key(step, f"pipeline-{pipeline}")
    if not store.check([key]):
        return None
    src, rank, stage, text = store.get(key).decode(errors="replace").split("\n", 3)
    return PeerFailed(int(src), int(rank), int(stage), text)


def interrupt(group: ProcessGroup | None, peer: int) -> None:
    """Make every wait of this rank on `group` (None: the default group) fail now, gloo only.

    A receive from `peer` (a global rank of `group`) on `WAKE_TAG`, which nothing sends,
    waited for 1 ms: gloo answers a timed-out wait by closing every pair of the group's
    context, so the blocked waits raise ("Application timeout caused pair closure"), and so
    does every later operation of the group. torch 2.13 binds no `Work.abort` in Python.
    """
    try:
        work = dist.irecv(torch.zeros(1), peer, group=group, tag=WAKE_TAG)
        if work is not None:   # None: this rank is not in `group`
            work.wait(datetime.timedelta(milliseconds=1))
    except RuntimeError:   # the timeout that breaks the waits
        pass


def abort_dummy(spec: TensorSpec | None, tp_group: ProcessGroup | None,
                device: torch.device) -> Tensor:
    """A tensor the size of what travels for `spec`, starting with `MAGIC` (None: the size
    is unknown, one byte that gloo delivers into any receive)."""
    if spec is None:
        return torch.tensor(list(MAGIC[:1]), dtype=torch.uint8, device=device)
    numel = math.prod(spec.shape)
    if spec.scattered:
        start, stop = shard_range(numel, group_size(tp_group), group_rank(tp_group))
        numel = stop - start
    dummy = torch.zeros(numel, dtype=spec.dtype)
    raw = dummy.view(torch.uint8)
    n = min(len(MAGIC), raw.numel())
    raw[:n] = torch.frombuffer(bytearray(MAGIC[:n]), dtype=torch.uint8)
    return dummy.to(device)


def header_dummy(device: torch.device) -> Tensor:
    """An abort in place of a header."""
    return abort_dummy(TensorSpec(torch.int64, (HEADER_LEN,), None, False, False), None,
                       device)
