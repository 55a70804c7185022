"""ZeRO-1 over the dp group: each replica keeps the optimizer state of its part of the params.

torch's `ZeroRedundancyOptimizer`, over a stage's (tp shard's) parameters and the topology's
dp group: the parameters are dealt to the dp ranks whole (largest first, each to the rank
holding the fewest elements so far, per parameter group), each rank's optimizer steps its
own with the averaged gradients every rank has, and every rank then broadcasts what it
updated:

    parallel.zero   gradients                 optimizer state (AdamW)   per parameter, fp32
    0               averaged on every rank    on every rank             4 + 4 + 8 = 16 bytes
    1               averaged on every rank    1 / dp of it per rank     4 + 4 + 8 / dp

Under expert parallelism the experts' state is dealt over the expert-dp group instead
(`pipe_optimizer`, `optim.split`). A parameter's state lives whole on one rank, so
checkpoints keep their keys
(``optim/<name>/<key>``, each written once, by its owner) and load under any dp, zero or
layout: a rank reads the state of the parameters it owns now.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar.sharded.attrs import is_expert_shard

__all__ = [
    "ZERO_LEVELS",
    "check_no_expert_shards",
    "check_shardable",
    "local_optimizer",
    "optimizer_state_tensors",
    "owned_parameters",
    "zero_optimizer",
]

ZERO_LEVELS = (0, 1, 2)  # parallel.zero: 0 = replicated, 1 = state sharded over dp, 2 = and grads

# optimizers whose step needs every parameter at once (a closure over the whole model)
_UNSHARDABLE = (torch.optim.LBFGS,)


def zero_optimizer(params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer], *,
                   group: ProcessGroup, experts: bool = False,
                   **defaults: Any) -> torch.optim.Optimizer:
    """`optimizer_class` over `params` (tensors or parameter groups) with its state sharded
    over the dp `group` (torch's `ZeroRedundancyOptimizer`); call it on every rank of the
    group with the same parameters in the same order. A slice of the experts is refused
    unless `experts` says `group` is the expert-dp group (the ranks holding that slice)."""
    if not (isinstance(optimizer_class, type) and
            issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"optimizer_class must be a torch.optim.Optimizer class, got "
                        f"{optimizer_class!r}")
    check_shardable(optimizer_class)
    params = list(params)
    if not experts:
        check_no_expert_shards(params)
    with warnings.catch_warnings():
        # the package's __init__ scripts its functional optimizers and the RPC
        # DistributedOptimizer with torch.jit.script / interface, which torch 2.13 deprecates;
        # ZeroRedundancyOptimizer itself uses none of them (the functional ones serve its
        # overlap_with_ddp mode, not used here)
        warnings.filterwarnings("ignore", r"`torch\.jit\.\w+` is deprecated",
                                DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer

    # parameters_as_bucket_view: each rank's parameters are views of one flat buffer per
    # (device, rank), so the update goes out in one broadcast per rank, not one per parameter
    return ZeroRedundancyOptimizer(params, optimizer_class, process_group=group,
                                   parameters_as_bucket_view=True, **defaults)


def check_no_expert_shards(params: Iterable[Any]) -> None:
    """Raise `ValueError` if `params` (tensors or parameter groups) hold a slice of a model's
    experts: ZeRO deals the state of whole parameters over dp replicas, and under expert
    parallelism the replicas of an ep group hold other experts."""
    for item in params:
        for p in item["params"] if isinstance(item, dict) else [item]:
            if is_expert_shard(p):
                raise ValueError("a slice of the experts in an optimizer sharded over the dp "
                                 "group: the dp replicas of an ep group hold other experts; "
                                 "use hybridpar.optim.pipe_optimizer(pipe, ..., zero=1), "
                                 "which deals the experts' state over the expert-dp group")


def check_shardable(optimizer_class: type[torch.optim.Optimizer]) -> None:
    """A `ValueError` naming `optimizer_class` if its state cannot be dealt to dp ranks."""
    if issubclass(optimizer_class, _UNSHARDABLE):
        raise ValueError(f"{optimizer_class.__name__} cannot be sharded over data parallelism: "
                         "its step evaluates a closure over every parameter at once; use "
                         "parallel.zero = 0 with it")


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's state: a ZeRO optimizer's local one, the one over
    `MasterWeights`' masters, else itself."""
    return getattr(optimizer, "optim", optimizer)


def owned_parameters(optimizer: Any) -> set[int]:
    """The ``id`` of every model parameter whose state this rank holds (all of them without
    sharding; for `MasterWeights`, those with a master here; a `SplitOptimizer`'s parts')."""
    from hybridpar.optim.split import SplitOptimizer  # (split imports master, master this)

    if isinstance(optimizer, SplitOptimizer):
        return set().union(*map(owned_parameters, optimizer.parts))
    masters = getattr(optimizer, "masters", None)
    if masters is not None:
        return set(masters)
    local = local_optimizer(optimizer)
    return {id(p) for g in local.param_groups for p in g["params"]}


def optimizer_state_tensors(optimizer: Any) -> list[Tensor]:
    """Every tensor of this rank's optimizer state (`MasterWeights`: the masters that are
    copies too)."""
    from hybridpar.optim.split import SplitOptimizer

    if isinstance(optimizer, SplitOptimizer):
        return [t for part in optimizer.parts for t in optimizer_state_tensors(part)]
    local = local_optimizer(optimizer)
    masters = optimizer.copies() if hasattr(optimizer, "copies") else []
    return [*masters, *(t for s in local.state.values() for t in s.values()
                        if isinstance(t, Tensor))]
