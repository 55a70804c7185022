"""Point-to-point transfer of tensors with shape headers, and counters of bytes and calls.

A message is a Tensor or a tuple of Tensors. It travels as a fixed-size int64 header (count,
and per tensor: dtype, parallel-dim tag, requires_grad, scattered, ndim, shape) on one tag,
then the payloads on another, so a header posted early never meets a payload:

    tag = channel * 2 + 0     headers, in message order
    tag = channel * 2 + 1     payloads, in message order

The payload receives are posted early when the header can be predicted: both ends keep a
`History` of the headers of the last step of the same kind, by position on each channel. A
receive whose position had a message last time posts the payload receives of that header
together with the header's own, so the payload moves as soon as it is sent instead of a round
trip after the header arrived (gloo moves a payload only once its receive is posted). The
sender predicts the same header and says in the header's last slot what it did:

    route            when                           payloads on tag
    0 unpredicted    no message here last step      channel * 2 + 1
    1 predicted      the header equals last step's  channel * 2 + 1 (into the early receives)
    2 mispredicted   the header changed             channel * 2 + 1: empty dummies of the
                                                    predicted sizes; FALLBACK + channel: the
                                                    payloads, received once the header came

A rank that fails sends an *abort* header instead of the messages its peers still wait for:
count -1, the rank and stage that failed first, and the first ~1000 bytes of its error as
UTF-8. The receiver raises `PeerFailed` at once instead of waiting out the timeout.

    slot   0      1            2             3        4 ...
    abort  -1     origin rank  origin stage  n bytes  the message, 8 bytes per slot

With a tp group of n > 1 and a replicated (untagged) tensor, each tp rank sends only its
1/n of the flattened tensor and the receivers all-gather it (Megatron's scatter-gather): the
boundary costs n times fewer P2P bytes, for an all-gather inside the tp group.

Every transfer is counted (`comm_stats`, kinds ``p2p_send``, ``p2p_recv``, ``p2p_header``; the
all-gather counts itself) and, while `hybridpar.trace` records, timed: `send` is one span,
`PostedRecv.wait` a ``recv`` span around two ``wait`` spans (blocked until the header came,
then until the payloads came).

`broadcast_tensors` sends tensors from one rank to a group the same way, without pickles (an
int64 header of dtypes and shapes, then one flat payload per dtype); the source may broadcast
an exception instead, which is raised on every rank.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar import trace
from hybridpar.tensor_parallel.attrs import get_parallel_dim, register_parallel_dim
from hybridpar.tensor_parallel.mappings import (
    all_gather_along,
    group_rank,
    group_size,
    shard_range,
)

__all__ = [
    "FALLBACK",
    "HEADER_LEN",
    "CommStats",
    "History",
    "PeerFailed",
    "PostedRecv",
    "broadcast_tensors",
    "comm_stats",
    "post_recv",
    "record",
    "reset_comm_stats",
    "send",
    "send_abort",
]

HEADER_LEN = 128
_MAX_NDIM = 8
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_NO_TAG = 9
_ABORT = -1
_ABORT_TEXT = (HEADER_LEN - 4) * 8   # message bytes an abort header carries
_ROUTE = HEADER_LEN - 1              # header slot: how the payloads travel (table above)
_UNPREDICTED, _PREDICTED, _MISPREDICTED = 0, 1, 2
FALLBACK = 1 << 12                   # tag of the payloads of a mispredicted header (+ channel)


class History:
    """The headers of the last step of each kind, by position on each channel: predictions.

    Each stage executor owns one; both ends of a channel see the same messages in the same
    order, so the sender's and the receiver's predictions agree as long as every step either
    completes or is followed by `clear` (a failed step: its messages are not all exchanged).
    """

    def __init__(self) -> None:
        self._kind = "step"
        # (kind, "send" | "recv", peer, channel) -> (headers of the last step, of this step)
        self._book: dict[tuple[str, str, int, int], tuple[list[Tensor], list[Tensor]]] = {}

    def new_step(self, kind: str) -> None:
        """Start a step of `kind` ("train_step", "forward", ...): the last one of that kind
        predicts its messages."""
        self._kind = kind
        for key, (_, this) in list(self._book.items()):
            if key[0] == kind and this:
                self._book[key] = (this, [])

    def clear(self) -> None:
        """Forget everything (after a failed step): the next messages are not predicted."""
        self._book.clear()

    def predict(self, direction: str, peer: int, channel: int) -> Tensor | None:
        """The header the next message on the channel had in the last step of this kind
        (None: that step had no message at this position)."""
        last, this = self._book.setdefault((self._kind, direction, peer, channel), ([], []))
        return last[len(this)] if len(this) < len(last) else None

    def record(self, direction: str, peer: int, channel: int, header: Tensor) -> None:
        """Remember `header` as this step's next message on the channel."""
        self._book[self._kind, direction, peer, channel][1].append(header)


