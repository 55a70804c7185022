"""shard: split parameters and inputs over tp by strategies (slices per dimension), as MindSpore.

A strategy has one entry per dimension of a tensor: how many slices that dimension is cut
into, 1 (whole) or the tp size, at most one dimension split:

    parameter              strategy   becomes                              output
    Linear weight (out, in)  (tp, 1)  ParallelLinear(dim=-1), column      gathered, or sharded
                                                                          into a row layer
                             (1, tp)  ParallelLinear(dim=0), row          (*, out) full
                             (1, 1)   left as it is                       (*, out)
    Linear bias (out,)       (tp,) with a (tp, 1) weight; (1,) with any other (it follows)
    Embedding weight (V, D)  (tp, 1)  ParallelEmbedding(dim=0), vocab     (*, D) full
                             (1, tp)  ParallelEmbedding(dim=-1), feature  (*, D) full
    any other parameter      (1, ...) left as it is

"Linear" / "Embedding" are `nn.Linear` / `nn.Embedding` or their `hybridpar.nn` forms with
dim=None. The module's outputs (and gradients) equal the unsharded module's. Between layers
that takes what a user would otherwise write by hand (DESIGN "tags travel"):

    column, then only elementwise modules, then    the shard flows on: the modules between are
    a row layer with in == column's out (siblings   hooked to re-tag it (nn.Dropout becomes
    in run order; nested nn.Sequential flattened)   ParallelDropout: one-device masks)
    column, then anything else (or nothing)        its output is all-gathered (full)
    row, fed a full input                          the row layer splits it itself

in_strategy has one entry per positional input (None or all ones: full). An input split on
its last dimension, into a module whose first layer (through nested nn.Sequential) is row-
parallel, is consumed as a shard; any other split is all-gathered first, its gradient sliced
back. Each rank passes its equal slice.

Errors (`ValueError`, before any change) name the parameter and the rule. A second shard of
a module, or of a part of one, is refused (no nested shard). The decisions are kept for
`plan.plan_decisions`; parameter names and state-dict keys do not change.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.sharded.attrs import register_parallel_dim
from hybridpar.sharded.mappings import gather_from_group, group_size
from hybridpar.tensor_parallel.layers import ParallelEmbedding, ParallelLinear
from hybridpar.tensor_parallel.plans.layer_graph import DECISIONS_ATTR, Layers
from hybridpar.tensor_parallel.plans.pairing import (
    RUN_ORDER,
    convert_layer,
    gather_unlinked,
    link_shards,
)
from hybridpar.topology import default_tp_group

__all__ = ["Strategy", "StrategyPlan", "apply_strategies", "prepare_strategies", "shard",
           "strategy_problem"]

Strategy = Sequence[int]
_MARK = "_hybridpar_shard"
_log = logging.getLogger("hybridpar")
_RULES = ("each entry is the number of slices of one dimension: 1 (whole) or the tp size, at "
          "most one dimension split")


def strategy_problem(strategy: Any, tp: int) -> str | None:
    """What is wrong with `strategy` at this tp size, without a tensor (None: nothing)."""
    if isinstance(strategy, str | bytes) or not isinstance(strategy, Sequence) or \
            not strategy or any(type(s) is not int for s in strategy):
        return (f"a strategy is a non-empty tuple of integers, one per dimension ({_RULES}), "
                f"got {strategy!r}")
    bad = [s for s in strategy if s not in (1, tp)]
    if bad:
        return (f"slices must be 1 (whole) or the tp size {tp}, got {bad[0]}; at tp={tp} give "
                f"{tp} for the split dimension and 1 for the others")
    split = [d for d, s in enumerate(strategy) if s > 1]
    if len(split) > 1:
        return (f"splits dimensions {split[0]} and {split[1]}, but at most one dimension of a "
                f"tensor may be split; keep one and give 1 for the others")
    return None


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _split_dim(strategy: Strategy | None) -> int | None:
    return next((d for d, s in enumerate(strategy or ()) if s > 1), None)


def _linear_like(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or (isinstance(m, ParallelLinear) and m.dim is None)


def _embedding_like(m: nn.Module) -> bool:
    return isinstance(m, nn.Embedding) or (isinstance(m, ParallelEmbedding) and m.dim is None)


def _describe(m: nn.Module) -> str:
    if _linear_like(m) or isinstance(m, ParallelLinear):
        return f"Linear {m.in_features}->{m.out_features}"
    if _embedding_like(m) or isinstance(m, ParallelEmbedding):
        return f"Embedding {m.num_embeddings}x{m.embedding_dim}"
    return type(m).__name__


# checking a plan (no change to the module) ------------------------------------------------------

@dataclass
class StrategyPlan:
    """What `shard` will do: the layers to split, how, and the inputs' strategies."""

    kinds: dict[str, str] = field(default_factory=dict)         # layer -> column|row|vocab|feature
    given: dict[str, list[str]] = field(default_factory=dict)   # layer -> "param (2, 1)" texts
    inputs: tuple[Strategy | None, ...] | None = None


