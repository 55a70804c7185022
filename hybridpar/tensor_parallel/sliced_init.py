"""Initialize tp shards as their full tensors would be, holding only the shard (CPU).

A tp layer's keyed draw must give this rank the slice of what one device draws for the full
tensor. Drawing the full tensor and keeping the slice costs the full layer; here the full
layer's initializer runs on stand-ins (`ShardProxy`: the full shape, no storage), and each
op it applies is redone on the shard:

    op on the full tensor                          on this rank's shard
    uniform_(a, b)                                 the full stream in chunks of `chunk`
    normal_(mean, std)                             elements, each chunk's values scattered
                                                   into the shard, the rest dropped
    zero_, fill_, mul_, clamp_, ... (pointwise,    the same op on the shard's elements
    other operands numbers or 0-dim tensors)
    select, slice, detach, t, ... (views)          a stand-in for the view

The chunks draw exactly what the full op draws (CPU generator, checked element by element in
tests/test_sliced_init.py): ``uniform_`` takes one number per element in order; ``normal_``
fills every element with a uniform, turns each 16-element block into normals (Box-Muller,
block by block from the start) and, when 16 does not divide the size, redraws the last 16:

    full normal_ of n = 16 q + r elements           chunked
    uniforms u[0 : n]                               normal_ of chunks of [0, 16 q) (16 | chunk)
    blocks [0, 16 q) -> normals                     (float32 / float64: skip r uniforms;
    16 fresh uniforms -> normals of [n - 16, n)      half / bfloat16 draw none)
                                                    normal_ of 16 -> [n - 16, n)

Anything else (an op that reads the values, a random op on a part of the tensor, a GPU
generator, whose chunks would draw other numbers) makes `init_shards` fall back to the full
tensors, one layer at a time, as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils._pytree import tree_flatten

from hybridpar.tensor_parallel.state import full_shape, shard_ranges

__all__ = ["CHUNK_ELEMENTS", "ShardProxy", "init_from_full", "init_shards"]

CHUNK_ELEMENTS = 1 << 20    # elements of one chunk of a draw (a multiple of 16)

_aten = torch.ops.aten
_DRAWS = {_aten.uniform_.default, _aten.normal_.default}
_FILLS = {_aten.zero_.default, _aten.fill_.Scalar, _aten.fill_.Tensor,
          _aten.copy_.default}   # copy_ of a 0-dim tensor: ``t[i] = 2.0``


class _Unsupported(Exception):
    """An op on a stand-in that cannot be redone on the shard alone."""


@dataclass
class _Shard:
    """Where one full tensor's elements go: `shard` holds, of the full tensor (outer, L,
    inner) around the shard dim, the rows [a, b) of L for each of `ranges`, concatenated."""

    shard: Tensor
    shape: tuple[int, ...]
    dim: int
    ranges: list[tuple[int, int]]
    chunk: int
    write: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def index(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """(which of the full tensor's flat indices `flat` are in the shard, their flat
        indices in the shard)."""
        length = self.shape[self.dim]
        inner = math.prod(self.shape[self.dim + 1:])
        kept = sum(b - a for a, b in self.ranges)
        outer, rest = flat.div(length * inner, rounding_mode="floor"), flat % (length * inner)
        row, col = rest.div(inner, rounding_mode="floor"), rest % inner
        keep = torch.zeros_like(flat, dtype=torch.bool)
        dest = torch.zeros_like(flat)
        start = 0
        for a, b in self.ranges:
            inside = (row >= a) & (row < b)
            keep |= inside
            dest = torch.where(inside, (outer * kept + start + row - a) * inner + col, dest)
            start += b - a
        return keep, dest[keep]

    def put(self, values: Tensor, first: int) -> None:
        """Write the full tensor's flat elements [first, first + len(values)) that the shard
        holds: whole rows of (outer, L * inner) as one strided copy per range, the parts of
        a row at either end of `values` range by range."""
        length = self.shape[self.dim]
        inner = math.prod(self.shape[self.dim + 1:])
        row = length * inner
        kept = sum(b - a for a, b in self.ranges)
        starts = [sum(b - a for a, b in self.ranges[:k]) for k in range(len(self.ranges))]
        rows_out = self.shard.view(-1, kept * inner)
        pos, end = first, first + values.numel()
        while pos < end:
            o, in_row = divmod(pos, row)
            if in_row == 0 and end - pos >= row:       # whole rows [o, o + k)
                k = (end - pos) // row
                rows_in = values[pos - first:pos - first + k * row].view(k, length, inner)
                out = rows_out.view(-1, kept, inner)
                for (a, b), start in zip(self.ranges, starts, strict=True):
                    out[o:o + k, start:start + b - a] = rows_in[:, a:b]
                pos += k * row
                continue
            stop = min(end - o * row, row)             # row o's elements [in_row, stop)
            for (a, b), start in zip(self.ranges, starts, strict=True):
                lo, hi = max(in_row, a * inner), min(stop, b * inner)
                if lo < hi:
                    at = start * inner + lo - a * inner
                    rows_out[o, at:at + hi - lo] = values[o * row + lo - first:
                                                          o * row + hi - first]
            pos = o * row + stop

    def draw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Redo the random op `func` of the whole full tensor, chunk by chunk."""
        n, dtype = self.numel, self.shard.dtype

        def chunk(first: int, stop: int, op: Any = func) -> None:
            values = torch.empty(stop - first, dtype=dtype)
            op(values, *args, **kwargs)
            self.put(values, first)

        if func is _aten.uniform_.default or n <= self.chunk:
            for first in range(0, n, self.chunk):
                chunk(first, min(first + self.chunk, n))
            return
        whole = n // 16 * 16          # normal_: 16-element blocks from the start
        for first in range(0, whole, self.chunk):
            chunk(first, min(first + self.chunk, whole))
        if whole < n:
            if dtype in (torch.float32, torch.float64):   # the uniforms left unused
                skipped = torch.empty(n - whole, dtype=dtype)
                _aten.uniform_.default(skipped, 0.0, 1.0, generator=kwargs.get("generator"))
            chunk(n - 16, n)


