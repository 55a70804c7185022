"""torchshard's API at its own paths, on hybridpar: ``import hybridpar.torchshard as ts``.

torchshard code ports by changing its import; ``ts.distributed.init_process_group(
group_size=n)`` makes the model-parallel group hybridpar's tp group. Where torchshard differs
from plain torch, hybridpar follows torch (docs/torchshard.md lists each difference).
"""

from __future__ import annotations

from torch import Tensor

from hybridpar import nn
from hybridpar.sharded.attrs import (
    ORDER_TYPE_ATTR,
    PARALLEL_DIM_ATTR,
    get_parallel_dim,
    register_parallel_attribute,
    register_parallel_dim,
)
from hybridpar.tensor_parallel.state import (
    collect_state_dict,
    register_ddp_parameters_to_ignore,
    relocate_state_dict,
    slice,
)
from hybridpar.torchshard import distributed, utils

__version__ = "0.1.0"   # the torchshard API this module follows

__all__ = ["_ORDER_ATTR", "_PARALLEL_DIM", "collect_state_dict", "distributed",
           "get_parallel_dim", "nn", "register_ddp_parameters_to_ignore",
           "register_parallel_attribute", "register_parallel_dim", "relocate_state_dict",
           "set_attribute", "slice", "utils"]

_PARALLEL_DIM = PARALLEL_DIM_ATTR   # "parallel_dim": the attribute torchshard code reads
_ORDER_ATTR = ORDER_TYPE_ATTR       # "order_type"


def set_attribute(tensor: Tensor, value: int | None = None, order_type: int = 0) -> None:
    """torchshard's helper: set both attributes of `tensor`."""
    setattr(tensor, _PARALLEL_DIM, value)
    setattr(tensor, _ORDER_ATTR, order_type)