CommStats = trace.CommStats
comm_stats = trace.comm_stats
reset_comm_stats = trace.reset_comm_stats
record = trace.count  # count one call of a kind moving some bytes


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _scatters(t: Tensor, tp: int) -> bool:
    """Whether `t` travels as 1/tp slices: replicated, floating and at least tp elements."""
    return tp > 1 and get_parallel_dim(t) is None and t.is_floating_point() and t.numel() >= tp


def _encode(tensors: tuple[Tensor, ...], tp: int, *, grads: bool, single: bool) -> list[int]:
    header = [len(tensors), int(single)]
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype} between stages; stage "
                            f"outputs must have one of {', '.join(str(d) for d in _DTYPES)} "
                            "(for complex tensors: torch.view_as_real)")
        if t.dim() > _MAX_NDIM:
            raise ValueError(f"cannot send a {t.dim()}-d tensor between stages "
                             f"(at most {_MAX_NDIM} dims)")
        tag = get_parallel_dim(t)
        header += [_DTYPES.index(t.dtype), _NO_TAG if tag is None else tag,
                   int(grads and t.is_floating_point()), int(_scatters(t, tp)), t.dim(),
                   *t.shape]
    if len(header) > _ROUTE:
        raise ValueError(f"a stage boundary of {len(tensors)} tensors does not fit the "
                         f"{HEADER_LEN}-slot header; pass fewer tensors between stages")
    header += [0] * (HEADER_LEN - len(header))
    return header


@dataclass
class _Meta:
    dtype: torch.dtype
    tag: int | None
    requires_grad: bool
    scattered: bool
    shape: tuple[int, ...]


def _decode(header: Tensor) -> list[_Meta]:
    values = header.tolist()
    metas, pos = [], 2
    for _ in range(values[0]):
        dtype, tag, grad, scattered, ndim = values[pos:pos + 5]
        shape = tuple(values[pos + 5:pos + 5 + ndim])
        pos += 5 + ndim
        metas.append(_Meta(_DTYPES[dtype], None if tag == _NO_TAG else tag, bool(grad),
                           bool(scattered), shape))
    return metas


def _local_slice(flat: Tensor, tp_group: ProcessGroup | None) -> Tensor:
    start, stop = shard_range(flat.numel(), group_size(tp_group), group_rank(tp_group))
    return flat[start:stop]


