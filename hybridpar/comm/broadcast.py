"""One rank's tensors to a whole group, without pickles: an int64 header, then the payloads.

Used outside the schedule (the balance a rank chose, the last stage's output, state dicts).
The wire format:

    1. [n, kind]                  n: header length; kind 0: tensors follow, else src
                                  failed: n message bytes follow, kind names its type
    2. [count, (dtype, ndim, *shape) per tensor]
    3. the tensors of each dtype, flattened and concatenated, in order of first use
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar import trace
from hybridpar.comm.p2p import DTYPES

__all__ = ["broadcast_tensors"]

_ERRORS: tuple[type[Exception], ...] = (RuntimeError, TypeError, ValueError)


def _broadcast(t: Tensor, src: int, group: ProcessGroup | None) -> None:
    with trace.collective("broadcast", t.numel() * t.element_size()):
        dist.broadcast(t, src, group=group)


def broadcast_tensors(tensors: Sequence[Tensor] | Exception | None, src: int, *,
                      group: ProcessGroup | None = None,
                      device: torch.device | str = "cpu") -> tuple[Tensor, ...]:
    """Broadcast `tensors` from global rank `src` to `group`; every rank returns them (the
    wire format is in the module docs).

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
        dtypes.append(DTYPES[values[pos]])
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
        if t.dtype not in DTYPES:
            raise TypeError(f"cannot broadcast a tensor of dtype {t.dtype}; use one of "
                            f"{', '.join(str(d) for d in DTYPES)}")
        header += [DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(header, dtype=torch.int64)


def _by_dtype(dtypes: Sequence[torch.dtype]) -> dict[torch.dtype, list[int]]:
    groups: dict[torch.dtype, list[int]] = {}
    for i, dtype in enumerate(dtypes):
        groups.setdefault(dtype, []).append(i)
    return groups


def _wire(dtype: torch.dtype) -> torch.dtype:
    """The dtype a payload travels as (bool as uint8: not every backend reduces bools)."""
    return torch.uint8 if dtype == torch.bool else dtype
