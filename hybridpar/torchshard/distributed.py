"""torchshard's ``distributed``: its model-parallel group, as `hybridpar.init(tp=n)`'s.

    torchshard                                   here
    init_process_group(group_size=n)             hybridpar.init(tp=n) on the existing world
    destroy_process_group()                      forget the topology (the world stays)
    get_group / get_group_size / get_rank        the tp group, its size, this rank in it
    get_world_size                               torch.distributed's world size (as torchshard)
    copy / reduce / scatter / gather             differentiable: identity / all-reduce, its
                                                 dual; split / all-gather along `dim`
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar import topology
from hybridpar.sharded.attrs import register_parallel_dim
from hybridpar.sharded.mappings import (
    all_gather_along,
    copy_to_group,
    gather_from_group,
    reduce_from_group,
    scatter_to_group,
    split_along,
)

__all__ = ["copy", "destroy_process_group", "gather", "get_group", "get_group_size", "get_rank",
           "get_world_size", "init_process_group", "is_initialized", "reduce", "scatter"]


def is_initialized() -> bool:
    """Whether a model-parallel group exists (`init_process_group` or `hybridpar.init`)."""
    try:
        topology.current_topology()
    except RuntimeError:
        return False
    return True


def init_process_group(group_size: int = -1) -> None:
    """Model-parallel groups of `group_size` consecutive ranks of the initialized world."""
    if not dist.is_initialized():
        raise RuntimeError("the default process group is not initialized: call "
                           "torch.distributed.init_process_group first (or hybridpar.init)")
    world = dist.get_world_size()
    if group_size < 1:
        raise ValueError(f"group_size must be in [1, world_size={world}], got {group_size}")
    size = min(group_size, world)
    if world % size:
        raise ValueError(f"world size {world} is not divisible by group_size {size}")
    topology.init(tp=size)


def destroy_process_group() -> None:
    """Forget the model-parallel group (the default process group stays)."""
    topology.forget()


def get_group() -> ProcessGroup:
    """The model-parallel (tp) group."""
    return topology.current_topology().tp_group


def get_world_size() -> int:
    """The world size of the default group (torchshard's meaning)."""
    return dist.get_world_size()


def get_group_size() -> int:
    """The size of the model-parallel group."""
    return topology.current_topology().tp


def get_rank() -> int:
    """This rank in the model-parallel group."""
    return dist.get_rank(group=get_group())


def copy(input: Tensor) -> Tensor:
    """Identity forward, all-reduce of the gradient backward."""
    return copy_to_group(input, get_group())


def reduce(input: Tensor) -> Tensor:
    """All-reduce forward, identity backward."""
    return reduce_from_group(input, get_group())


def scatter(input: Tensor, dim: int = -1) -> Tensor:
    """This rank's slice along `dim` (tagged with `dim`); all-gather of the gradient."""
    out = scatter_to_group(input, get_group(), dim=dim)
    register_parallel_dim(out, dim)
    return out


def gather(input: Tensor, dim: int = -1) -> Tensor:
    """All-gather along `dim` (tagged with `dim`); this rank's slice of the gradient."""
    out = gather_from_group(input, get_group(), dim=dim)
    register_parallel_dim(out, dim)
    return out


def _reduce(tensor: Tensor) -> Tensor:
    """All-reduce, not differentiable."""
    out = tensor.clone()
    dist.all_reduce(out, group=get_group())
    return out


def _split(tensor: Tensor, dim: int = -1) -> Tensor:
    """This rank's slice along `dim`, not differentiable."""
    return split_along(tensor, dim, get_group())


def _gather(tensor: Tensor, dim: int = -1) -> Tensor:
    """All-gather along `dim`, not differentiable."""
    return all_gather_along(tensor, dim, get_group())
