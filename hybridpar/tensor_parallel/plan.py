"""apply_tp_plan: shard a model's Linear and Embedding layers over tp by a plan (dict or "auto").

    style        layer           becomes                         output
    "column"     nn.Linear       ParallelLinear(dim=-1)          (*, out / tp), tagged -1
    "row"        nn.Linear       ParallelLinear(dim=0)           (*, out), full
    "vocab"      nn.Embedding    ParallelEmbedding(dim=0)        (*, D), full
    "replicate"  anything        left as it is

A plan is a dict ``{pattern: style}`` whose patterns are module names or `fnmatch` globs
(``"*.fc1"``, ``"3.mlp.*"``, case-sensitive; ``*`` also crosses dots). An exact name beats a
glob; two globs giving one layer different styles are an error. A glob applies to the
matched layers of the style's type (``"3.mlp.*": "column"`` converts the Linears and skips
the activation); an exact name of the wrong type is an error, and so is a pattern matching
nothing. Errors (`ValueError`) come before any change, on every rank, and name the layer.

A dict may also map exact parameter names to strategies, slices per dimension (``"0.weight":
(tp, 1)``, see `strategy.shard`): those layers follow shard's rules (outputs equal the plain
module's: a column layer that no row layer follows is gathered), the rest their styles. A
layer takes a style or strategies, not both (a "replicate" style yields).

``"auto"`` (best-effort; what it did is logged and kept, see `plan_decisions`):

* two Linears A, B with the same parent, consecutive in registration order with only
  elementwise modules between (activations, dropout, identity) and ``A.out == B.in``
  become column -> row (``nn.Sequential(Linear, ReLU, Linear)``, a block's fc1 / act / fc2).
  Outside an nn.Sequential at least one such module must lie between: a custom forward
  may call adjacent Linears side by side (q, k, v);
* every nn.Embedding becomes vocab-parallel (uneven vocabularies allowed);
* the last Linear of the model, if not paired and the last layer in registration order,
  becomes column-parallel: class-sharded logits, to be fed to `ParallelCrossEntropyLoss`.
  A forward hook on the model and on its last child raises if their output is not these
  logits still tagged (an op after the Linear would see only this rank's classes);
* layers tp does not divide, inside `nn.MultiheadAttention`, shared between parents or with
  tied parameters stay replicated, with the reason in the decisions.

Re-tagging (DESIGN "tags travel"): elementwise ops drop the tag of a column-parallel output.
Two forward hooks put it back, so no module is inserted and names stay the same:

* every module between a column layer and its row layer (siblings in the same parent) gets
  a forward hook that tags its output like its input (sharded on -1) when the last dim is
  unchanged; a stage boundary there then sends the shard as a shard, and nn.Dropout there
  becomes `ParallelDropout` (same masks as one device: it needs the tag);
* every row-parallel layer gets a forward pre-hook: an untagged input of width ``in / tp``
  (which the one-device model never sees) is tagged as this rank's shard, so a functional
  ``F.gelu`` in a user's ``forward`` works too; a full-width input is still split.
  (A dropout after such a functional op sees an untagged shard: valid, but its mask is not
  the one-device mask. Widths alone never tag anything else: a module may be shared.)

Values are kept: each new layer holds its slice of the old parameters (no random number is
drawn; meta layers stay meta). The module is changed in place and returned, with the same
children names, so balance and state-dict keys are unchanged. tp=1 changes nothing.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping, Sequence
from fnmatch import fnmatchcase
from typing import Any, TypeVar, cast

import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from hybridpar.tensor_parallel.layer_graph import (
    DECISIONS_ATTR,
    ExpectShardedOutput,
    KeepTag,
    Layers,
    TagShardedInput,
    is_elementwise,
    to_parallel_embedding,
)
from hybridpar.tensor_parallel.layers import ParallelEmbedding, ParallelLinear
from hybridpar.tensor_parallel.mappings import group_size
from hybridpar.tensor_parallel.random import ParallelDropout
from hybridpar.tensor_parallel.strategy import apply_strategies, prepare_strategies
from hybridpar.topology import default_tp_group

__all__ = ["STYLES", "apply_tp_plan", "plan_decisions"]

STYLES = ("column", "row", "vocab", "replicate")
_TYPE_OF = {"column": nn.Linear, "row": nn.Linear, "vocab": nn.Embedding}
_STYLE_HELP = ("valid styles: 'column' / 'row' (nn.Linear), 'vocab' (nn.Embedding), "
               "'replicate' (any module)")
_LAYERS = (nn.Linear, nn.Embedding, ParallelLinear, ParallelEmbedding)
_LOGITS_NOTE = "class-sharded logits (tagged -1): train with ParallelCrossEntropyLoss"
_log = logging.getLogger("hybridpar")
_M = TypeVar("_M", bound=nn.Module)


def _indivisible(m: nn.Module, style: str, tp: int) -> str | None:
    if style in ("column", "row") and isinstance(m, nn.Linear):
        attr = "out_features" if style == "column" else "in_features"
        size = getattr(m, attr)
        if size % tp:
            return f"{attr} {size} is not divisible by tp={tp}"
    return None


# resolving a plan into {layer name: style} ----------------------------------------------------

def _resolve_dict(plan: Mapping[str, Any], layers: Layers) -> dict[str, str]:
    from_glob: dict[str, tuple[str, str]] = {}
    exact: dict[str, str] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not isinstance(style, str):
            raise ValueError(f"tp_plan entries must be 'name pattern': 'style' strings (or "
                             f"'parameter name': (slices per dimension), a strategy), got "
                             f"{pattern!r}: {style!r}; {_STYLE_HELP}")
        if style not in STYLES:
            raise ValueError(f"tp_plan[{pattern!r}] = {style!r} is not a style; {_STYLE_HELP}")
        is_glob = any(c in pattern for c in "*?[")
        matched = [n for n in layers.names if fnmatchcase(n, pattern)]
        if not matched:
            close = difflib.get_close_matches(pattern, layers.names, n=3)
            hint = f"; did you mean {close}?" if close else \
                f"; module names look like {layers.names[:4]}"
            raise ValueError(f"tp_plan pattern {pattern!r} matches no module{hint} "
                             f"({_STYLE_HELP})")
        wanted = _TYPE_OF.get(style)
        targets = matched if wanted is None else \
            [n for n in matched if isinstance(layers.by_name[n], wanted)]
        wrong = [n for n in matched if n not in targets]
        if wanted is not None and (not targets or (wrong and not is_glob)):
            shown = ", ".join(f"'{n}' ({layers.describe(n)})" for n in wrong[:4])
            raise ValueError(f"tp_plan[{pattern!r}] = {style!r} applies to nn.{wanted.__name__} "
                             f"only, but {pattern!r} matched {shown}; {_STYLE_HELP}")
        for n in targets:
            if not is_glob:
                exact[n] = style
            elif n in from_glob and from_glob[n][1] != style:
                other, other_style = from_glob[n]
                raise ValueError(f"layer '{n}' is matched by {other!r} ({other_style!r}) and "
                                 f"{pattern!r} ({style!r}); make the patterns disjoint or "
                                 f"name the layer exactly (an exact name wins)")
            else:
                from_glob[n] = (pattern, style)
    styles = {n: s for n, (_, s) in from_glob.items()}
    styles.update(exact)
    return styles


def _resolve_auto(root: nn.Module, layers: Layers, tp: int
                  ) -> tuple[dict[str, str], dict[str, str]]:
    styles: dict[str, str] = {}
    notes: dict[str, str] = {}

    def blocked(column: str, *others: str) -> str | None:
        """Why `column` (to be column-parallel) and `others` must stay replicated, or None."""
        for n in (column, *others):
            why = layers.unshardable(n) or (
                _indivisible(layers.by_name[n], "column", tp) if n == column else None)
            if why is not None:
                return f"'{n}': {why}"
        return None

    for parent_name in ["", *layers.names]:
        parent = root if not parent_name else layers.by_name[parent_name]
        if parent_name in layers.in_mha or isinstance(parent, nn.MultiheadAttention):
            continue
        prefix = f"{parent_name}." if parent_name else ""
        kids = [(prefix + k, m) for k, m in parent.named_children()]
        # a custom forward may call adjacent Linears side by side (q, k, v): there, a pair
        # needs an activation between; an nn.Sequential runs its children in order
        gap = 0 if isinstance(parent, nn.Sequential) else 1
        i = 0
        while i < len(kids):
            a_name, a = kids[i]
            j = i + 1
            while j < len(kids) and is_elementwise(kids[j][1]):
                j += 1
            if type(a) is nn.Linear and j < len(kids) and type(kids[j][1]) is nn.Linear and \
                    j - i - 1 >= gap and kids[j][1].in_features == a.out_features and \
                    a_name not in styles:
                b_name = kids[j][0]
                why = blocked(a_name, b_name)
                for n in (a_name, b_name):
                    styles[n] = "replicate" if why else ("column" if n == a_name else "row")
                    if why:
                        notes[n] = f"pair {a_name} -> {b_name} left replicated ({why})"
                i = j + 1
            else:
                i += 1
    for name in layers.names:
        m = layers.by_name[name]
        if type(m) is nn.Embedding and name not in layers.in_mha:
            why = layers.unshardable(name)
            styles[name] = "replicate" if why else "vocab"
            if why:
                notes[name] = f"replicated ({why})"
    linears = [n for n in layers.names
               if isinstance(layers.by_name[n], nn.Linear) and n not in layers.in_mha]
    leaves = [n for n in layers.names if not any(True for _ in layers.by_name[n].children())]
    if linears and linears[-1] not in styles:
        last = linears[-1]
        why = (f"it is not the last layer (then comes '{leaves[-1]}')"
               if leaves[-1] != last else blocked(last))
        styles[last] = "replicate" if why else "column"
        notes[last] = f"final classifier replicated ({why})" if why else _LOGITS_NOTE
    return styles, notes


# converting -------------------------------------------------------------------------------------

def _convert(old: nn.Module, style: str, group: ProcessGroup) -> nn.Module:
    if style == "vocab":
        assert isinstance(old, nn.Embedding)
        return to_parallel_embedding(old, group)
    new = ParallelLinear.convert_parallel_linear(old, -1 if style == "column" else 0,
                                                 group=group)
    if style == "row":
        new.register_forward_pre_hook(TagShardedInput())
    return new


def _retag_between(root: nn.Module, group: ProcessGroup) -> list[str]:
    """Hook the siblings between each column layer and its row layer; returns their names."""
    hooked = []
    for parent_name, parent in root.named_modules():
        kids = list(parent.named_children())
        for i, (_, a) in enumerate(kids):
            if not (isinstance(a, ParallelLinear) and a.dim in (1, -1)):
                continue
            j = i + 1
            while j < len(kids) and not isinstance(kids[j][1], _LAYERS):
                j += 1
            b = kids[j][1] if j < len(kids) else None
            if not (isinstance(b, ParallelLinear) and b.dim == 0 and
                    b.in_features == a.out_features):
                continue
            for key, m in kids[i + 1:j]:
                if type(m) is nn.Dropout:  # exactly nn.Dropout: no parameter, no state
                    new = ParallelDropout(m.p, m.inplace, parity=True, group=group)
                    new.train(m.training)
                    setattr(parent, key, new)
                    m = new
                if not any(isinstance(h, KeepTag) for h in m._forward_hooks.values()):
                    m.register_forward_hook(KeepTag())
                hooked.append(f"{parent_name}.{key}" if parent_name else key)
    return hooked


# the entry point --------------------------------------------------------------------------------

def apply_tp_plan(module: _M, plan: str | Mapping[str, str | Sequence[int]] | None, *,
                  group: ProcessGroup | None = None,
                  log: logging.Logger | None = None) -> _M:
    """Shard `module`'s layers over the tp `group` by `plan` (None, "auto" or a dict).

    Returns `module`, changed in place (same children names). `group` defaults to the tp
    group of `hybridpar.init`. The decisions are logged (info, on global rank 0, to `log`,
    default ``logging.getLogger("hybridpar")``) and kept: `plan_decisions(module)`.
    """
    if plan is None:
        return module
    if not isinstance(module, nn.Module):
        raise TypeError(f"apply_tp_plan needs an nn.Module, got {type(module).__name__}")
    if not ((isinstance(plan, str) and plan == "auto") or isinstance(plan, Mapping)):
        raise ValueError(f"tp_plan must be None, 'auto' or a dict {{'name pattern': style, "
                         f"'parameter name': (slices per dimension)}}, got {plan!r}; "
                         f"{_STYLE_HELP}")
    layers = Layers(module)
    explicit = isinstance(plan, Mapping)
    strategies: dict[str, Sequence[int]] = {}
    styles: dict[str, str] = {}
    if isinstance(plan, Mapping):
        strategies = {k: v for k, v in plan.items() if isinstance(k, str) and
                      isinstance(v, Sequence) and not isinstance(v, str)}
        styles = _resolve_dict({k: v for k, v in plan.items() if k not in strategies}, layers)
    group = group if group is not None else default_tp_group()
    tp = group_size(group)
    logger = log if log is not None else _log
    prepared = None
    if strategies:  # parameter name -> slices per dimension: hybridpar.shard's strategies

        prepared = prepare_strategies(module, strategies, None, tp)
        for layer in prepared.given:
            if styles.get(layer, "replicate") != "replicate":
                raise ValueError(f"tp_plan: layer '{layer}' has the style "
                                 f"{styles[layer]!r} and the strategies "
                                 f"{', '.join(prepared.given[layer])}; give one or the other")
    if tp == 1:
        logger.debug("tp_plan: tp=1, nothing to shard")
        return module
    notes: dict[str, str] = {}
    if explicit:
        for name, style in styles.items():
            if style == "replicate":
                continue
            why = layers.unshardable(name)
            if why is not None:
                raise ValueError(f"tp_plan: layer '{name}' cannot be made {style!r}: {why}; "
                                 f"mark it 'replicate' or leave it out of the plan")
            bad = _indivisible(layers.by_name[name], style, tp)
            if bad is not None:
                raise ValueError(f"layer '{name}': {bad}; choose a size that is a multiple "
                                 f"of {tp}, a tp that divides it, or mark the layer 'replicate'")
    else:
        styles, notes = _resolve_auto(module, layers, tp)

    for name in layers.names:  # parents come before children: replace top-down
        how = styles.get(name)
        if how is None or how == "replicate":
            continue
        parent_name, _, key = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, key, _convert(layers.by_name[name], how, group))
    lines: dict[str, str] = {}
    extra: list[str] = []
    if prepared is not None:

        new, lines, extra = apply_strategies(module, prepared, group)
        module = cast(_M, new)
    hooked = _retag_between(module, group)
    for name in [n for n in styles if notes.get(n) == _LOGITS_NOTE]:  # guard "auto" logits
        module.register_forward_hook(ExpectShardedOutput(name))
        if "." in name:
            module.get_submodule(name.split(".")[0]).register_forward_hook(
                ExpectShardedOutput(name))

    decisions = [lines[""]] if "" in lines else []
    for name in layers.names:
        m = layers.by_name[name]
        if name in lines:
            decisions.append(lines[name])
        elif name in styles or (type(m) in (nn.Linear, nn.Embedding) and
                                name not in layers.in_mha):
            note = notes.get(name) or ("" if name in styles else "not in the plan")
            decisions.append(f"{name} ({layers.describe(name)}): "
                             f"{styles.get(name, 'replicate')}"
                             + (f" - {note}" if note else ""))
    if hooked:
        decisions.append(f"re-tag the shard between column and row layers: {', '.join(hooked)}")
    decisions.extend(extra)
    setattr(module, DECISIONS_ATTR, decisions)
    if not dist.is_initialized() or dist.get_rank() == 0:
        label = "'auto'" if not explicit else "dict"
        logger.info("tp_plan %s (tp=%d):\n  %s", label, tp, "\n  ".join(decisions))
    return module


def plan_decisions(module: nn.Module) -> list[str]:
    """What `apply_tp_plan` did to `module`, one line per layer ([] if nothing was applied)."""
    return list(getattr(module, DECISIONS_ATTR, []))
