"""The optimizer of a `HybridPipe` rank at a ZeRO level: which class holds what, and who owns.

    parameter dtype   zero 0               zero 1                       zero 2
    as built (fp32)   optimizer_class      ZeroRedundancyOptimizer      MasterWeights (the
                                           (torch's)                    weights their own
                                                                        masters), gradients
                                                                        sharded (the pipe)
    bf16 (main_grad)  MasterWeights        MasterWeights, shard=True    the same, gradients
                                                                        sharded (the pipe)
    with ep           (as above)           SplitOptimizer: the dense    SplitOptimizer of
                                           part's over dp, the          MasterWeights, each
                                           experts' over expert-dp      part's gradients on
                                           (bf16: MasterWeights each)   its owners

At zero 2 each gradient lives on its owner only, so the parameters whose gradients are also
summed over another group have one owner on every rank of that group: a tie's copies (over
stages) and the replicated parameters used on tp shards are pinned to the dp rank their
canonical name hashes to; the others go to the ranks in contiguous runs of the model's
order, balanced by their full (unsharded) size, which is the same on every tp rank, so each
rank's gradient buckets cover one stretch of the backward (`contiguous_owners`).
ZeroRedundancyOptimizer deals by its own rule, so zero 2 does not use it.
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hybridpar.optim.master import MasterWeights
from hybridpar.optim.split import SplitOptimizer
from hybridpar.optim.zero import ZERO_LEVELS, check_shardable, zero_optimizer
from hybridpar.precision import has_main_grad
from hybridpar.sharded.attrs import get_parallel_dim, is_expert_shard

if TYPE_CHECKING:
    from hybridpar.pipe import HybridPipe

__all__ = ["contiguous_owners", "gradient_owners", "pipe_optimizer"]


def pipe_optimizer(pipe: HybridPipe, optimizer_class: type[torch.optim.Optimizer],
                   params: Iterable[Any] | None = None, *, zero: int = 0,
                   **defaults: Any) -> torch.optim.Optimizer | MasterWeights | SplitOptimizer:
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
    if shard and any(is_expert_shard(p) for g in groups for p in g["params"]):
        return _split_experts(pipe, groups, optimizer_class, zero=zero, lower=lower,
                              **defaults)
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


def _split_experts(pipe: HybridPipe, groups: list[dict[str, Any]],
                   optimizer_class: type[torch.optim.Optimizer], *, zero: int, lower: bool,
                   **defaults: Any) -> SplitOptimizer:
    """ZeRO of a pipe with expert parallelism: the dense parameters' state (`lower`: and
    float32 masters; zero 2: and gradients) dealt over the dp group, the experts' over the
    expert-dp group, or whole on each rank when every dp rank of an ep group holds other
    experts (dp = ep) (`optim.split`)."""
    topo = pipe.topology

    def part(experts: bool) -> list[dict[str, Any]]:
        kept = [{**g, "params": [p for p in g["params"] if is_expert_shard(p) == experts]}
                for g in groups]
        return [g for g in kept if g["params"]]

    dense, experts = part(False), part(True)
    shard_experts = topo.dp // topo.ep > 1
    parts: list[Any] = []
    if zero == 2 or lower:   # MasterWeights per part (its float32 masters, or the weights)
        owners = gradient_owners(pipe, dense) if zero == 2 and dense else None
        listed = [p for g in experts for p in g["params"]]
        expert_owners = contiguous_owners([p.numel() for p in listed], topo.dp // topo.ep) \
            if zero == 2 and shard_experts else None
        if dense:
            parts.append(MasterWeights(
                dense, optimizer_class, group=topo.dp_group, shard=True, module=pipe,
                owners=None if owners is None else
                [owners[id(p)] for g in dense for p in g["params"]], **defaults))
        parts.append(MasterWeights(experts, optimizer_class, group=topo.expert_dp_group,
                                   shard=shard_experts, module=pipe, experts=True,
                                   owners=expert_owners, **defaults))
        if zero == 2:   # gradients too: each on its master's owner only
            pipe.shard_gradients(owners or {}, expert_owners=None if expert_owners is None
                                 else dict(zip(map(id, listed), expert_owners, strict=True)))
        return SplitOptimizer(parts)
    if dense:
        parts.append(zero_optimizer(dense, optimizer_class, group=topo.dp_group, **defaults))
    parts.append(zero_optimizer(experts, optimizer_class, group=topo.expert_dp_group,
                                experts=True, **defaults) if shard_experts
                 else optimizer_class(experts, **defaults))
    return SplitOptimizer(parts)


def gradient_owners(pipe: HybridPipe, groups: list[dict[str, Any]]) -> dict[int, int]:
    """``id(parameter) -> dp rank`` for every parameter of `groups`: the pinned ones (ties'
    copies, partial-gradient replicas) by a hash of their canonical name, the rest in
    contiguous runs of the pipe's parameter order (`contiguous_owners`)."""
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
    listed = {id(p): p for g in groups for p in g["params"]}
    order = [p for p in pipe.parameters() if id(p) in listed]
    seen = {id(p) for p in order}
    order += [p for p in listed.values() if id(p) not in seen]   # none in a pipe's groups
    sizes = [p.numel() * (tp if get_parallel_dim(p) is not None else 1) for p in order]
    owners = contiguous_owners(sizes, dp, pinned=[pinned.get(id(p)) for p in order])
    return dict(zip((id(p) for p in order), owners, strict=True))


def contiguous_owners(sizes: Sequence[int], ranks: int, *,
                      pinned: Sequence[int | None] | None = None) -> list[int]:
    """The owner of each tensor of `sizes` (elements, in the model's order): the unpinned
    ones in `ranks` contiguous runs, rank 0 first, each run filled until its rank holds about
    its 1 / `ranks` of all elements (pinned ones included: their rank's run is shorter).

    Contiguous, so that zero 2's gradient buckets, which are cut per owner
    (`pipeline.parameters.grad_shards`), each cover one stretch of the backward: a bucket's
    staging buffer lives from its first gradient to its reduce, so the staging alive is
    one bucket filling and one in flight. Dealt largest first (`deal`) the owners alternate
    along the model, every owner's bucket fills during the whole backward, and the staging
    alive is the gradients of the whole model again (tests/test_zero.py).
    """
    fixed = list(pinned) if pinned is not None else [None] * len(sizes)
    load = [0] * ranks
    for size, rank in zip(sizes, fixed, strict=True):
        if rank is not None:
            load[rank] += size
    share = sum(sizes) / ranks
    owners: list[int] = []
    rank = 0
    for size, pin in zip(sizes, fixed, strict=True):
        if pin is not None:
            owners.append(pin)
            continue
        # the next rank once this one is full: half of the tensor would go past its share
        # (a rank holding nothing yet takes it: the runs never skip a rank for a large one)
        while rank < ranks - 1 and load[rank] and load[rank] + size / 2 > share:
            rank += 1
        owners.append(rank)
        load[rank] += size
    return owners


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