class ShardProxy(torch.Tensor):
    """A stand-in for a full tensor (or a view of one) whose ops land on a rank's shard."""

    target: _Shard

    @staticmethod
    def __new__(cls, target: _Shard, size: tuple[int, ...], stride: tuple[int, ...],
                offset: int) -> ShardProxy:
        proxy = torch.Tensor._make_wrapper_subclass(
            cls, size, strides=stride, storage_offset=offset, dtype=target.shard.dtype,
            device=target.shard.device, requires_grad=False)
        proxy.target = target
        return proxy

    @classmethod
    def of(cls, target: _Shard) -> ShardProxy:
        """The stand-in for the whole full tensor of `target`."""
        stride = torch.empty(target.shape, device="meta").stride()
        return cls(target, target.shape, stride, 0)

    def _is_whole(self) -> bool:
        return (self.numel() == self.target.numel and self.storage_offset() == 0
                and self.is_contiguous())

    def _flat(self) -> Tensor:
        """The full tensor's flat indices of this view's elements, in its order."""
        flat = torch.full((), int(self.storage_offset()), dtype=torch.int64)
        for size, stride in zip(self.shape, self.stride(), strict=True):
            flat = flat.unsqueeze(-1) + torch.arange(size) * stride
        return flat.reshape(-1)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any,  # type: ignore[override]
                           args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        self = args[0] if args else None
        if not isinstance(self, ShardProxy):
            raise _Unsupported(f"{func} reads a full tensor that is not materialized")
        others = tree_flatten((args[1:], kwargs))[0]
        if any(isinstance(a, ShardProxy) or (isinstance(a, Tensor) and a.dim() > 0)
               for a in others):
            raise _Unsupported(f"{func} combines a full tensor with other tensors")
        if func.is_view:
            stand_in = torch.empty_strided(self.shape, self.stride(), device="meta")
            stand_in = stand_in.as_strided(self.shape, self.stride(), self.storage_offset())
            view = func(stand_in, *args[1:], **kwargs)
            return cls(self.target, tuple(view.shape), view.stride(), view.storage_offset())
        target = self.target
        if func in _DRAWS:
            if not self._is_whole():
                raise _Unsupported(f"{func} draws a part of a full tensor")
            generator = kwargs.get("generator")
            if generator is not None and generator.device.type != "cpu":
                raise _Unsupported(f"{func} draws from a {generator.device} generator")
            if target.write:
                target.draw(func, args[1:], kwargs)
        elif torch.Tag.inplace in func.tags and (func in _FILLS or
                                                 torch.Tag.pointwise in func.tags):
            if target.write:
                if self._is_whole():
                    func(target.shard, *args[1:], **kwargs)
                else:
                    _, dest = target.index(self._flat())
                    values = target.shard.view(-1)[dest]
                    func(values, *args[1:], **kwargs)
                    target.shard.view(-1)[dest] = values
        else:
            raise _Unsupported(f"{func} is not an initializer's op hybridpar can slice")
        return self


