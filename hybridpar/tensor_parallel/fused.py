"""Fused weights: k equal parts along one dim (GPT-2's q | k | v), each part split over tp.

    full (out = 3E)        rank r of tp keeps (3E / tp)
    [ q | k | v ]          [ q_r | k_r | v_r ]      (part p, slice r: the r-th of tp in p)

A parameter of a fused column layer carries ``FUSED_ATTR = k``. `fused_shard_of` and
`fused_gather_full` are `state.shard_of` / `state.gather_full` for it (a plain contiguous
slice would mix q of one rank with k of the next).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar.tensor_parallel.attrs import tensor_shard_dim
from hybridpar.tensor_parallel.mappings import all_gather_along, group_rank, group_size

__all__ = ["FUSED_ATTR", "fused_gather_full", "fused_parts", "fused_shard_of"]

FUSED_ATTR = "_FUSED_PARTS"


def fused_parts(param: Tensor) -> int:
    """How many fused parts `param` is made of (1: not fused)."""
    return int(getattr(param, FUSED_ATTR, 1))


def fused_shard_of(full: Tensor, param: Tensor, group: ProcessGroup | None) -> Tensor:
    """This rank's slice of every part of `full`, concatenated (a new, detached tensor)."""
    dim, k, tp = tensor_shard_dim(param), fused_parts(param), group_size(group)
    assert dim is not None
    if full.shape[dim] % (k * tp):
        raise ValueError(f"a fused dim of {full.shape[dim]} does not split into {k} parts of "
                         f"{tp} slices")
    step = full.shape[dim] // (k * tp)
    parts = full.detach().unflatten(dim, (k, tp, step))            # (.., k, tp, step, ..)
    return parts.select(dim + 1, group_rank(group)).flatten(dim, dim + 1).clone(
        memory_format=torch.contiguous_format)


def fused_gather_full(tensor: Tensor, param: Tensor, group: ProcessGroup | None) -> Tensor:
    """All-gather the fused shards `tensor` into the full tensor, part by part (detached)."""
    dim, k, tp = tensor_shard_dim(param), fused_parts(param), group_size(group)
    assert dim is not None
    with torch.no_grad():
        ranks = all_gather_along(tensor.detach(), dim, group)      # (.., tp * k * step, ..)
        step = tensor.shape[dim] // k
        return ranks.unflatten(dim, (tp, k, step)).transpose(dim, dim + 1).flatten(
            dim, dim + 2).contiguous()
