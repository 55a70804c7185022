"""Point-to-point messages between stages, matched by order alone (as NCCL matches them).

A message is a Tensor or a tuple of Tensors. Both ends derive the sequence of messages
between every pair of ranks from the schedule, so the k-th send from a to b meets the k-th
receive on b from a; no tag carries meaning (`Wire(tags=False)`, the default, puts every op
on tag 0; ``tags=True`` gives each channel its own tag, a debugging aid that gloo honours
and NCCL ignores).

What a message looks like (`MessageSpec`: per tensor dtype, shape, parallel-dim tag,
requires_grad, and whether it travels as a 1/tp slice) is agreed once per *signature* of a
step (train or not, the shapes and dtypes of its micro-batches) and kept in a `SpecBook`:

    step            forward-direction message (FWD, SKIP)     backward-direction (BWD, SKIPG)
    new signature   a 1 KiB int64 header, then the payloads   payloads alone: the spec is
                    (the receiver learns the spec)            the forward message's, floating
    known           payloads alone (the sender checks that    tensors only, no grad
                    its tensors still fit the spec)

Groups of operations are queued on a `Wire` and issued as one `batch_isend_irecv` each
(`Wire.issue`; `early=True` posts receives ahead of their group, on gloo only). Within one
group a sender puts every header of the group before any payload, and the receiver posts
the headers first, waits for them, then posts the payloads as a second group: the two ends
see the same order.

With a tp group of n > 1 and a replicated (untagged) floating tensor, each tp rank sends only
its 1/n of the flattened tensor and the receivers all-gather it (Megatron's scatter-gather).

Aborts need no header either. A rank that fails publishes its error in the process group's
store under ``hybridpar/abort/<step>/<rank>``, then sends each peer it still owes a message
a dummy of exactly the size that peer expects, whose first bytes are `MAGIC`. A receiver
that finds `MAGIC` at the start of a payload reads the store: an entry means `PeerFailed`,
none means the payload was real data. The receiver checks the first byte only: a peer that
does not know the size the receiver expects (it failed before learning it) sends one byte,
which gloo delivers into a larger receive. This check is a CPU read, done on gloo; on NCCL it
would synchronise the host, so there the receiver relies on the process group's timeout.
A rank whose own action failed also stores its error under its pipeline's key
(``hybridpar/abort/<step>/pipeline-<id>``), which the peers it owes nothing find from a
thread (`pipeline.listener`); `interrupt` breaks their waits on gloo.

Every transfer is counted (`comm_stats`, kinds ``p2p_send``, ``p2p_recv``, ``p2p_header``;
the all-gather counts itself) and, while `hybridpar.trace` records, timed. `Wire.log`, when
set to a list, records every group as issued (`replay.P2POp`s) for the NCCL replay.

One rank's tensors to a whole group (the balance, the last stage's output, state dicts) go by
`hybridpar.broadcast.broadcast_tensors`.
"""

from __future__ import annotations

import ctypes
import datetime
import math
import zlib
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar import trace
from hybridpar.pipeline.replay import P2POp
from hybridpar.tensor_parallel.attrs import get_parallel_dim, register_parallel_dim
from hybridpar.tensor_parallel.mappings import (
    all_gather_along,
    group_rank,
    group_size,
    shard_range,
)

__all__ = [
    "DTYPES",
    "HEADER_LEN",
    "MAGIC",
    "WAKE_TAG",
    "CommStats",
    "Incoming",
    "MessageSpec",
    "Op",
    "PeerFailed",
    "SpecBook",
    "TensorSpec",
    "Wire",
    "abort_dummy",
    "comm_stats",
    "header",
    "header_dummy",
    "interrupt",
    "payloads",
    "publish_abort",
    "read_abort",
    "read_pipeline_abort",
    "record",
    "reset_comm_stats",
    "send_message",
    "signature_hash",
    "spec_of",
    "wait",
]

HEADER_LEN = 128
_MAX_NDIM = 8
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_NO_TAG = 9
MAGIC = bytes.fromhex("f47fadbadea1ed5e")  # the first bytes of an abort dummy (a NaN in f64)
WAKE_TAG = (1 << 13) + 1   # gloo only: the receive `interrupt` times out (nothing is sent on it)

