"""Conjugate communication operators of tensor parallelism, each a tiny autograd Function.

Every forward collective has its conjugate in backward; the group is always an argument and a
one-rank group communicates nothing:

    function              forward                          backward
    copy_to_group         identity                         all-reduce (sum)
    reduce_from_group     all-reduce (sum)                 identity
    scatter_to_group      keep this rank's slice of `dim`  all-gather along `dim`
    gather_from_group     all-gather along `dim`           keep this rank's slice
    reduce_scatter_group  reduce-scatter along `dim`       all-gather along `dim`
    gather_grad_scatter   all-gather along `dim`           reduce-scatter along `dim`

Slices may be uneven (a vocabulary of 10 over 4 ranks is 3, 3, 2, 2): `shard_sizes` says how
a length is split, the first ``length % n`` ranks taking one more, as `torch.tensor_split`.

Each collective is counted in `hybridpar.comm_stats` (all_reduce: the tensor's bytes;
all_gather: the gathered result's; reduce_scatter: the whole tensor's) and timed while
`hybridpar.trace` records.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar.process.compat import all_gather_single, reduce_scatter_single
from hybridpar.trace import collective

__all__ = [
    "all_gather_along",
    "copy_to_group",
    "gather_from_group",
    "gather_grad_scatter",
    "group_rank",
    "group_size",
    "reduce_from_group",
    "reduce_scatter_along",
    "reduce_scatter_group",
    "scatter_to_group",
    "shard_range",
    "shard_sizes",
    "split_along",
]


def group_size(group: ProcessGroup | None) -> int:
    """The number of ranks in `group` (1 when there is no group)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This rank's index inside `group` (0 when there is no group)."""
    return 0 if group is None else dist.get_rank(group)


def shard_sizes(length: int, parts: int) -> list[int]:
    """How `length` splits over `parts` ranks: the first ``length % parts`` get one more."""
    base, extra = divmod(length, parts)
    return [base + (1 if r < extra else 0) for r in range(parts)]


