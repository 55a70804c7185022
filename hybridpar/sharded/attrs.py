"""Parallel-dim attributes on tensors: which dim of a tensor is sharded over the tp group.

An activation or parameter may carry two Python attributes (torchshard's convention):

    attribute           values          meaning
    parallel_dim        None, 0, 1, -1  the layer dim it is sharded on (None: replicated);
                        -2 (SEQUENCE)   an activation (*, T / tp, C) sharded on its tokens
                                        (sequence parallelism)
    tp_partial_grad     True            (a replicated parameter) it is used on a shard, so a
                                        rank's gradient is its shard's part: HybridPipe sums
                                        it over the tp group after each step
    order_type          0, 1            how that dim maps to the tensor's dims:
                                        0: reversed  (a Linear weight (out, in) is read as
                                           (in, out): parallel dim -1 = tensor dim 0)
                                        1: as is     (an Embedding weight (num, dim))

Activations use order 1. Elementwise ops lose the attributes (they live on the Python object);
re-tag with `register_parallel_dim` or `RegisterParallelDim`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import Tensor, nn

__all__ = [
    "EXPERT_SHARD_ATTR",
    "FULL_SHAPE_ATTR",
    "ORDER_TYPE_ATTR",
    "PARALLEL_DIM_ATTR",
    "PARTIAL_GRAD_ATTR",
    "SEQUENCE",
    "expert_slice",
    "get_order_type",
    "get_parallel_dim",
    "has_partial_grad",
    "is_expert_shard",
    "is_sharded_layer",
    "register_expert_shard",
    "register_parallel_attribute",
    "register_parallel_dim",
    "register_partial_grad",
    "tags_kept",
    "tensor_shard_dim",
]

PARALLEL_DIM_ATTR = "parallel_dim"   # torchshard's names: code written for it reads them
ORDER_TYPE_ATTR = "order_type"
PARTIAL_GRAD_ATTR = "tp_partial_grad"
SHARDED_LAYER_ATTR = "tp_sharded_layer"   # a class attribute of the tp layers (ParallelLayer)
SEQUENCE = -2   # an activation sharded on its sequence dim, (*, T / tp, C): never a layer dim
FULL_SHAPE_ATTR = "_FULL_SHAPE"   # a sharded tensor's full shape (`tensor_parallel.state`)
# what `tags_kept` carries over (not the attributes other libraries set on parameters)
_TAGS = (PARALLEL_DIM_ATTR, ORDER_TYPE_ATTR, PARTIAL_GRAD_ATTR, FULL_SHAPE_ATTR,
         "hybridpar_expert_shard")
_VALID_DIMS = (None, 0, 1, -1, SEQUENCE)


def _check_dim(parallel_dim: int | None) -> None:
    if parallel_dim not in _VALID_DIMS:
        raise ValueError(
            f"parallel dim must be one of None, 0, 1, -1, -2, got {parallel_dim!r} "
            "(None: replicated, 0: row / vocab, 1 or -1: column / feature, -2: the sequence "
            "of an activation)"
        )


def get_parallel_dim(tensor: Tensor) -> int | None:
    """The parallel dim registered on `tensor` (None when it is not sharded)."""
    return getattr(tensor, PARALLEL_DIM_ATTR, None)


def get_order_type(tensor: Tensor) -> int:
    """The order type registered on `tensor` (1 when none is)."""
    return getattr(tensor, ORDER_TYPE_ATTR, 1)


def register_parallel_dim(tensor: Tensor, parallel_dim: int | None = None, *,
                          value: int | None = None) -> None:
    """Tag `tensor` as sharded on `parallel_dim` (in place); None: replicated.

    ``value=`` is torchshard's name for the same argument (``register_parallel_dim(t,
    value=0)``); give one of the two.
    """
    if value is not None:
        if parallel_dim is not None and parallel_dim != value:
            raise ValueError(f"register_parallel_dim got parallel_dim={parallel_dim} and "
                             f"value={value}; give one of them")
        parallel_dim = value
    _check_dim(parallel_dim)
    setattr(tensor, PARALLEL_DIM_ATTR, parallel_dim)


def register_parallel_attribute(tensor: Tensor, parallel_dim: int | None,
                                order_type: int = 0) -> None:
    """Tag `tensor` with a parallel dim and an order type (0 reversed, 1 as is), in place."""
    _check_dim(parallel_dim)
    if order_type not in (0, 1):
        raise ValueError(f"order_type must be 0 (reversed) or 1 (as is), got {order_type!r}")
    setattr(tensor, PARALLEL_DIM_ATTR, parallel_dim)
    setattr(tensor, ORDER_TYPE_ATTR, order_type)


def tensor_shard_dim(tensor: Tensor) -> int | None:
    """The dim of `tensor` itself that is sharded, from its parallel dim and order type."""
    parallel_dim = get_parallel_dim(tensor)
    if parallel_dim is None:
        return None
    ndim = tensor.dim()
    if ndim == 0:
        return None
    dim = parallel_dim % ndim
    if get_order_type(tensor) == 0:
        dim = ndim - 1 - dim
    return dim


def register_partial_grad(param: Tensor) -> None:
    """Mark a replicated parameter used on a tp shard (a norm weight over sharded heads, a
    scale of a sharded activation): its gradient on each rank is a part, summed over tp."""
    if get_parallel_dim(param) is not None:
        raise ValueError("register_partial_grad is for replicated parameters; this one is "
                         f"sharded (parallel dim {get_parallel_dim(param)})")
    setattr(param, PARTIAL_GRAD_ATTR, True)


def has_partial_grad(param: Tensor) -> bool:
    """Whether `param` is marked by `register_partial_grad`."""
    return bool(getattr(param, PARTIAL_GRAD_ATTR, False))


#: on a parameter that holds a slice, along dim 0, of a layer's experts (expert parallelism):
#: (ep rank, ep); its gradient is summed over the dp ranks holding the same experts, not
#: averaged over dp
EXPERT_SHARD_ATTR = _TAGS[-1]


def register_expert_shard(param: Tensor, *, rank: int, ep: int) -> None:
    """Mark `param` as ep rank `rank`'s slice (of ep equal ones) of the experts, along dim 0."""
    setattr(param, EXPERT_SHARD_ATTR, (rank, ep))


