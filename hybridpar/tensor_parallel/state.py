"""Sharded parameters and state dicts: full shapes, slicing, collect / relocate, DDP ignore list.

A sharded parameter carries its tags (`attrs`: parallel dim, order type) and its full shape
(`FULL_SHAPE_ATTR`); from those, any rank finds which slice of the full tensor it holds:

    param                           tensor dim   full shape   rank r of tp holds
    column Linear weight (-1, 0)    0            (out, in)    rows    shard_range(out, tp, r)
    row    Linear weight ( 0, 0)    1            (out, in)    columns shard_range(in, tp, r)
    vocab  Embedding     ( 0, 1)    0            (V, D)       rows    shard_range(V, tp, r)

`shard_ranges` gives that slice as ranges of the full tensor (one, or one per part of a fused
weight), which `shard_of` cuts from a full tensor and a checkpoint reader reads from a file.
`collect_state_dict` all-gathers every sharded entry (every rank gets full tensors, as a
one-device model would save them); `relocate_state_dict` keeps this rank's slice of each, for
any tp size, so a dict collected at tp=2 loads into a tp=4 or a tp=1 model.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.sharded.attrs import FULL_SHAPE_ATTR, tensor_shard_dim
from hybridpar.sharded.mappings import (
    all_gather_along,
    group_rank,
    group_size,
    shard_range,
    shard_sizes,
)
from hybridpar.tensor_parallel.fused import (
    fused_gather_full,
    fused_parts,
    fused_ranges,
    fused_sizes,
)
from hybridpar.topology import default_tp_group

__all__ = [
    "FULL_SHAPE_ATTR",
    "ShardRanges",
    "collect_state_dict",
    "full_shape",
    "gather_full",
    "module_group",
    "register_ddp_parameters_to_ignore",
    "register_full_shape",
    "relocate_state_dict",
    "shard_of",
    "shard_ranges",
    "sharded_parameters",
    "slice",
]


def slice(tensor: Tensor, num_partitions: int, dim: int | None = None,
          contiguous: bool = False) -> tuple[Tensor, ...]:
    """Split `tensor` into `num_partitions` pieces along `dim` (default: the last dim).

    As `torch.split`; a length that does not divide gives the first ``length % n`` pieces one
    more element (`mappings.shard_sizes`), the same split the parallel layers use.
    """
    if not isinstance(num_partitions, int) or num_partitions < 1:
        raise ValueError(f"num_partitions must be a positive integer, got {num_partitions!r}")
    dim = -1 if dim is None else dim
    pieces = torch.split(tensor, shard_sizes(tensor.shape[dim], num_partitions), dim=dim)
    if contiguous:
        return tuple(p.contiguous() for p in pieces)
    return tuple(pieces)


# one parameter ------------------------------------------------------------------------------

def register_full_shape(tensor: Tensor, shape: Sequence[int]) -> None:
    """Remember the full (unsharded) shape of `tensor` (in place)."""
    setattr(tensor, FULL_SHAPE_ATTR, tuple(int(s) for s in shape))


def _resolve(group: ProcessGroup | None) -> ProcessGroup:
    return group if group is not None else default_tp_group()


def full_shape(param: Tensor, group: ProcessGroup | None = None) -> torch.Size:
    """The full shape of `param`: its registered one, else its shard dim times the tp size."""
    shape = getattr(param, FULL_SHAPE_ATTR, None)
    if shape is not None:
        return torch.Size(shape)
    dim = tensor_shard_dim(param)
    if dim is None:
        return param.shape
    sizes = list(param.shape)
    sizes[dim] *= group_size(_resolve(group))
    return torch.Size(sizes)


class ShardRanges(NamedTuple):
    """Where a rank's slice of a sharded parameter lies in the full tensor: along tensor dim
    `dim`, the ``[start, stop)`` `ranges`, concatenated in order."""

    dim: int
    ranges: list[tuple[int, int]]


def shard_ranges(param: Tensor, group: ProcessGroup | None = None) -> ShardRanges | None:
    """This rank's slice of the full tensor of the sharded `param`, as ranges (None: `param`
    is not sharded). L = the full length of the shard dim, tp ranks, this rank r:

        param                        ranges
        plain                        [shard_range(L, tp, r)]   (the first L % tp ranks get
                                                                one more: uneven vocab)
        fused (q | k | v)            `fused_ranges(sizes, tp, r)`: the r-th of tp in each part

    `shard_of` cuts these from a full tensor; `hybridpar.hf.load_hf_shards` reads them from
    a file (one read per range), so the two cannot disagree.
    """
    dim = tensor_shard_dim(param)
    if dim is None:
        return None
    g = _resolve(group)
    length, tp, rank = full_shape(param, g)[dim], group_size(g), group_rank(g)
    if fused_parts(param) > 1:
        return ShardRanges(dim, fused_ranges(fused_sizes(param), tp, rank))
    return ShardRanges(dim, [shard_range(length, tp, rank)])


def shard_of(full_tensor: Tensor, param: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """This rank's slice of `full_tensor` for the sharded `param` (a new, detached tensor).

    `full_tensor` is returned as is when `param` is not sharded. `group` defaults to the
    default tp group (`hybridpar.init`). The slice is `shard_ranges` of `param`.
    """
    where = shard_ranges(param, group)
    if where is None:
        return full_tensor
    expected = full_shape(param, _resolve(group))
    if full_tensor.shape != expected:
        raise ValueError(f"expected a full tensor of shape {tuple(expected)}, got "
                         f"{tuple(full_tensor.shape)}")
    dim, ranges = where
    pieces = [full_tensor.detach().narrow(dim, a, b - a) for a, b in ranges]
    if len(pieces) == 1:
        return pieces[0].clone(memory_format=torch.contiguous_format)
    return torch.cat(pieces, dim)


def gather_full(tensor: Tensor, param: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """All-gather the shards `tensor` (shaped like `param`) into the full tensor (detached).

    A collective over the tp group: every rank of it must call it. Unsharded: returned as is.
    """
    dim = tensor_shard_dim(param)
    if dim is None:
        return tensor
    if tensor.shape != param.shape:
        raise ValueError(f"expected a shard of shape {tuple(param.shape)}, got "
                         f"{tuple(tensor.shape)} (is it already full?)")
    g = _resolve(group)
    if fused_parts(param) > 1:   # q | k | v: gathered part by part
        return fused_gather_full(tensor, param, g)
    with torch.no_grad():
        return all_gather_along(tensor.detach(), dim, g, length=full_shape(param, g)[dim])


# a module -----------------------------------------------------------------------------------

def module_group(module: nn.Module) -> ProcessGroup | None:
    """The tp group a module's parameters are sharded over (its ``group``; None: default)."""
    group = getattr(module, "group", None)
    return group if isinstance(group, ProcessGroup) else None