def send(tensors: tuple[Tensor, ...], dst: int, *, channel: int,
         tp_group: ProcessGroup | None = None, grads: bool = False,
         single: bool = False, history: History | None = None) -> list[dist.Work | None]:
    """Post the sends of a message to global rank `dst`; returns the works to wait on.

    `grads`: the receiver makes the floating tensors leaves that require grad (it will send
    their gradients back). `single`: the message is one bare Tensor, not a tuple.
    `history`: predict the header as the receiver does (the same `History` role on both ends).
    """
    tp = group_size(tp_group)
    values = _encode(tensors, tp, grads=grads, single=single)
    predicted = history.predict("send", dst, channel) if history is not None else None
    dummies: list[Tensor] = []
    if predicted is None:
        header = torch.tensor(values, dtype=torch.int64)
    elif predicted[:_ROUTE].tolist() == values[:_ROUTE]:
        # the usual case: the header sent last step, reused (no new tensor on the hot path)
        header = predicted if int(predicted[_ROUTE]) == _PREDICTED else torch.tensor(
            [*values[:_ROUTE], _PREDICTED], dtype=torch.int64)
    else:  # fill the receives posted early for the predicted header, then go around them
        header = torch.tensor([*values[:_ROUTE], _MISPREDICTED], dtype=torch.int64)
        dummies = [torch.empty_like(buf) for _, _, buf in _buffers(predicted, tp_group)]
    if history is not None:
        history.record("send", dst, channel, header)
    payloads = []
    for t in tensors:
        payload = t.detach().contiguous()
        if _scatters(t, tp):
            payload = _local_slice(payload.view(-1), tp_group).contiguous()
        payloads.append(payload)
    with trace.span("send", peer=dst, channel=channel,
                    nbytes=sum(_nbytes(p) for p in payloads)):
        works = [dist.isend(header, dst, tag=channel * 2)]
        record("p2p_header", _nbytes(header))
        for dummy in dummies:
            works.append(dist.isend(dummy, dst, tag=channel * 2 + 1))
            record("p2p_mispredicted", _nbytes(dummy))
        tag = FALLBACK + channel if dummies else channel * 2 + 1
        for payload in payloads:
            works.append(dist.isend(payload, dst, tag=tag))
            record("p2p_send", _nbytes(payload))
    return works


def _buffers(header: Tensor, tp_group: ProcessGroup | None
             ) -> list[tuple[_Meta, Tensor, Tensor]]:
    """(meta, full tensor, receive buffer) of each tensor a header describes."""
    out = []
    for meta in _decode(header):
        full = torch.empty(meta.shape, dtype=meta.dtype)
        target = _local_slice(full.view(-1), tp_group) if meta.scattered else full
        recv_buf = torch.empty_like(target) if meta.scattered else target
        out.append((meta, full, recv_buf))
    return out


class PostedRecv:
    """A message being received: the header is in flight; `wait` receives the payloads."""

    def __init__(self, src: int, channel: int, tp_group: ProcessGroup | None,
                 history: History | None = None) -> None:
        self.src, self.channel, self.tp_group = src, channel, tp_group
        self.header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self.work = dist.irecv(self.header, src, tag=channel * 2)
        self.single = False
        record("p2p_header", _nbytes(self.header))
        # a predicted header: its payload receives go out now, with the header's
        self.predicted = history.predict("recv", src, channel) if history is not None else None
        if history is not None:
            history.record("recv", src, channel, self.header)  # filled in when it arrives
        self.early = [] if self.predicted is None else _buffers(self.predicted, tp_group)
        self.early_works = [dist.irecv(buf, src, tag=channel * 2 + 1)
                            for _, _, buf in self.early]

    def wait(self, timeout: datetime.timedelta | None = None) -> tuple[Tensor, ...]:
        """Wait for the message and return its tensors (tags restored, full size)."""
        with trace.span("recv", peer=self.src, channel=self.channel) as span:
            return self._take(timeout, span)

    def _take(self, timeout: datetime.timedelta | None, span: trace.Span
              ) -> tuple[Tensor, ...]:
        with trace.span("wait", peer=self.src, channel=self.channel):
            _wait(self.work, timeout)
        if int(self.header[0]) == _ABORT:
            raise _decode_abort(self.src, self.header)
        self.single = bool(self.header[1])
        route = self._check_route()
        if route == _PREDICTED:  # the payloads are on their way into the early receives
            buffers, works = self.early, self.early_works
        else:
            with trace.span("wait", peer=self.src, channel=self.channel):
                for work in self.early_works:       # the dummies of a mispredicted header
                    _wait(work, timeout)
            tag = FALLBACK + self.channel if route == _MISPREDICTED else self.channel * 2 + 1
            buffers = _buffers(self.header, self.tp_group)
            works = [dist.irecv(buf, self.src, tag=tag) for _, _, buf in buffers]
        for _, _, recv_buf in buffers:
            record("p2p_recv", _nbytes(recv_buf))
            span.add_bytes(_nbytes(recv_buf))
        with trace.span("wait", peer=self.src, channel=self.channel):
            for work in works:  # gloo moves a payload once its receive is posted
                _wait(work, timeout)
        out = []
        for meta, full, recv_buf in buffers:
            if meta.scattered:  # every tp rank got its slice: re-assemble the whole
                whole = all_gather_along(recv_buf, 0, self.tp_group, length=full.numel())
                full.view(-1).copy_(whole)
            if meta.tag is not None:
                register_parallel_dim(full, meta.tag)
            if meta.requires_grad:
                full.requires_grad_()
            out.append(full)
        return tuple(out)

    def _check_route(self) -> int:
        """The header's route, after checking that both ends predicted the same header."""
        route = int(self.header[_ROUTE])
        agree = (route == _UNPREDICTED) == (self.predicted is None) and (
            route != _PREDICTED or self.predicted is None
            or torch.equal(self.header[:_ROUTE], self.predicted[:_ROUTE]))
        if not agree:
            raise RuntimeError(
                f"the P2P header predictions of this rank and rank {self.src} (channel "
                f"{self.channel}) disagree; this is a bug in hybridpar, please report it")
        return route


