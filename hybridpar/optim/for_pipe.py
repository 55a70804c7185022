"""The optimizer of a `HybridPipe` rank at a ZeRO level: which class holds what, and who owns.

    parameter dtype   zero 0               zero 1                       zero 2
    as built (fp32)   optimizer_class      ZeroRedundancyOptimizer      MasterWeights (the
                                           (torch's)                    weights their own
                                                                        masters), gradients
                                                                        sharded (the pipe)
    bf16 (main_grad)  MasterWeights        MasterWeights, shard=True    the same, gradients
                                                                        sharded (the pipe)

At zero 2 each gradient lives on its owner only, so the parameters whose gradients are also
summed over another group have one owner on every rank of that group: a tie's copies (over
stages) and the replicated parameters used on tp shards are pinned to the dp rank their
canonical name hashes to; the others are dealt by their full (unsharded) size, which is the
same on every tp rank. ZeroRedundancyOptimizer deals by its own rule, so zero 2 does not use
it.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybridpar.optim.master import MasterWeights, deal
from hybridpar.optim.zero import ZERO_LEVELS, check_shardable, zero_optimizer
from hybridpar.precision import has_main_grad
from hybridpar.sharded.attrs import get_parallel_dim

if TYPE_CHECKING:
    from hybridpar.pipe import HybridPipe

__all__ = ["gradient_owners", "pipe_optimizer"]


def pipe_optimizer(pipe: HybridPipe, optimizer_class: type[torch.optim.Optimizer],
                   params: Iterable[Any] | None = None, *, zero: int = 0,
                   **defaults: Any) -> torch.optim.Optimizer | MasterWeights:
    """`optimizer_class` over this rank's `params` (tensors or parameter groups; default:
    the pipe's trainable parameters) with its state (``zero >= 1``) and gradients
    (``zero = 2``, which also reshapes the pipe's gradient reduction) sharded over the pipe's
    dp group. Call it on every rank, once, before the first `train_step`.
    """
    if zero not in ZERO_LEVELS:
        raise ValueError(f"zero must be one of {', '.join(map(str, ZERO_LEVELS))}, got {zero}")
    groups = _as_groups(pipe, params)
    topo = pipe.topology
    shard = zero > 0 and topo.dp > 1
    if zero > 0 and topo.dp == 1:
        check_shardable(optimizer_class)
        if topo.rank == 0:
            warnings.warn(f"zero = {zero} at dp = 1: nothing to shard, the optimizer state and "
                          "gradients stay whole on every rank", stacklevel=2)
    lower = any(has_main_grad(p) for g in groups for p in g["params"])
    if zero == 2 and shard:
        owners = gradient_owners(pipe, groups)
        optimizer = MasterWeights(groups, optimizer_class, group=topo.dp_group, shard=True,
                                  owners=[owners[id(p)] for g in groups for p in g["params"]],
                                  module=pipe, **defaults)
        pipe.shard_gradients(owners)
        return optimizer
    if lower:
        return MasterWeights(groups, optimizer_class, group=topo.dp_group if shard else None,
                             shard=shard, module=pipe, **defaults)
    if shard:
        return zero_optimizer(groups, optimizer_class, group=topo.dp_group, **defaults)
    return optimizer_class(groups, **defaults)


def gradient_owners(pipe: HybridPipe, groups: list[dict[str, Any]]) -> dict[int, int]:
    """``id(parameter) -> dp rank`` for every parameter of `groups`: the pinned ones (ties'
    copies, partial-gradient replicas) by a hash of their canonical name, the rest dealt."""
    dp = pipe.topology.dp
    aliases = pipe.tied_aliases
    tied = set(aliases) | set(aliases.values())
    partial = set(pipe.partial_grads)
    pinned: dict[int, int] = {}
    for name, p in pipe.named_parameters(remove_duplicate=False):
        if name in tied or name in partial:
            canonical = aliases.get(name, name)
            pinned.setdefault(id(p), zlib.crc32(canonical.encode()) % dp)
    tp = pipe.topology.tp
    sizes = {id(p): p.numel() * (tp if get_parallel_dim(p) is not None else 1)
             for g in groups for p in g["params"]}
    tensors = [g["params"] for g in groups]
    owners = deal(tensors, dp, pinned=pinned, sizes=sizes)
    return dict(zip((id(p) for ps in tensors for p in ps), owners, strict=True))


def _as_groups(pipe: HybridPipe, params: Iterable[Any] | None) -> list[dict[str, Any]]:
    """`params` (default: the pipe's trainable parameters) as parameter groups."""
    items: list[Any] = list(params) if params is not None else \
        [p for p in pipe.parameters() if p.requires_grad]
    if not items:
        raise ValueError("the optimizer got an empty parameter list")
    if all(isinstance(g, dict) for g in items):
        return [{**g, "params": list(g["params"])} for g in items]
    if not all(isinstance(p, nn.Parameter) or torch.is_tensor(p) for p in items):
        raise TypeError("params must be tensors or parameter groups (dicts with 'params')")
    return [{"params": items}]