def shard_range(length: int, parts: int, index: int) -> tuple[int, int]:
    """The ``[start, stop)`` of shard `index` when `length` splits over `parts` ranks."""
    sizes = shard_sizes(length, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


def _nbytes(x: Tensor) -> int:
    return x.numel() * x.element_size()


def _all_reduce(x: Tensor, group: ProcessGroup | None) -> None:
    """Sum `x` in place over `group`, counted."""
    with collective("all_reduce", _nbytes(x)):
        dist.all_reduce(x, group=group)


def split_along(x: Tensor, dim: int, group: ProcessGroup | None, *,
                length: int | None = None) -> Tensor:
    """This rank's slice of `x` along `dim` (a view; no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    start, stop = shard_range(x.shape[dim] if length is None else length, n, group_rank(group))
    return x.narrow(dim, start, stop - start)


def all_gather_along(x: Tensor, dim: int, group: ProcessGroup | None, *,
                     length: int | None = None) -> Tensor:
    """Concatenate every rank's `x` along `dim`; `length` is the full length when uneven.

    One `all_gather_single` (`hybridpar.process.compat`: ``all_gather_into_tensor`` before
    torch 2.13) of the shards, one after another (uneven shards padded to the widest), then
    each narrowed to its size.
    """
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    sizes = shard_sizes(length, n) if length is not None else [x.shape[dim]] * n
    widest = max(sizes)
    local = x.contiguous()
    if local.shape[dim] < widest:  # pad to the widest shard: the gather moves equal sizes
        pad_shape = list(local.shape)
        pad_shape[dim] = widest - local.shape[dim]
        local = torch.cat([local, local.new_zeros(pad_shape)], dim=dim)
    flat = local.new_empty(n * local.numel())   # every shard flattened, one after another
    full = local.numel() // max(local.shape[dim], 1) * sum(sizes) * local.element_size()
    with collective("all_gather", full):
        all_gather_single(flat, local.view(-1), group)
    stacked = flat.view(n, *local.shape)                               # (n, ..., widest, ...)
    return torch.cat([p.narrow(dim, 0, s) for p, s in zip(stacked.unbind(0), sizes)], dim=dim)


def reduce_scatter_along(x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Sum `x` over the group and keep this rank's slice along `dim` (`shard_sizes`).

    One `reduce_scatter_single` (`hybridpar.process.compat`: ``reduce_scatter_tensor`` before torch
    2.13) over the slices stacked on a new leading dim (uneven slices padded to the widest).
    """
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    sizes = shard_sizes(x.shape[dim], n)
    widest = max(sizes)
    shape = list(x.shape)
    shape[dim] = widest
    stacked = x.new_zeros((n, *shape))                                 # (n, ..., widest, ...)
    for r, part in enumerate(x.split(sizes, dim=dim)):
        stacked[r].narrow(dim, 0, part.shape[dim]).copy_(part)
    out = x.new_empty(shape)
    with collective("reduce_scatter", _nbytes(x)):
        reduce_scatter_single(out.view(-1), stacked.view(-1), group)
    return out.narrow(dim, 0, sizes[group_rank(group)]).contiguous()


class _CopyToGroup(torch.autograd.Function):
    """Identity in forward, all-reduce in backward (the input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        if group_size(ctx.group) > 1:
            grad = grad.contiguous().clone()
            _all_reduce(grad, ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce in forward, identity in backward (the output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup | None) -> Tensor:
        if group_size(group) == 1:
            return x
        x = x.contiguous().clone()
        _all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _ScatterToGroup(torch.autograd.Function):
    """Keep this rank's slice in forward, all-gather in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.group, ctx.length = dim, group, x.shape[dim]
        return split_along(x, dim, group).contiguous()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return all_gather_along(grad, ctx.dim, ctx.group, length=ctx.length), None, None


class _GatherFromGroup(torch.autograd.Function):
    """All-gather in forward, keep this rank's slice in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: ProcessGroup | None,
                length: int | None) -> Tensor:
        out = all_gather_along(x, dim, group, length=length)
        ctx.dim, ctx.group, ctx.length = dim, group, out.shape[dim]
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        grad = split_along(grad, ctx.dim, ctx.group, length=ctx.length).contiguous()
        return grad, None, None, None


class _ReduceScatterGroup(torch.autograd.Function):
    """Reduce-scatter in forward, all-gather in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.group, ctx.length = dim, group, x.shape[dim]
        return reduce_scatter_along(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return all_gather_along(grad, ctx.dim, ctx.group, length=ctx.length), None, None


class _GatherGradScatter(torch.autograd.Function):
    """All-gather in forward, reduce-scatter in backward (a sharded input used whole)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: ProcessGroup | None,
                length: int | None) -> Tensor:
        out = all_gather_along(x, dim, group, length=length)
        ctx.dim, ctx.group = dim, group
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return reduce_scatter_along(grad, ctx.dim, ctx.group), None, None, None


def copy_to_group(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Identity forward; all-reduce of the gradient in backward."""
    if group_size(group) == 1:
        return x
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """All-reduce (sum) forward; identity backward."""
    if group_size(group) == 1:
        return x
    return _ReduceFromGroup.apply(x, group)


def scatter_to_group(x: Tensor, group: ProcessGroup | None, *, dim: int = -1) -> Tensor:
    """This rank's slice of `dim` forward; all-gather of the gradient backward."""
    if group_size(group) == 1:
        return x
    return _ScatterToGroup.apply(x, dim, group)


def gather_from_group(x: Tensor, group: ProcessGroup | None, *, dim: int = -1,
                      length: int | None = None) -> Tensor:
    """All-gather along `dim` forward (`length`: full size when uneven); slice backward."""
    if group_size(group) == 1:
        return x
    return _GatherFromGroup.apply(x, dim, group, length)


def reduce_scatter_group(x: Tensor, group: ProcessGroup | None, *, dim: int = -1) -> Tensor:
    """Sum over the group and keep this rank's slice of `dim`; all-gather backward."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterGroup.apply(x, dim, group)


def gather_grad_scatter(x: Tensor, group: ProcessGroup | None, *, dim: int = -1,
                        length: int | None = None) -> Tensor:
    """All-gather along `dim` forward; reduce-scatter of the gradient backward."""
    if group_size(group) == 1:
        return x
    return _GatherGradScatter.apply(x, dim, group, length)
