"""Point-to-point messages between stages, matched by order alone (as NCCL matches them).

A message is a Tensor or a tuple of Tensors. Both ends derive the sequence of messages
between every pair of ranks from the schedule, so the k-th send from a to b meets the k-th
receive on b from a; no tag carries meaning (`Wire(tags=False)`, the default, puts every op
on tag 0; ``tags=True`` gives each channel its own tag, a debugging aid that gloo honours
and NCCL ignores).

What a message looks like is agreed once per step signature (`hybridpar.comm.p2p_spec`: the
spec, the 1 KiB header sent on a new signature, the `SpecBook`); a peer that failed sends an
abort dummy in its place (`hybridpar.comm.p2p_abort`). This module re-exports both, so
``comm.X`` names every part of the P2P path.

Groups of operations are queued on a `Wire` and issued as one `batch_isend_irecv` each
(`Wire.issue`; `early=True` posts receives ahead of their group, on gloo only). Within one
group a sender puts every header of the group before any payload, and the receiver posts
the headers first, waits for them, then posts the payloads as a second group: the two ends
see the same order.

With a tp group of n > 1 and a replicated (untagged) floating tensor, each tp rank sends only
its 1/n of the flattened tensor and the receivers all-gather it (Megatron's scatter-gather).

Every transfer is counted (`comm_stats`, kinds ``p2p_send``, ``p2p_recv``, ``p2p_header``;
the all-gather counts itself) and, while `hybridpar.trace` records, timed. `Wire.log`, when
set to a list, records every group as issued (`replay.P2POp`s) for the NCCL replay.

One rank's tensors to a whole group (the balance, the last stage's output, state dicts) go by
`hybridpar.comm.broadcast.broadcast_tensors`.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar import trace
from hybridpar.comm.p2p_abort import (
    MAGIC,
    WAKE_TAG,
    PeerFailed,
    abort_dummy,
    header_dummy,
    interrupt,
    publish_abort,
    publish_hang,
    read_abort,
    read_hang,
    read_pipeline_abort,
    starts_with_magic,
)
from hybridpar.comm.p2p_spec import (
    DTYPES,
    HEADER_LEN,
    NCCL_DTYPES,
    MessageSpec,
    NCCLDtypeError,
    SpecBook,
    TensorSpec,
    check_nccl_dtypes,
    decode,
    header,
    signature_hash,
    spec_of,
)
from hybridpar.pipeline.schedules.replay import P2POp
from hybridpar.sharded.attrs import register_parallel_dim
from hybridpar.sharded.mappings import (
    all_gather_along,
    group_rank,
    group_size,
    shard_range,
)

__all__ = [
    "DTYPES",
    "HEADER_LEN",
    "MAGIC",
    "NCCL_DTYPES",
    "WAKE_TAG",
    "CommStats",
    "Incoming",
    "MessageSpec",
    "NCCLDtypeError",
    "Op",
    "PeerFailed",
    "SpecBook",
    "TensorSpec",
    "Wire",
    "abort_dummy",
    "check_nccl_dtypes",
    "comm_stats",
    "delivering_headers",
    "header",
    "header_dummy",
    "interrupt",
    "payloads",
    "publish_abort",
    "publish_hang",
    "read_abort",
    "read_hang",
    "read_pipeline_abort",
    "record",
    "reset_comm_stats",
    "send_message",
    "signature_hash",
    "spec_of",
    "wait",
]

CommStats = trace.CommStats
comm_stats = trace.comm_stats
reset_comm_stats = trace.reset_comm_stats
record = trace.count  # count one call of a kind moving some bytes


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


# issuing groups -------------------------------------------------------------------------
@dataclass
class Op:
    """One queued isend / irecv: `message` names its message, `index` the tensor in it (-1:
    its header)."""

    send: bool
    tensor: Tensor
    peer: int
    channel: int
    message: str
    index: int

    @property
    def header(self) -> bool:
        return self.index < 0

    @property
    def label(self) -> str:
        """``"the activation of micro-batch 3 [0]"`` (made only when logged or reported)."""
        return f"{self.message} header" if self.index < 0 else f"{self.message} [{self.index}]"


@dataclass
class Wire:
    """How this rank issues P2P: tags, the log for the NCCL replay, groups of operations."""

    tags: bool = False
    coalesce: bool = False   # NCCL: one batch_isend_irecv a group; gloo: the ops one by one
    log: list[list[P2POp]] | None = None
    pending: list[Op] = field(default_factory=list)
    early: dict[int, list[P2POp]] = field(default_factory=dict)   # slot -> ops posted early

    def add(self, send: bool, tensor: Tensor, peer: int, channel: int, message: str,
            index: int) -> int:
        """Queue one op for the next `issue` (`index` -1: a header); returns its position."""
        self.pending.append(Op(send, tensor, peer, channel, message, index))
        return len(self.pending) - 1

    def issue(self, *, early: bool = False, slot: int = -1, hold_payloads: bool = False
              ) -> list[tuple[Op, list[dist.Work]]]:
        """Issue the queued ops as one `batch_isend_irecv`; each op with the works to wait on,
        in the order they were queued.

        gloo returns one work per op; NCCL coalesces a group into one work, which then
        stands for every op of the group. `slot` names the group (the executor's action
        index; -1: the next one). `early`: receives of the group of `slot` posted ahead of
        it (gloo only); the log keeps them in that group, as NCCL would see it. `hold_payloads`:
        the payloads sent after a header stay queued (no works yet) for the next `issue`,
        which the receiver's payloads also go in once it read the headers (a slot as two
        groups on both ends: what NCCL needs when activations go round a cycle of ranks,
        `plan_lowering.lower_plan_rank`).
        """
        queued, self.pending = self.pending, []
        if hold_payloads and any(op.header for op in queued):   # a step of new shapes
            headed = {(op.peer, op.message) for op in queued if op.send and op.header}
            held = [op.send and not op.header and (op.peer, op.message) in headed
                    for op in queued]
            if any(held):
                self.pending = [op for op, h in zip(queued, held) if h]
                now = self._issue_ops([op for op, h in zip(queued, held) if not h], early,
                                      slot)
                works = iter(now)
                return [(op, []) if h else next(works) for op, h in zip(queued, held)]
        return self._issue_ops(queued, early, slot)

    def _issue_ops(self, queued: list[Op], early: bool, slot: int
                   ) -> list[tuple[Op, list[dist.Work]]]:
        order = None                          # the steady state: the ops as queued
        if any(op.header for op in queued):   # a step of new shapes: headers go first
            order = sorted(range(len(queued)), key=lambda k: not queued[k].header)
        ops = queued if order is None else [queued[k] for k in order]
        if self.log is not None:
            logged = [P2POp("send" if op.send else "recv", op.peer, op.tensor.numel(),
                            str(op.tensor.dtype), op.label) for op in ops]
            if early:
                self.early.setdefault(slot, []).extend(logged)
            else:
                ahead = self.early.pop(slot, [])
                if logged or ahead:
                    self.log.append(logged + ahead)
        if not ops:
            return []
        works: list[Any]
        if self.coalesce:
            works = dist.batch_isend_irecv([
                dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, op.peer,
                           tag=op.channel if self.tags else 0) for op in ops])
        else:   # gloo does not coalesce: batch_isend_irecv would post these same ops in turn
            works = [(dist.isend if op.send else dist.irecv)(
                op.tensor, op.peer, tag=op.channel if self.tags else 0) for op in ops]
        per_op = [[w] for w in works] if len(works) == len(ops) else [list(works)] * len(ops)
        if order is None:
            return list(zip(queued, per_op))
        result: list[list[dist.Work]] = [[] for _ in queued]
        for position, k in enumerate(order):
            result[k] = per_op[position]
        return list(zip(queued, result))


def _local_slice(flat: Tensor, tp_group: ProcessGroup | None) -> Tensor:
    start, stop = shard_range(flat.numel(), group_size(tp_group), group_rank(tp_group))
    return flat[start:stop]


def payloads(tensors: Sequence[Tensor | None], spec: MessageSpec,
             tp_group: ProcessGroup | None) -> list[Tensor | None]:
    """What travels of each tensor: itself, its 1/tp slice when scattered, None if absent."""
    out: list[Tensor | None] = []
    for t, s in zip(tensors, spec.tensors):
        if t is None:
            out.append(None)
            continue
        payload = t.detach().contiguous()
        if s.scattered:
            payload = _local_slice(payload.view(-1), tp_group).contiguous()
        out.append(payload)
    return out


def send_message(wire: Wire, tensors: Sequence[Tensor | None], spec: MessageSpec, dst: int,
                 channel: int, label: str, *, tp_group: ProcessGroup | None,
                 header: Tensor | None = None) -> list[Tensor | None]:
    """Queue a message's sends (its header first when given); returns what it sends."""
    sent = payloads(tensors, spec, tp_group)
    if header is not None:
        wire.add(True, header, dst, channel, label, -1)
        record("p2p_header", _nbytes(header))
    for k, payload in enumerate(sent):
        if payload is None:   # absent: both ends know it from the spec, nothing travels
            continue
        wire.add(True, payload, dst, channel, label, k)
        record("p2p_send", _nbytes(payload))
    return sent