CommStats = trace.CommStats
comm_stats = trace.comm_stats
reset_comm_stats = trace.reset_comm_stats
record = trace.count  # count one call of a kind moving some bytes


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


# what a message looks like --------------------------------------------------------------
class TensorSpec(NamedTuple):
    """One tensor of a message: what the receiver allocates and how it travels."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    tag: int | None          # parallel-dim tag (None: replicated)
    requires_grad: bool      # the receiver makes it a leaf that requires grad
    scattered: bool          # travels as this tp rank's 1/tp slice of the flattened tensor
    absent: bool = False     # None (a skip stashed as None): nothing travels, None arrives


class MessageSpec(NamedTuple):
    """A message: its tensors, and whether it is one bare Tensor rather than a tuple."""

    tensors: tuple[TensorSpec, ...]
    single: bool

    def grads(self) -> MessageSpec:
        """The message that carries this one's gradients back: its floating tensors."""
        return MessageSpec(tuple(t._replace(requires_grad=False) for t in self.tensors
                                 if t.dtype.is_floating_point), False)


ABSENT = TensorSpec(torch.uint8, (), None, False, False, True)   # a None in a message


def _scatters(t: Tensor, tp: int) -> bool:
    """Whether `t` travels as 1/tp slices: replicated, floating and at least tp elements."""
    return tp > 1 and get_parallel_dim(t) is None and t.is_floating_point() and t.numel() >= tp


def spec_of(tensors: Sequence[Tensor | None], tp: int, *, grads: bool, single: bool
            ) -> MessageSpec:
    """The spec of a message of `tensors` (`grads`: floating ones will require grad; None:
    an absent tensor, as torchgpipe allows for skips)."""
    specs = []
    for t in tensors:
        if t is None:
            specs.append(ABSENT)
            continue
        if t.dtype not in DTYPES:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype} between stages; stage "
                            f"outputs must have one of {', '.join(str(d) for d in DTYPES)} "
                            "(for complex tensors: torch.view_as_real)")
        if t.dim() > _MAX_NDIM:
            raise ValueError(f"cannot send a {t.dim()}-d tensor between stages "
                             f"(at most {_MAX_NDIM} dims)")
        specs.append(TensorSpec(t.dtype, tuple(t.shape), get_parallel_dim(t),
                                grads and t.is_floating_point(), _scatters(t, tp)))
    return MessageSpec(tuple(specs), single)


def _encode(spec: MessageSpec, signature: int) -> list[int]:
    """Header slots: [signature, count, single, (dtype, tag, grad, how, ndim, *shape)...], how
    = 0 whole, 1 scattered, 2 absent."""
    values = [signature, len(spec.tensors), int(spec.single)]
    for t in spec.tensors:
        how = 2 if t.absent else int(t.scattered)
        values += [DTYPES.index(t.dtype), _NO_TAG if t.tag is None else t.tag,
                   int(t.requires_grad), how, len(t.shape), *t.shape]
    return values


def header(spec: MessageSpec, signature: int, device: torch.device) -> Tensor:
    """The 1 KiB int64 header that describes `spec` (sent on a new signature only)."""
    values = _encode(spec, signature)
    if len(values) > HEADER_LEN:
        raise ValueError(f"a stage boundary of {len(spec.tensors)} tensors does not fit the "
                         f"{HEADER_LEN}-slot header; pass fewer tensors between stages")
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64,
                        device=device)


def _decode(header: Tensor) -> tuple[MessageSpec, int]:
    """The spec a header describes, and the signature of the sender's step."""
    values = header.tolist()   # a host read: headers travel only on a new signature
    signature, count, single = values[:3]
    specs, pos = [], 3
    for _ in range(count):
        dtype, tag, grad, how, ndim = values[pos:pos + 5]
        shape = tuple(values[pos + 5:pos + 5 + ndim])
        pos += 5 + ndim
        specs.append(TensorSpec(DTYPES[dtype], shape, None if tag == _NO_TAG else tag,
                                bool(grad), how == 1, how == 2))
    return MessageSpec(tuple(specs), bool(single)), signature