def _fail(param: str, strategy: Any, rule: str) -> ValueError:
    shown = tuple(strategy) if isinstance(strategy, list | tuple) else repr(strategy)
    return ValueError(f"shard: parameter '{param}' strategy {shown}: {rule}")


def _check_nested(module: nn.Module, plan: Mapping[str, Any]) -> None:
    marked = [n for n, m in module.named_modules() if getattr(m, _MARK, False)]
    if not marked:
        return
    top = marked[0]
    inside = [str(p) for p in plan if not top or str(p).startswith(f"{top}.")] or \
        [n for n, _ in module.get_submodule(top).named_parameters(prefix=top)]
    where = f"'{top}'" if top else "the module"
    raise ValueError(f"shard: {where} (parameters {inside[:3]}) was already sharded by "
                     f"hybridpar.shard, and nested shard is not supported; call shard once, "
                     f"on the outer module, with every parameter's strategy")


def _check_parameter(name: str, strategy: Any, param: Tensor, owner: nn.Module,
                     why_not: str | None, tp: int) -> str | None:
    """The split kind the strategy gives `owner` for this parameter (None: replicated)."""
    attr = name.rpartition(".")[2]
    if isinstance(owner, ParallelLinear | ParallelEmbedding) and owner.dim is not None:
        raise _fail(name, strategy, f"its layer is already split over tp "
                    f"({type(owner).__name__}(dim={owner.dim})), and nested shard is not "
                    f"supported; leave it out of the plan or build the layer with dim=None")
    problem = strategy_problem(strategy, tp)
    if problem:
        raise _fail(name, strategy, problem)
    if len(strategy) != param.dim():
        raise _fail(name, strategy, f"has {_count(len(strategy), 'entry', 'entries')} but "
                    f"the parameter has {_count(param.dim(), 'dimension')} (shape "
                    f"{tuple(param.shape)}); give one entry per dimension")
    d = _split_dim(strategy)
    if d is None:
        return None
    if param.shape[d] % strategy[d]:
        raise _fail(name, strategy, f"dimension {d} of size {param.shape[d]} is not divisible "
                    f"into {strategy[d]} slices; choose a size that is a multiple of {tp}, or "
                    f"give 1 there to replicate")
    if not ((_linear_like(owner) and attr in ("weight", "bias")) or
            (_embedding_like(owner) and attr == "weight")):
        raise _fail(name, strategy, f"only the weight and bias of nn.Linear and the weight of "
                    f"nn.Embedding can be split, and it belongs to {type(owner).__name__}; "
                    f"give all ones to replicate it")
    if why_not is not None:
        raise _fail(name, strategy, f"its layer cannot be split: {why_not}; give all ones "
                    f"to replicate it")
    if _embedding_like(owner):
        if d == 1 and owner.max_norm is not None:
            raise _fail(name, strategy, "a feature split (1, tp) cannot renormalize rows "
                        "(max_norm needs whole rows); use (tp, 1), vocab-parallel")
        return "vocab" if d == 0 else "feature"
    return "column" if d == 0 else "row"


