"""shard_init_helper_: initialize a parameter shard as the slice of an initialized full tensor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar.tensor_parallel.attrs import tensor_shard_dim
from hybridpar.tensor_parallel.state import full_shape, shard_of

__all__ = ["shard_init_helper_"]


def shard_init_helper_(init_method: Callable[..., Any], tensor: Tensor, *,
                       group: ProcessGroup | None = None, **kwargs: Any) -> Tensor:
    """Initialize `tensor` in place with ``init_method(full, **kwargs)`` sliced to this rank.

    For a sharded tensor (tagged by a parallel layer) the FULL tensor is built and
    initialized, consuming the RNG exactly as on one device, and this rank's slice is copied
    in; so fans (kaiming, xavier) are those of the full layer and, when every rank holds the
    same RNG state (the same `torch.manual_seed`), the shards together form the one-device
    tensor. An untagged tensor is initialized directly. `group` is the tp group the tensor is
    sharded over (default: `hybridpar.init`'s). A meta tensor is left as it is.

        >>> m = ParallelLinear(20, 30, dim=-1)
        >>> shard_init_helper_(torch.nn.init.kaiming_normal_, m.weight, mode="fan_in")
    """
    if tensor.is_meta:
        return tensor
    if tensor_shard_dim(tensor) is None:
        with torch.no_grad():
            init_method(tensor, **kwargs)
        return tensor
    full = torch.empty(full_shape(tensor, group), dtype=tensor.dtype, device=tensor.device)
    with torch.no_grad():
        init_method(full, **kwargs)
        tensor.copy_(shard_of(full, tensor, group))
    return tensor