class Incoming:
    """A message being received from global rank `src`: its header (on a new signature) or
    payloads are queued on the wire; `finish` returns its tensors once they arrived."""

    def __init__(self, wire: Wire, src: int, channel: int, label: str, *,
                 spec: MessageSpec | None, tp_group: ProcessGroup | None,
                 device: torch.device, step: int, microbatch: int, stage: int = -1,
                 at: int = -1) -> None:
        self.wire, self.src, self.channel, self.label = wire, src, channel, label
        self.microbatch, self.stage = microbatch, stage   # stage: the sender's (-1: unsaid)
        self.at = at                                      # the receiving stage (-1: unsaid)
        self.step = step   # the key of the peer's abort, if it sends one
        self.spec, self.tp_group, self.device = spec, tp_group, device
        self.header: Tensor | None = None
        self.header_works: list[dist.Work] = []
        self.buffers: list[tuple[TensorSpec, Tensor, Tensor]] = []
        self.slots: list[int] = []
        self.works: list[list[dist.Work]] = []
        if spec is None:
            self.header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
            self.header_slot = wire.add(False, self.header, src, channel, label, -1)
            record("p2p_header", _nbytes(self.header))
        else:
            self._queue_payloads()

    def _queue_payloads(self) -> None:
        assert self.spec is not None
        for k, s in enumerate(self.spec.tensors):
            if s.absent:
                continue
            full = torch.empty(s.shape, dtype=s.dtype, device=self.device)
            target = _local_slice(full.view(-1), self.tp_group) if s.scattered else full
            buf = torch.empty_like(target) if s.scattered else target
            self.buffers.append((s, full, buf))
            self.slots.append(self.wire.add(False, buf, self.src, self.channel, self.label, k))
            record("p2p_recv", _nbytes(buf))

    @property
    def single(self) -> bool:
        """The message is one Tensor (not a tuple of them)."""
        return self.spec is not None and self.spec.single

    def issued(self, group: list[tuple[Op, list[dist.Work]]]) -> None:
        """Take this message's works from the group just issued."""
        if self.header is not None and not self.header_works:
            self.header_works = group[self.header_slot][1]
        else:
            self.works = [group[slot][1] for slot in self.slots]

    def learn(self, timeout: datetime.timedelta | None, expected_signature: int
              ) -> MessageSpec:
        """Wait for the header, then queue the payload receives it describes."""
        assert self.header is not None
        for work in self.header_works:
            wait(work, timeout)
        self._check_abort(self.header)
        spec, signature = decode(self.header if _delivery is None else _delivery(self))
        if signature != expected_signature:
            raise ValueError(
                f"rank {self.src} sent {self.label} for a step of different shapes than this "
                "rank's; every rank must call train_step / eval_step / forward with input and "
                "target of the same shapes and dtypes")
        self.spec = spec
        self._queue_payloads()
        return spec

    def _check_abort(self, buf: Tensor) -> None:
        """Raise `PeerFailed` when `buf` is the abort dummy of a peer that failed."""
        if buf.device.type == "cpu" and starts_with_magic(buf):
            failed = read_abort(self.step, self.src)
            if failed is not None:
                raise failed

    def finish(self, timeout: datetime.timedelta | None) -> tuple[Tensor | None, ...]:
        """Wait for the payloads; return the tensors (full size, tags, requires_grad; None
        where the spec says absent)."""
        with trace.span("recv", peer=self.src, channel=self.channel) as span:
            out: list[Tensor | None] = []
            for works, (s, full, buf) in zip(self.works, self.buffers):
                with trace.span("wait", peer=self.src, channel=self.channel):
                    for work in works:
                        wait(work, timeout)
                self._check_abort(buf)
                span.add_bytes(_nbytes(buf))
                if s.scattered:  # every tp rank got its slice: re-assemble the whole
                    whole = all_gather_along(buf, 0, self.tp_group, length=full.numel())
                    full.view(-1).copy_(whole)
                if s.tag is not None:
                    register_parallel_dim(full, s.tag)
                if s.requires_grad:
                    full.requires_grad_()
                out.append(full)
            assert self.spec is not None
            for k, s in enumerate(self.spec.tensors):   # absent tensors: None in their place
                if s.absent:
                    out.insert(k, None)
            return tuple(out)


_delivery: Callable[[Incoming], Tensor] | None = None


@contextlib.contextmanager
def delivering_headers(deliver: Callable[[Incoming], Tensor]) -> Iterator[None]:
    """Meanwhile a received header is read as `deliver(message)` returns it (a CPU header).

    For `hybridpar check`, whose fake receives deliver no data: the header travels (sizes,
    order, device, the wait for it), and what it says comes from the dry run's shape pass.
    """
    global _delivery
    saved, _delivery = _delivery, deliver
    try:
        yield
    finally:
        _delivery = saved


def wait(work: dist.Work | None, timeout: datetime.timedelta | None) -> None:
    """Wait for `work` (a bounded wait when `timeout` is given: gloo only)."""
    if work is None:
        return
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)