class PeerFailed(RuntimeError):
    """A peer sent an abort instead of the message: rank `origin_rank` failed first."""

    def __init__(self, src: int, origin_rank: int, origin_stage: int, message: str) -> None:
        super().__init__(message)
        self.src, self.origin_rank, self.origin_stage = src, origin_rank, origin_stage
        self.message = message


def send_abort(dst: int, *, channel: int, origin_rank: int, origin_stage: int,
               message: str) -> dist.Work | None:
    """Post an abort header to `dst` on `channel` (in place of the next message it waits for).

    Like any gloo send, it completes once `dst` receives it: wait on the returned work (with
    a timeout) before the process exits, or the message is lost.
    """
    data = message.encode()[:_ABORT_TEXT]
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:4] = torch.tensor([_ABORT, origin_rank, origin_stage, len(data)])
    padded = data + b"\0" * (-len(data) % 8)
    if padded:
        header[4:4 + len(padded) // 8] = torch.frombuffer(bytearray(padded), dtype=torch.int64)
    record("p2p_header", _nbytes(header))
    return dist.isend(header, dst, tag=channel * 2)


def _decode_abort(src: int, header: Tensor) -> PeerFailed:
    _, origin_rank, origin_stage, length = header[:4].tolist()
    text = header[4:].numpy().tobytes()[:length].decode(errors="ignore")
    return PeerFailed(src, origin_rank, origin_stage, text)


def post_recv(src: int, *, channel: int, tp_group: ProcessGroup | None = None,
              history: History | None = None) -> PostedRecv:
    """Post the receive of a message from global rank `src` on `channel` (`history`: post the
    payload receives of the predicted header now too)."""
    return PostedRecv(src, channel, tp_group, history)


def _wait(work: dist.Work | None, timeout: datetime.timedelta | None) -> None:
    if work is None:  # a send to this rank itself never happens between stages
        return
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


# broadcast ---------------------------------------------------------------------------------
_ERRORS: tuple[type[Exception], ...] = (RuntimeError, TypeError, ValueError)


def _broadcast(t: Tensor, src: int, group: ProcessGroup | None) -> None:
    with trace.collective("broadcast", _nbytes(t)):
        dist.broadcast(t, src, group=group)


def broadcast_tensors(tensors: Sequence[Tensor] | Exception | None, src: int, *,
                      group: ProcessGroup | None = None,
                      device: torch.device | str = "cpu") -> tuple[Tensor, ...]:
    """Broadcast `tensors` from global rank `src` to `group`; every rank returns them.

    No pickles: an int64 header travels first, then one flat payload per dtype:

        1. [n, kind]                  n: header length; kind 0: tensors follow, else src
                                      failed: n message bytes follow, kind names its type
        2. [count, (dtype, ndim, *shape) per tensor]
        3. the tensors of each dtype, flattened and concatenated, in order of first use

    On `src` pass the tensors (other ranks pass None), or an exception (a RuntimeError,
    TypeError or ValueError) to raise it on `src` and one of the same type with its message
    everywhere else. Tensors arrive on `device`.
    """
    me = dist.get_rank()
    if me == src:
        if isinstance(tensors, Exception):
            error: Exception | None = tensors
        else:
            assert tensors is not None, "the source rank must pass the tensors"
            try:
                header = _broadcast_header(tensors)
                error = None
            except (TypeError, ValueError) as e:
                error = e
        if error is not None:
            kind = next((i + 1 for i, t in enumerate(_ERRORS) if isinstance(error, t)), 1)
            data = str(error).encode()
            _broadcast(torch.tensor([len(data), kind], device=device), src, group)
            if data:
                _broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device),
                           src, group)
            raise error
        assert not isinstance(tensors, Exception) and tensors is not None
        _broadcast(torch.tensor([header.numel(), 0], device=device), src, group)
        _broadcast(header.to(device), src, group)
        groups = _by_dtype([t.dtype for t in tensors])
        for dtype, members in groups.items():
            flat = torch.cat([tensors[i].detach().reshape(-1).to(device, _wire(dtype))
                              for i in members])
            _broadcast(flat, src, group)
        return tuple(tensors)
    size = torch.zeros(2, dtype=torch.int64, device=device)
    _broadcast(size, src, group)
    n, kind = size.tolist()
    if kind:
        text = torch.zeros(n, dtype=torch.uint8, device=device)
        if n:
            _broadcast(text, src, group)
        raise _ERRORS[kind - 1](bytes(text.cpu().tolist()).decode(errors="replace"))
    header = torch.zeros(n, dtype=torch.int64, device=device)
    _broadcast(header, src, group)
    values, pos = header.tolist(), 1
    shapes: list[tuple[int, ...]] = []
    dtypes: list[torch.dtype] = []
    for _ in range(values[0]):
        dtypes.append(_DTYPES[values[pos]])
        ndim = values[pos + 1]
        shapes.append(tuple(values[pos + 2:pos + 2 + ndim]))
        pos += 2 + ndim
    out: list[Tensor | None] = [None] * len(shapes)
    for dtype, members in _by_dtype(dtypes).items():
        sizes = [math.prod(shapes[i]) for i in members]
        flat = torch.empty(sum(sizes), dtype=_wire(dtype), device=device)
        _broadcast(flat, src, group)
        for i, part in zip(members, flat.split(sizes)):
            out[i] = part.view(shapes[i]).to(dtype).clone()
    return tuple(t for t in out if t is not None)


def _broadcast_header(tensors: Sequence[Tensor]) -> Tensor:
    header = [len(tensors)]
    for t in tensors:
        if not isinstance(t, Tensor):
            raise TypeError(f"can only broadcast Tensors, got {type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"cannot broadcast a tensor of dtype {t.dtype}; use one of "
                            f"{', '.join(str(d) for d in _DTYPES)}")
        header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(header, dtype=torch.int64)


def _by_dtype(dtypes: Sequence[torch.dtype]) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        groups.setdefault(dtype, []).append(i)
    return groups


def _wire(dtype: torch.dtype) -> torch.dtype:
    """The dtype a payload travels as (bool as uint8: not every backend reduces bools)."""
    return torch.uint8 if dtype == torch.bool else dtype