def prepare_strategies(module: nn.Module, parameter_plan: Mapping[str, Any] | None,
                       in_strategy: Sequence[Any] | None, tp: int) -> StrategyPlan:
    """Check the strategies against `module` at this tp size; raise `ValueError` if any fails."""
    plan = dict(parameter_plan or {})
    _check_nested(module, plan)
    params = dict(module.named_parameters(remove_duplicate=False))
    layers = Layers(module)
    out = StrategyPlan()
    weights: dict[str, tuple[str, str | None]] = {}   # layer -> (weight's name, kind)
    for name, strategy in plan.items():
        if not isinstance(name, str) or name not in params:
            close = difflib.get_close_matches(str(name), list(params), n=3)
            hint = f"did you mean {close}?" if close else f"names look like {list(params)[:4]}"
            raise _fail(str(name), strategy, f"names no parameter of the module; {hint}")
    for name, strategy in plan.items():
        layer, _, attr = name.rpartition(".")
        owner = module.get_submodule(layer)
        why_not = layers.unshardable(layer) if layer else None
        kind = _check_parameter(name, strategy, params[name], owner, why_not, tp)
        if attr == "weight":
            weights[layer] = (name, kind)
        out.given.setdefault(layer, []).append(f"{name} {tuple(strategy)}")
    for name, strategy in plan.items():   # a bias follows its weight
        layer, _, attr = name.rpartition(".")
        if attr != "bias" or not _linear_like(module.get_submodule(layer)):
            continue
        weight, kind = weights.get(layer, (f"{layer}.weight" if layer else "weight", None))
        want = (tp,) if kind == "column" else (1,)
        if tuple(strategy) != want:
            how = {"column": "column-parallel: its output features, and so the bias, are split",
                   "row": "row-parallel: each rank adds the whole bias after the sum"}.get(
                       kind or "", "replicated")
            raise _fail(name, strategy, f"a bias follows its weight, and '{weight}' "
                        f"{tuple(plan.get(weight, (1, 1)))} is {how}; give {want}")
    out.kinds = {layer: kind for layer, (_, kind) in weights.items() if kind is not None}
    if in_strategy is not None:
        if isinstance(in_strategy, str) or not isinstance(in_strategy, Sequence):
            raise ValueError(f"shard: in_strategy must be a tuple with one strategy (or None) "
                             f"per input, got {in_strategy!r}")
        if in_strategy and all(type(s) is int for s in in_strategy):
            raise ValueError(f"shard: in_strategy holds one strategy per input, got "
                             f"{tuple(in_strategy)}; for a single input write "
                             f"({tuple(in_strategy)},)")
        for i, s in enumerate(in_strategy):
            problem = None if s is None else strategy_problem(s, tp)
            if problem:
                raise ValueError(f"shard: in_strategy[{i}] {s!r}: {problem}")
        out.inputs = tuple(None if s is None else tuple(s) for s in in_strategy)
    return out


# the in_strategy hook (a module-level class, so deepcopy keeps it) ------------------------------

class _ShardedInputs:
    """Forward pre-hook of the sharded module: tag or all-gather the inputs in_strategy splits."""

    def __init__(self, strategies: tuple[Strategy | None, ...], keep_last: bool,
                 group: ProcessGroup) -> None:
        self.strategies, self.keep_last, self.group = strategies, keep_last, group

    def __deepcopy__(self, memo: dict[int, Any]) -> _ShardedInputs:
        return self  # immutable; a ProcessGroup cannot be copied

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if len(args) != len(self.strategies):
            raise ValueError(f"shard: in_strategy has "
                             f"{_count(len(self.strategies), 'entry', 'entries')} but "
                             f"{type(module).__name__} was called with "
                             f"{_count(len(args), 'positional input')}; give one strategy (or "
                             f"None) per input")
        out = []
        for i, (x, s) in enumerate(zip(args, self.strategies)):
            d = _split_dim(s)
            if d is None:
                out.append(x)
                continue
            assert s is not None
            if not isinstance(x, Tensor) or x.dim() != len(s):
                got = _count(x.dim(), "dimension") if isinstance(x, Tensor) else type(x).__name__
                raise ValueError(f"shard: in_strategy[{i}] {tuple(s)} has "
                                 f"{_count(len(s), 'entry', 'entries')} but input {i} has "
                                 f"{got}; give one entry per dimension")
            if self.keep_last and d == x.dim() - 1:
                x = x.view_as(x)            # a new tensor object to tag, not the caller's
                register_parallel_dim(x, -1)                         # (*, in / tp) a shard
            else:
                x = gather_from_group(x, self.group, dim=d)          # full; grad sliced back
            out.append(x)
        return tuple(out)


