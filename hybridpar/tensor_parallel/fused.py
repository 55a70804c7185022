"""Fused weights: parts along one dim (GPT-2's q | k | v, Phi-3's q | k | v of unequal widths
under grouped queries), each part split over tp.

    full (parts of n_0, n_1, ...)     rank r of tp keeps sum(n_p) / tp
    [ q | k | v ]                     [ q_r | k_r | v_r ]    (part p, slice r: the r-th of tp
                                                              in p, n_p / tp wide)

A parameter of a fused column layer carries ``FUSED_ATTR``: the full widths of its parts (k
equal parts: ``(n,) * k``). `fused_shard_of` and `fused_gather_full` are `state.shard_of` /
`state.gather_full` for it (a plain contiguous slice would mix q of one rank with k of the
next); `fused_ranges` says where a rank's slice lies in the full tensor, for readers of a slice
of a file (`hybridpar.hf.load_hf_shards`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar.sharded.attrs import tensor_shard_dim
from hybridpar.sharded.mappings import all_gather_along, group_rank, group_size

__all__ = ["FUSED_ATTR", "Fused", "fused_gather_full", "fused_parts", "fused_ranges",
           "fused_shard_of", "fused_sizes", "local_ranges", "part_count", "part_sizes"]

FUSED_ATTR = "_FUSED_PARTS"
# how a layer's output is fused: k equal parts, or the full widths of its parts
Fused = int | tuple[int, ...]


def part_count(fused: Fused) -> int:
    """How many parts `fused` names."""
    return fused if isinstance(fused, int) else len(fused)


def part_sizes(fused: Fused, length: int) -> tuple[int, ...]:
    """The full widths of the parts of a dim of `length`: k equal parts, or `fused` itself
    (which must add up to `length`)."""
    if isinstance(fused, int):
        if fused < 1 or length % fused:
            raise ValueError(f"a fused dim of {length} does not split into {fused} equal parts")
        return (length // fused,) * fused
    sizes = tuple(int(n) for n in fused)
    if not sizes or min(sizes) < 1 or sum(sizes) != length:
        raise ValueError(f"fused parts {sizes} do not add up to the dim's {length}")
    return sizes


def fused_sizes(param: Tensor) -> tuple[int, ...]:
    """The full widths of `param`'s fused parts (one part, its whole dim: ``()``)."""
    return tuple(getattr(param, FUSED_ATTR, ()))


def fused_parts(param: Tensor) -> int:
    """How many fused parts `param` is made of (1: not fused)."""
    return max(len(fused_sizes(param)), 1)


def fused_ranges(sizes: Sequence[int], tp: int, rank: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` of rank `rank`'s slice of each part (full widths `sizes`) of a
    dim (their concatenation is the rank's shard):

        sizes (4, 2, 2), tp=2       [ q0 q0 q1 q1 | k0 k1 | v0 v1 ]    rank 1: [2, 4) [5, 6) [7, 8)
    """
    ranges, start = [], 0
    for n in sizes:
        if n % tp:
            raise ValueError(f"a fused part of {n} (of {tuple(sizes)}) does not split into "
                             f"{tp} slices")
        step = n // tp
        ranges.append((start + rank * step, start + (rank + 1) * step))
        start += n
    return ranges


def local_ranges(sizes: Sequence[int], tp: int) -> list[tuple[int, int]]:
    """Where each part (full widths `sizes`) lies in a rank's shard ``[q_r | k_r | v_r]``:

        sizes (4, 2, 2), tp=2       shard [ q_r q_r | k_r | v_r ]      [0, 2) [2, 3) [3, 4)
    """
    ranges, start = [], 0
    for n in sizes:
        ranges.append((start, start + n // tp))
        start += n // tp
    return ranges


def fused_shard_of(full: Tensor, param: Tensor, group: ProcessGroup | None) -> Tensor:
    """This rank's slice of every part of `full`, concatenated (a new, detached tensor)."""
    dim = tensor_shard_dim(param)
    assert dim is not None
    ranges = fused_ranges(fused_sizes(param), group_size(group), group_rank(group))
    return torch.cat([full.detach().narrow(dim, a, b - a) for a, b in ranges], dim)


def fused_gather_full(tensor: Tensor, param: Tensor, group: ProcessGroup | None) -> Tensor:
    """All-gather the fused shards `tensor` into the full tensor, part by part (detached)."""
    dim, sizes, tp = tensor_shard_dim(param), fused_sizes(param), group_size(group)
    assert dim is not None
    with torch.no_grad():
        ranks = all_gather_along(tensor.detach(), dim, group).chunk(tp, dim)   # rank order
        steps = [b - a for a, b in local_ranges(sizes, tp)]
        pieces = [r.split(steps, dim) for r in ranks]                       # [rank][part]
        return torch.cat([pieces[r][p] for p in range(len(sizes)) for r in range(tp)], dim)