def sharded_parameters(model: nn.Module
                       ) -> Iterator[tuple[str, nn.Parameter, ProcessGroup | None]]:
    """``(name, param, group)`` for every sharded parameter, under every name it has."""
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(recurse=False):
            if tensor_shard_dim(param) is not None:
                yield (f"{mod_name}.{name}" if mod_name else name), param, module_group(module)


def _sharded_by_key(model: nn.Module, prefix: str
                    ) -> dict[str, tuple[nn.Parameter, ProcessGroup | None]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    return {prefix + name: (p, g) for name, p, g in sharded_parameters(model)}


def _like(source: Mapping[str, object], out: OrderedDict[str, object]) -> OrderedDict[str, object]:
    metadata = getattr(source, "_metadata", None)  # load_state_dict reads module versions there
    if metadata is not None:
        out._metadata = metadata  # type: ignore[attr-defined]
    return out


def collect_state_dict(model: nn.Module, state_dict: Mapping[str, object], prefix: str = ''
                       ) -> OrderedDict[str, object]:
    """A copy of `state_dict` where every sharded parameter is the full tensor, on every rank.

    `state_dict` comes from ``model.state_dict()`` (or of a parent module: then `prefix` is
    the model's prefix in it, e.g. ``"encoder."``; other keys pass through). The tags live on
    the model's Parameters, so detached copies are fine. A collective over the tp group(s).
    """
    sharded = _sharded_by_key(model, prefix)
    out: OrderedDict[str, object] = OrderedDict()
    for key, value in state_dict.items():
        entry = sharded.get(key)
        if entry is not None and isinstance(value, Tensor):
            value = gather_full(value, entry[0], entry[1])
        out[key] = value
    return _like(state_dict, out)


def relocate_state_dict(model: nn.Module, state_dict: Mapping[str, object], prefix: str = ''
                        ) -> OrderedDict[str, object]:
    """A copy of a full `state_dict` where every sharded parameter is this rank's slice.

    Works for any tp size of `model`, whatever tp the dict was collected at; then
    ``model.load_state_dict(...)``. No communication.
    """
    sharded = _sharded_by_key(model, prefix)
    out: OrderedDict[str, object] = OrderedDict()
    for key, value in state_dict.items():
        entry = sharded.get(key)
        if entry is not None and isinstance(value, Tensor):
            param, group = entry
            expected = full_shape(param, group)
            if value.shape != expected:
                raise ValueError(
                    f"state_dict[{key!r}] has shape {tuple(value.shape)} but the full "
                    f"parameter has shape {tuple(expected)}; relocate_state_dict takes full "
                    f"tensors: save with collect_state_dict(model, model.state_dict())"
                )
            value = shard_of(value, param, group)
        out[key] = value
    return _like(state_dict, out)


def register_ddp_parameters_to_ignore(module: nn.Module) -> list[str]:
    """Names of the sharded parameters, also added to ``module._ddp_params_and_buffers_to_ignore``.

    `torch.nn.parallel.DistributedDataParallel` reads that attribute: it neither broadcasts
    these parameters from rank 0 at start (which would overwrite every shard with rank 0's)
    nor averages their gradients. Only parameters whose values differ across tp ranks are
    listed: a `ParallelLinear(dim=None)` weight or the full bias of a row-parallel layer is
    the same on every tp rank, so DDP may keep handling it. Gradients of the listed ones must
    be averaged over the data-parallel group by the caller.
    """
    names = list(dict.fromkeys(name for name, _, _ in sharded_parameters(module)))
    existing = list(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    module._ddp_params_and_buffers_to_ignore = list(  # type: ignore[assignment]
        dict.fromkeys(existing + names))
    return names
