"""The heads and parts of a column's output: fused parts (q | k | v) and per-head parameters.

**Fused parts.** The full run (`learn`, `finish`) learns a layer's heads from each part's
first reshape ``(*, F) -> (*, n, d)``, and its parts from how its output is first cut along
the last dim:

    cut                                        parts                       example
    one op: split / chunk / unbind ...         its outputs' widths         GPT-2's c_attn.split
    indexing ``y[..., a:b]`` (several ops)     the slices, when they tile  Phi-3's qkv_proj:
                                               the whole width              [:q] [q:q+kv] [q+kv:]

Equal widths are ``k`` parts, others their widths (`fused.Fused`). A fused column keeps its
slice of every part ([q_r | k_r | v_r]); in the simulated run the same cut, computed by the
forward from the attention's divided head counts (`flow.head_attributes`), must take whole
parts of the shard: then each part is a plain shard.

**Per-head parameters:** a replicated parameter that meets a shard split by heads is split too.

A parameter shaped by heads (Cohere's per-head q / k LayerNorm weight (heads, head_dim))
multiplies or adds to the attention's activations head by head.
When the column before it is sharded by head, a rank holds heads [r H / tp, (r + 1) H / tp)
and the full parameter no longer broadcasts against its shard:

    op (elementwise)          shard                  parameter     on rank r
    q_norm: weight * x        (B, T, H / tp, D) dim 2  (H, D)        weight[r H / tp : ...]
                                                                     (dim 0, H / tp rows)

    sinks: lse - s.view(1,-1,1)  (B, H / tp, T) dim 1     (H,)          sinks[r H / tp : ...]
                                                                     (dim 0, viewed: dim 1)

A tensor computed from one parameter alone, of the parameter's own shape up to dims of size 1
(a view that adds or drops them: GraniteSWA's attention sinks (heads,) viewed as
(1, heads, 1)), whose dim aligned (broadcasting from the right) with the shard's sharded dim
has the full size there, is the parameter sliced along the matching dim: the simulated run
passes the slice in its place and notes `Run.sliced` {parameter: (its dim, the columns of
the shards it met)}. Not followed: any other reshape (its column stays replicated, the failed
op named). Each rank's gradient is then that of its own slice (not a partial sum over tp, as
a replicated parameter used on a shard would have); `plan.shard_per_head` cuts the parameter
so.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from torch import Tensor
from torch.utils._pytree import tree_map

from hybridpar.tensor_parallel.fused import Fused, local_ranges, part_count, part_sizes

__all__ = ["cut_per_head", "finish", "fused_of_cut", "last_dim_slice", "learn",
           "note_reduction", "reduction_over_shard", "takes_a_part", "tiled_parts"]


# fused parts ----------------------------------------------------------------------------------
def last_dim_slice(index: Any, x: Tensor) -> tuple[int, int] | None:
    """The ``[start, stop)`` that ``x[index]`` takes of the last dim of `x` when it keeps every
    other dim whole (``x[..., a:b]``, ``x[:, :, a:b]``); None for any other index."""
    items = index if isinstance(index, tuple) else (index,)
    if not items or not isinstance(items[-1], slice):
        return None
    rest = items[:-1]
    whole = [i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in rest]
    if not all(whole) or (Ellipsis not in rest and len(items) != x.dim()):
        return None
    start, stop, step = items[-1].indices(int(x.shape[-1]))
    return (start, stop) if step == 1 and stop > start else None


def fused_of_cut(widths: list[int], total: int) -> Fused | None:
    """A layer's parts from the widths of one op's outputs along its last dim (None: the op
    does not cut the whole width in parts)."""
    if len(widths) < 2 or sum(widths) != total:
        return None
    return len(widths) if len(set(widths)) == 1 else tuple(widths)


def tiled_parts(slices: Mapping[tuple[int, int], object], total: int) -> Fused | None:
    """A layer's parts from the slices indexing took of its output, when they tile
    ``[0, total)`` end to end (None otherwise)."""
    ranges = sorted(slices)
    if len(ranges) < 2 or ranges[0][0] != 0 or ranges[-1][1] != total or \
            any(a[1] != b[0] for a, b in itertools.pairwise(ranges)):
        return None
    return fused_of_cut([b - a for a, b in ranges], total)


def takes_a_part(fused: Fused, index: Any, x: Tensor, tp: int) -> bool:
    """Whether ``x[index]`` on a fused shard `x` (its last dim) takes exactly one part."""
    rng = last_dim_slice(index, x)
    return part_count(fused) > 1 and rng is not None and \
        rng in local_ranges(part_sizes(fused, int(x.shape[-1]) * tp), tp)


def learn(run: Any, name: str, args: tuple[Any, ...], x: Tensor, outs: list[Tensor],
          dim: Any) -> None:
    """The full `run` (`flow_ops.Run`): what op `name` on `x`, a layer's output or one of its
    parts (`run.direct`), says of the layer's parts and heads; `dim`: a slicing op's dim."""
    layer, part = run.direct[id(x)]
    last = x.dim() - 1
    parts: list[Tensor] = []
    if dim is not None and part is None and len(outs) > 1:
        fused = fused_of_cut([int(t.shape[-1]) for t in outs], int(x.shape[-1]))
        if isinstance(dim, int) and dim % x.dim() == last and fused is not None:
            run.trace.fused.setdefault(layer, fused)
            parts = outs
    elif name == "__getitem__" and part is None and len(args) > 1 and len(outs) == 1:
        cut = last_dim_slice(args[1], x)
        if cut is not None:
            run.cuts.setdefault(layer, {})[cut] = int(x.shape[-1])
            parts = outs
    elif name in ("view", "reshape", "unflatten") and len(outs) == 1:
        y = outs[0]
        if y.dim() == x.dim() + 1 and tuple(y.shape[:last]) == tuple(x.shape[:last]) and \
                y.shape[-2] * y.shape[-1] == x.shape[-1]:
            run.trace.heads.setdefault(layer, (int(y.shape[-2]), int(y.shape[-1])))
            run.trace.counts.setdefault(layer, set()).add(int(y.shape[-2]))
    for i, t in enumerate(parts):
        run.direct[id(t)] = (layer, i)
        run.keep.append(t)


def finish(run: Any) -> None:
    """After the full `run`: the layers whose output indexing cut into parts end to end."""
    for layer, cuts in run.cuts.items():
        fused = tiled_parts(cuts, next(iter(cuts.values())))
        if fused is not None:
            run.trace.fused.setdefault(layer, fused)


# per-head parameters -------------------------------------------------------------------------
# ops that broadcast their tensor arguments elementwise (also their in-place / reflected forms)
_BROADCAST = frozenset({"mul", "add", "sub", "div", "true_divide", "truediv", "rsub", "radd",
                        "rmul", "rtruediv", "where", "addcmul", "addcdiv", "lerp", "maximum",
                        "minimum"})


def _param_dim(view: tuple[int, ...], j: int, shape: tuple[int, ...]) -> int | None:
    """The dim of a parameter of `shape` that dim `j` of `view` is, when `view` is the
    parameter with dims of size 1 added or dropped (else None)."""
    if [n for n in view if n != 1] != [n for n in shape if n != 1]:
        return None
    k = sum(1 for n in view[:j] if n != 1)   # the non-1 dims before j: the same in both
    return [i for i, n in enumerate(shape) if n != 1][k]


def cut_per_head(run: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                 ins: list[Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """`args` / `kwargs` of an op of the simulated `run` (`flow_ops.Run`) with each per-head
    parameter replaced by this rank's slice (see the module docstring)."""
    if name.strip("_") not in _BROADCAST:
        return args, kwargs
    x = next(t for t in ins if id(t) in run.shard)
    s = run.shard[id(x)]
    full = int(x.shape[s.dim]) * run.tp
    cuts: dict[int, Tensor] = {}
    for t in ins:
        owners = run.derived.get(id(t), ())
        if id(t) in run.shard or id(t) in run.data or len(owners) != 1:
            continue
        (param,) = owners
        j = t.dim() - (x.dim() - s.dim)
        shape = run.param_shapes.get(param)
        if shape is None or not 0 <= j < t.dim() or t.shape[j] != full:
            continue
        k = _param_dim(tuple(t.shape), j, shape)
        # a dim the tags can name: 0, 1 or the last (`attrs.register_parallel_attribute`)
        if k is None or k not in (0, 1, len(shape) - 1):
            continue
        dim, met = run.sliced.setdefault(param, (k, set()))
        if dim != k:
            run.fault(s.sources, f"'{param}' meets shards split by head along its dims {dim} "
                                 f"and {k}")
            continue
        met.update(s.sources)
        cuts[id(t)] = t.narrow(j, 0, full // run.tp)
        run.keep.append(cuts[id(t)])
    if not cuts:
        return args, kwargs
    return tree_map(lambda a: cuts.get(id(a), a) if isinstance(a, Tensor) else a, (args, kwargs))


# distributed norms -----------------------------------------------------------------------------
def _last_dim_reduction(name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                        x: Tensor) -> bool:
    """Whether op `name` is a mean / sum of `x` over its last dim (and no other)."""
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    return name in ("mean", "sum") and isinstance(dim, int) and x.dim() > 0 and \
        dim % x.dim() == x.dim() - 1


def reduction_over_shard(run: Any, name: str, args: tuple[Any, ...],
                         kwargs: Mapping[str, Any], x: Tensor) -> bool:
    """Simulated `run`: whether op `name`, reducing the shard `x` over its features, is a
    mean / sum over its last dim in a leaf module, which `tensor_parallel.reduction` sums over
    tp (OLMo 2's q / k RMSNorm over the whole projection); noted in `run.reduced`."""
    s = run.shard.get(id(x))
    module = run.stack[-1] if run.stack else None
    if s is None or module not in run.leaves or s.dim != x.dim() - 1 or \
            part_count(s.fused) > 1 or not _last_dim_reduction(name, args, kwargs, x):
        return False
    run.reduced.setdefault(module, set()).update(s.sources)
    return True


def note_reduction(run: Any, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                   ins: list[Tensor], shards: list[Any]) -> None:
    """Simulated `run`, an op on no shard (`shards` empty): a mean / sum over the last dim of
    a full tensor in a module (`run.whole_reduced`: its reductions cannot all be summed over
    tp)."""
    if not shards and run.stack and ins and _last_dim_reduction(name, args, kwargs, ins[0]):
        run.whole_reduced.add(run.stack[-1])
