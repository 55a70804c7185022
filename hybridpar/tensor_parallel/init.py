"""shard_init_helper_: initialize a parameter shard as the slice of an initialized full tensor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar.sharded.attrs import tensor_shard_dim
from hybridpar.sharded.mappings import group_size
from hybridpar.tensor_parallel.state import full_shape, shard_of
from hybridpar.topology import default_tp_group

__all__ = ["shard_init_helper_"]


def shard_init_helper_(init_method: Callable[..., Any], tensor: Tensor, *,
                       group: ProcessGroup | None = None, **kwargs: Any) -> Tensor:
    """Initialize `tensor` in place with ``init_method(full, **kwargs)`` sliced to this rank.

    For a sharded tensor (tagged by a parallel layer) the FULL tensor is built and
    initialized, consuming the RNG exactly as on one device, and this rank's slice is copied
    in; so fans (kaiming, xavier) are those of the full layer. The tp group's first rank
    initializes and broadcasts the full tensor (a replicated one too), as torchshard does,
    so the shards form one tensor and replicas agree whatever each rank's seed. `group` is
    the tp group (default: `hybridpar.init`'s); every rank of it must call this together.
    Without a process group, or on one rank, nothing is sent. A meta tensor is left as it is.

        >>> m = ParallelLinear(20, 30, dim=-1)
        >>> shard_init_helper_(torch.nn.init.kaiming_normal_, m.weight, mode="fan_in")
    """
    if tensor.is_meta:
        return tensor
    sharded = tensor_shard_dim(tensor) is not None
    g = _group(group)
    full = torch.empty(full_shape(tensor, g) if sharded else tensor.shape, dtype=tensor.dtype,
                       device=tensor.device)
    with torch.no_grad():
        init_method(full, **kwargs)
        if g is not None and group_size(g) > 1:
            dist.broadcast(full, dist.get_global_rank(g, 0), group=g)
        tensor.copy_(shard_of(full, tensor, g) if sharded else full)
    return tensor


def _group(group: ProcessGroup | None) -> ProcessGroup | None:
    """`group`, else the current topology's tp group, else None (no process group)."""
    if group is not None:
        return group
    if not dist.is_initialized():
        return None
    try:
        return default_tp_group()
    except RuntimeError:   # torch.distributed without hybridpar.init: nothing to agree with
        return None
