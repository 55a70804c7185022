"""Per-head parameters: a replicated parameter that meets a shard split by heads is split too.

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

from typing import Any

from torch import Tensor
from torch.utils._pytree import tree_map

__all__ = ["cut_per_head"]

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