def signature_hash(signature: Hashable) -> int:
    """A hash of a step signature that is the same in every process (no PYTHONHASHSEED)."""
    return zlib.crc32(repr(signature).encode())


class SpecBook:
    """The agreed specs of each step signature seen lately: {(channel, peer, mb): spec}.

    Both ends of every channel see the same signatures in the same order and commit a step's
    specs only when it completes, so their books agree. The `capacity` most recently used
    signatures are kept (a run whose shapes change every step negotiates every step).
    """

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._book: OrderedDict[Hashable, dict[tuple[int, int, int], MessageSpec]] = \
            OrderedDict()

    def get(self, signature: Hashable) -> dict[tuple[int, int, int], MessageSpec] | None:
        specs = self._book.get(signature)
        if specs is not None:
            self._book.move_to_end(signature)
        return specs

    def commit(self, signature: Hashable, specs: dict[tuple[int, int, int], MessageSpec]
               ) -> None:
        self._book[signature] = specs
        self._book.move_to_end(signature)
        while len(self._book) > self.capacity:
            self._book.popitem(last=False)

    def clear(self) -> None:
        self._book.clear()


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
    early: list[P2POp] = field(default_factory=list)   # posted early, logged with the next

    def add(self, send: bool, tensor: Tensor, peer: int, channel: int, message: str,
            index: int) -> int:
        """Queue one op for the next `issue` (`index` -1: a header); returns its position."""
        self.pending.append(Op(send, tensor, peer, channel, message, index))
        return len(self.pending) - 1

    def issue(self, *, early: bool = False) -> list[tuple[Op, list[dist.Work]]]:
        """Issue the queued ops as one `batch_isend_irecv`; each op with the works to wait on,
        in the order they were queued.

        gloo returns one work per op; NCCL coalesces a group into one work, which then
        stands for every op of the group. `early`: receives of the next group posted ahead
        of it (gloo only); the log keeps them in the group they belong to.
        """
        queued, self.pending = self.pending, []
        order = None                          # the steady state: the ops as queued
        if any(op.header for op in queued):   # a step of new shapes: headers go first
            order = sorted(range(len(queued)), key=lambda k: not queued[k].header)
        ops = queued if order is None else [queued[k] for k in order]
        if self.log is not None:
            logged = [P2POp("send" if op.send else "recv", op.peer, op.tensor.numel(),
                            str(op.tensor.dtype), op.label) for op in ops]
            if early:
                self.early += logged
            elif logged or self.early:
                self.log.append(logged + self.early)
        if not early:
            self.early = []
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
                 device: torch.device, step: int, microbatch: int) -> None:
        self.wire, self.src, self.channel, self.label = wire, src, channel, label
        self.microbatch = microbatch
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
        spec, signature = _decode(self.header)
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
        if buf.device.type == "cpu" and _starts_with_magic(buf):
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


def wait(work: dist.Work | None, timeout: datetime.timedelta | None) -> None:
    """Wait for `work` (a bounded wait when `timeout` is given: gloo only)."""
    if work is None:
        return
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


# aborts ---------------------------------------------------------------------------------
class PeerFailed(RuntimeError):
    """A peer sent an abort instead of the message: rank `origin_rank` failed first."""

    def __init__(self, src: int, origin_rank: int, origin_stage: int, message: str) -> None:
        super().__init__(message)
        self.src, self.origin_rank, self.origin_stage = src, origin_rank, origin_stage
        self.message = message


def _starts_with_magic(t: Tensor) -> bool:
    # one byte: an abort of unknown size is a 1-byte dummy (gloo takes a short message into
    # a larger receive); real data that starts so costs one store lookup
    return _nbytes(t) > 0 and ctypes.string_at(t.data_ptr(), 1) == MAGIC[:1]


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
        wait(dist.irecv(torch.zeros(1), peer, group=group, tag=WAKE_TAG),
             datetime.timedelta(milliseconds=1))
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