# applying a plan --------------------------------------------------------------------------------

def _link(root: nn.Module, ours: set[int], group: ProcessGroup) -> list[str]:
    """Keep column -> row shards flowing (hooks between), gather other column outputs."""
    links = link_shards(root, group, RUN_ORDER, only=ours)
    notes = [f"{link.producer} -> {link.consumer}: the shard flows on"
             + (f", re-tagged by {', '.join(link.between)}" if link.between else "")
             for link in links]
    columns = [m for m in root.modules() if id(m) in ours and isinstance(m, ParallelLinear)
               and m.dim == -1]
    notes += [f"{name or '(the module)'}: output all-gathered (no row layer follows)"
              for name in gather_unlinked(root, columns, links)]
    return notes


def _first_leaf(module: nn.Module) -> nn.Module | None:
    while isinstance(module, nn.Sequential):
        if len(module) == 0:
            return None
        module = module[0]
    return module


def apply_strategies(module: nn.Module, plan: StrategyPlan, group: ProcessGroup
                     ) -> tuple[nn.Module, dict[str, str], list[str]]:
    """Split `module` as `plan` says; returns it (or its replacement), layer lines, notes."""
    lines: dict[str, str] = {}
    ours: set[int] = set()
    for name, old in list(module.named_modules()):   # registration order
        if name not in plan.given:
            continue
        kind = plan.kinds.get(name, "replicate")
        lines[name] = f"{name or '(the module)'} ({_describe(old)}): {kind} <- " + \
            ", ".join(plan.given[name])
        if kind == "replicate":
            continue
        new = convert_layer(old, kind, group)
        ours.add(id(new))
        if not name:
            module = new
        else:
            parent, _, key = name.rpartition(".")
            setattr(module.get_submodule(parent), key, new)
    notes = _link(module, ours, group)
    if plan.inputs is not None and any(_split_dim(s) is not None for s in plan.inputs):
        first = _first_leaf(module)
        keep = isinstance(first, ParallelLinear) and first.dim == 0
        module.register_forward_pre_hook(_ShardedInputs(plan.inputs, keep, group))
        for i, s in enumerate(plan.inputs):
            d = _split_dim(s)
            if d is not None and s is not None:
                how = ("kept as a shard for the row layer it starts with"
                       if keep and d == len(s) - 1 else f"all-gathered along dim {d}")
                notes.append(f"input {i} {tuple(s)}: {how}")
    for m in module.modules():
        setattr(m, _MARK, True)
    return module, lines, notes


def shard(module: nn.Module, *, parameter_plan: Mapping[str, Strategy] | None = None,
          in_strategy: Sequence[Strategy | None] | None = None,
          group: ProcessGroup | None = None) -> nn.Module:
    """Split `module`'s parameters and inputs over the tp `group` by strategies (see above).

    ``parameter_plan={"0.weight": (tp, 1)}`` makes layer 0 column-parallel, ``(1, tp)`` row-
    parallel; ``in_strategy=((1, tp),)`` says the first input arrives split on its last dim.
    Returns `module`, changed in place (or, when `module` is itself the Linear / Embedding
    split, its parallel replacement). `group` defaults to the tp group of `hybridpar.init`.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"shard needs an nn.Module, got {type(module).__name__}")
    if parameter_plan is not None and not isinstance(parameter_plan, Mapping):
        raise ValueError(f"shard: parameter_plan must be a dict {{'parameter name': "
                         f"(slices per dimension)}}, got {parameter_plan!r}")
    group = group if group is not None else default_tp_group()
    tp = group_size(group)
    plan = prepare_strategies(module, parameter_plan, in_strategy, tp)
    module, lines, notes = apply_strategies(module, plan, group)
    decisions = list(lines.values()) + notes
    setattr(module, DECISIONS_ATTR, decisions)
    if not dist.is_initialized() or dist.get_rank() == 0:
        _log.debug("shard (tp=%d):\n  %s", tp, "\n  ".join(decisions))
    return module