@contextmanager
def _stand_ins(pairs: Mapping[Tensor, tuple[nn.Module, str]], *, write: bool, chunk: int,
               group: ProcessGroup | None) -> Iterator[list[_Shard]]:
    """Swap each full module's parameter for a `ShardProxy` writing into its shard (the key),
    and put the full parameters back afterwards."""
    saved, targets = [], []
    for shard, (module, name) in pairs.items():
        where = shard_ranges(shard, group)
        shape = tuple(full_shape(shard, group))
        dim, ranges = (where.dim, where.ranges) if where is not None else (0, [(0, shape[0])])
        target = _Shard(shard.data, shape, dim, list(ranges), chunk, write)
        saved.append((module, name, module._parameters[name]))
        module._parameters[name] = ShardProxy.of(target)  # type: ignore[assignment]
        targets.append(target)
    try:
        yield targets
    finally:
        for module, name, param in saved:
            module._parameters[name] = param


def init_shards(module: nn.Module, init: Callable[[Any], None],
                pairs: Mapping[Tensor, tuple[nn.Module, str]], *,
                group: ProcessGroup | None = None, chunk: int = CHUNK_ELEMENTS) -> bool:
    """Run ``init(module)`` with the full parameters named by `pairs` (shard -> (its full
    module, parameter name), the full modules on `meta`) replaced by stand-ins, so each
    shard receives its slice of what `init` draws on the full tensor; True when done.

    False (nothing changed, no random number drawn) when a shard is not on the CPU or `init`
    does something that cannot be redone on the slices: the caller then draws the full
    tensors. `init` runs twice, first with nothing written to check that every op can be
    redone (under a forked random state, so the second run draws the same numbers).
    """
    if chunk % 16:
        raise ValueError(f"chunk={chunk} must be a multiple of 16 (normal_'s blocks)")
    if any(shard.device.type != "cpu" for shard in pairs):
        return False
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), \
                _stand_ins(pairs, write=False, chunk=chunk, group=group):
            init(module)
    except _Unsupported:
        return False
    with torch.no_grad(), _stand_ins(pairs, write=True, chunk=chunk, group=group):
        init(module)
    return True


def init_from_full(layer: nn.Module, full: nn.Module, init: Callable[[Any], None], *,
                   group: ProcessGroup | None = None, chunk: int = CHUNK_ELEMENTS) -> None:
    """Give each parameter of the tp layer `layer` its slice of what ``init(full)`` draws,
    `full` being the plain layer it is a shard of, on `meta` (same parameter names).

    Through `init_shards` when it can (no full tensor allocated), else `full` is materialized
    on `layer`'s device, drawn and sliced (`shard_of`): one full layer at a time.
    """
    from hybridpar.tensor_parallel.state import shard_of

    pairs: dict[Tensor, tuple[nn.Module, str]] = {
        param: (full, name) for name, param in layer.named_parameters(recurse=False)
             if isinstance(full._parameters.get(name), Tensor)}
    if init_shards(full, init, pairs, group=group, chunk=chunk):
        return
    device = next(iter(pairs)).device
    full.to_empty(device=device)
    with torch.no_grad():
        init(full)
        for param, (_, name) in pairs.items():
            param.copy_(shard_of(getattr(full, name), param, group))
