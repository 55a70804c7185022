"""Fused weights: k equal parts along one dim (GPT-2's q | k | v), each part split over tp.

    full (out = 3E)        rank r of tp keeps (3E / tp)
    [ q | k | v ]          [ q_r | k_r | v_r ]      (part p, slice r: the r-th of tp in p)

A parameter of a fused column layer carries ``FUSED_ATTR = k``. `fused_shard_of` and
`fused_gather_full` are `state.shard_of` / `state.gather_full` for it (a plain contiguous
slice would mix q of one rank with k of the next); `fused_ranges` says where a rank's slice
lies in the full tensor, for readers of a slice of a file (`hybridpar.hf.load_hf_shards`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar.sharded.attrs import tensor_shard_dim
from hybridpar.sharded.mappings import all_gather_along, group_rank, group_size

__all__ = ["FUSED_ATTR", "fused_gather_full", "fused_parts", "fused_ranges", "fused_shard_of"]

FUSED_ATTR = "_FUSED_PARTS"


def fused_parts(param: Tensor) -> int:
    """How many fused parts `param` is made of (1: not fused)."""
    return int(getattr(param, FUSED_ATTR, 1))


def fused_ranges(length: int, parts: int, tp: int, rank: int) -> list[tuple[int, int]]:
    """The ``[start, stop)`` of rank `rank`'s slice of each of `parts` equal parts of a dim
    of `length` (their concatenation is the rank's shard), s = length / (parts * tp):

        parts=3, tp=2        [ q0 q1 | k0 k1 | v0 v1 ]      rank 1: [s, 2s) [3s, 4s) [5s, 6s)
    """
    if length % (parts * tp):
        raise ValueError(f"a fused dim of {length} does not split into {parts} parts of "
                         f"{tp} slices")
    step = length // (parts * tp)
    return [((p * tp + rank) * step, (p * tp + rank + 1) * step) for p in range(parts)]


def fused_shard_of(full: Tensor, param: Tensor, group: ProcessGroup | None) -> Tensor:
    """This rank's slice of every part of `full`, concatenated (a new, detached tensor)."""
    dim, k, tp = tensor_shard_dim(param), fused_parts(param), group_size(group)
    assert dim is not None
    ranges = fused_ranges(full.shape[dim], k, tp, group_rank(group))
    return torch.cat([full.detach().narrow(dim, a, b - a) for a, b in ranges], dim)


def fused_gather_full(tensor: Tensor, param: Tensor, group: ProcessGroup | None) -> Tensor:
    """All-gather the fused shards `tensor` into the full tensor, part by part (detached)."""
    dim, k, tp = tensor_shard_dim(param), fused_parts(param), group_size(group)
    assert dim is not None
    with torch.no_grad():
        ranks = all_gather_along(tensor.detach(), dim, group)      # (.., tp * k * step, ..)
        step = tensor.shape[dim] // k
        return ranks.unflatten(dim, (tp, k, step)).transpose(dim, dim + 1).flatten(
            dim, dim + 2).contiguous()