def is_expert_shard(param: Tensor) -> bool:
    """Whether `param` is marked by `register_expert_shard`."""
    return expert_slice(param) is not None


def expert_slice(param: Tensor) -> tuple[int, int] | None:
    """``(first expert, experts in the layer)`` of a `register_expert_shard` slice (its
    ``shape[0]`` experts from the first), else None."""
    mark = getattr(param, EXPERT_SHARD_ATTR, None)
    if mark is None:
        return None
    rank, ep = mark
    return rank * param.shape[0], ep * param.shape[0]


def is_sharded_layer(module: nn.Module) -> bool:
    """Whether `module` is a tp layer (`tensor_parallel.base.ParallelLayer` says so), told
    without importing tensor parallelism (the pipeline's materialization asks)."""
    return bool(getattr(type(module), SHARDED_LAYER_ATTR, False))


@contextlib.contextmanager
def tags_kept(module: nn.Module) -> Iterator[None]:
    """Inside, `module` may put new Parameter objects in (``to_empty`` from `meta`, ``.to``
    another device); after, each has the tags (parallel dim, order type, partial gradient,
    full shape, expert shard) of the one it replaced, and nothing else: a Hugging Face flag such as
    ``_is_hf_initialized`` stays behind with the old one. The tp layers re-tag their own;
    this keeps those of a parameter a plan cut in a module of any class
    (`plan.shard_per_head`)."""
    saved = {(id(m), key): {a: getattr(p, a) for a in _TAGS if hasattr(p, a)}
             for m in module.modules() for key, p in m._parameters.items() if p is not None}
    yield
    for m in module.modules():
        for key, p in m._parameters.items():
            for attr, value in saved.get((id(m), key), {}).items():
                if p is not None and not hasattr(p, attr):
                    setattr(p, attr, value)
