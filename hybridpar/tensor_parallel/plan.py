"""apply_tp_plan: shard a model's Linear and Embedding layers over tp by a plan (dict or "auto").

    style        layer           becomes                         output
    "column"     nn.Linear       ParallelLinear(dim=-1)          (*, out / tp), tagged -1
                 HF Conv1D       ParallelConv1D(dim=-1)
    "row"        nn.Linear       ParallelLinear(dim=0)           (*, out), full
                 HF Conv1D       ParallelConv1D(dim=0)
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

``"auto"`` (best-effort; what it did, and why, for every Linear is logged and kept, see
`plan_decisions`) follows the forward (`flow`: a run on meta tensors, then a simulated
sharded run):

* a Linear (or HF Conv1D) whose output shard survives the ops after it and is read, as
  input features, by another Linear becomes column -> row; several columns may feed one
  row (q, k, v -> o; gate, up -> down; fc1 -> act -> fc2), whatever the registration order
  and whatever module or function the activation is. A shard that meets a reduction,
  normalization, slice or join over its features, an op that fails on it, or the model's
  output, leaves its column replicated with that op as the reason;
* attention is sharded by whole heads (query and key/value heads alike, GQA included): the
  heads come from the first reshape of a projection, ``(*, n * d) -> (*, n, d)``; a tp that
  does not divide a head count raises ValueError naming the attention and its head counts.
  The attention's own head counts and widths (``num_heads``, ``split_size``, ...) are
  divided by tp (`flow.head_attributes`; configs are never changed);
* an output split at once into k equal parts (GPT-2's fused q | k | v) is sharded part by
  part (``fused=k``);
* every nn.Embedding becomes vocab-parallel (uneven vocabularies allowed);
* the last Linear of the model, if not paired and the last layer in registration order,
  becomes column-parallel: class-sharded logits, to be fed to `ParallelCrossEntropyLoss`.
  A forward hook on the model and on its last child raises if their output (or its
  ``.logits``) is not these logits still tagged, and a ``labels=`` call is refused;
* layers tp does not divide, inside `nn.MultiheadAttention`, shared between parents or with
  tied parameters stay replicated, with the reason in the decisions (a dict plan naming
  an Embedding 'vocab' and the Linear tied to it 'column' shards both: one Parameter);
* when the forward cannot be followed (no sample input, an op meta tensors cannot run),
  Linears are paired by registration order as before (siblings with only elementwise
  modules between), and the decisions say so.

Hugging Face plans (``config.base_model_tp_plan``, ``model._tp_plan``) are dicts too: their
styles (``colwise``, ``rowwise``, ``colwise_gather_output``, ``embedding_rowwise``, ...) map
to these (`hf_plan`), ``*`` being a layer index and keys relative to the base model allowed.

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

from hybridpar.tensor_parallel.flow import (
    FullTrace,
    TraceFailed,
    head_attributes,
    is_conv1d,
    is_linear_like,
    linear_sizes,
    pair_columns,
    sample_input,
    trace_full,
)
from hybridpar.tensor_parallel.hf_plan import HF_STYLES, match_hf_key, split_plan
from hybridpar.tensor_parallel.layer_graph import (
    DECISIONS_ATTR,
    ExpectShardedOutput,
    GatherOutput,
    KeepTag,
    Layers,
    RefuseLabels,
    TagShardedInput,
    is_elementwise,
    to_parallel_embedding,
)
from hybridpar.tensor_parallel.layers import ParallelConv1D, ParallelEmbedding, ParallelLinear
from hybridpar.tensor_parallel.mappings import group_size
from hybridpar.tensor_parallel.random import ParallelDropout
from hybridpar.tensor_parallel.strategy import apply_strategies, prepare_strategies
from hybridpar.topology import default_tp_group

__all__ = ["STYLES", "apply_tp_plan", "plan_decisions"]

STYLES = ("column", "row", "vocab", "replicate")
_TYPE_OF = {"column": nn.Linear, "row": nn.Linear, "vocab": nn.Embedding}
_COLUMNS = ("column", "column_gather", "column_fused2")
_SAMPLE = tuple[tuple[Any, ...], dict[str, Any]]
_SHOWN = {"column_gather": "column", "column_fused2": "column",
          "embedding_feature": "feature"}
_STYLE_HELP = ("valid styles: 'column' / 'row' (nn.Linear), 'vocab' (nn.Embedding), "
               "'replicate' (any module)")
_LAYERS = (nn.Linear, nn.Embedding, ParallelLinear, ParallelEmbedding)
_LOGITS_NOTE = "class-sharded logits (tagged -1): train with ParallelCrossEntropyLoss"
_log = logging.getLogger("hybridpar")
_M = TypeVar("_M", bound=nn.Module)


def _is_type(m: nn.Module, wanted: type[nn.Module]) -> bool:
    return isinstance(m, wanted) or (wanted is nn.Linear and is_conv1d(m))


def _indivisible(m: nn.Module, style: str, tp: int, parts: int = 1) -> str | None:
    if (style in _COLUMNS or style == "row") and (isinstance(m, nn.Linear) or is_conv1d(m)):
        n_in, n_out = linear_sizes(m)
        attr, size = ("out_features", n_out) if style != "row" else ("in_features", n_in)
        if size % (tp * parts):
            per = f" (in {parts} fused parts)" if parts > 1 else ""
            return f"{attr} {size} is not divisible by tp={tp}{per}"
    return None


def _heads_error(layers: Layers, full: FullTrace, columns: Sequence[str], tp: int) -> None:
    """ValueError naming the attention and its head counts when tp splits a head."""
    for name in columns:
        if name not in full.heads or full.heads[name][0] % tp == 0:
            continue
        parent = name.rpartition(".")[0]
        kin = [n for n in layers.names if n.rpartition(".")[0] == parent and n in full.heads]
        counts = ", ".join(f"{n.rpartition('.')[2]} {full.heads[n][0]}" for n in kin)
        numbers = sorted({full.heads[n][0] for n in kin})
        raise ValueError(
            f"tp={tp} does not divide the heads of '{parent or name}': heads per projection "
            f"{counts} (head_dim {full.heads[name][1]}); '{name}' has {full.heads[name][0]}. "
            f"Each rank must hold whole heads, query and key/value heads alike: use a tp "
            f"that divides {' and '.join(map(str, numbers))}, or a dict tp_plan that marks "
            f"'{parent}.*' 'replicate'")


def _trace(module: nn.Module, layers: Layers, sample: _SAMPLE | None
           ) -> tuple[FullTrace, dict[int, str], _SAMPLE]:
    names = {id(layers.by_name[n]): n for n in layers.names
             if is_linear_like(layers.by_name[n]) and n not in layers.in_mha and
             len(layers.names_of[id(layers.by_name[n])]) == 1}
    sample = sample if sample is not None else sample_input(module)
    if sample is None:
        raise TraceFailed("no sample input: the model does not start with an Embedding or a "
                          "Linear (give apply_tp_plan(..., sample=(args, kwargs)))")
    return trace_full(module, names, sample), names, sample


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
            [n for n in matched if _is_type(layers.by_name[n], wanted)]
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


def _resolve_hf(plan: Mapping[str, str], root: nn.Module, layers: Layers) -> dict[str, str]:
    """{layer: internal style} for the Hugging Face entries of a plan (see `hf_plan`)."""
    prefix = getattr(root, "base_model_prefix", "")
    prefix = prefix if isinstance(prefix, str) and prefix and \
        prefix in dict(root.named_children()) else ""
    styles: dict[str, str] = {}
    for key, style in plan.items():
        internal = HF_STYLES.get(style, "")
        for n in match_hf_key(key, style, layers.names, prefix):
            m = layers.by_name[n]
            ok = internal == "replicate" or (
                _is_type(m, nn.Linear) if internal in (*_COLUMNS, "row") else
                isinstance(m, nn.Embedding))
            if not ok:
                kind = "an nn.Embedding" if "embedding" in style else "an nn.Linear or Conv1D"
                raise ValueError(f"tp_plan[{key!r}] = {style!r} does not apply to '{n}' "
                                 f"({layers.describe(n)}); {style!r} is for {kind}")
            styles[n] = internal
    return styles


def _tie_group(name: str, styles: Mapping[str, str], layers: Layers, tp: int
               ) -> tuple[str, list[str]] | None:
    """(embedding, [linears]) when `name`'s weight is tied only to layers sharded alike."""
    tied = layers.tied(name)
    if not tied or any(not t.endswith(".weight") for t in tied) or \
            layers.unshardable(name, ignore_ties=True) is not None:
        return None
    group = [name, *[t.rpartition(".")[0] for t in tied]]
    embs = [n for n in group if type(layers.by_name[n]) is nn.Embedding and
            styles.get(n) == "vocab"]
    lins = [n for n in group if type(layers.by_name[n]) is nn.Linear and
            styles.get(n) == "column"]
    if len(embs) != 1 or len(embs) + len(lins) != len(group) or \
            cast(nn.Embedding, layers.by_name[embs[0]]).num_embeddings % tp:
        return None
    return embs[0], lins


def _resolve_auto(root: nn.Module, layers: Layers, tp: int, sample: _SAMPLE | None
                  ) -> tuple[dict[str, str], dict[str, str], dict[str, int],
                             list[tuple[nn.Module, str, str, int, int]]]:
    """Styles, notes, fused parts and head attribute changes by the data flow of the forward."""
    try:
        full, names, sample = _trace(root, layers, sample)
    except TraceFailed as e:
        by_order, order_notes = _resolve_by_order(root, layers, tp)
        for n in layers.names:
            if is_linear_like(layers.by_name[n]) and n not in order_notes and \
                    n not in by_order:
                order_notes[n] = (f"not paired: the forward could not be followed ({e}), so "
                                  f"layers were paired by registration order")
        return by_order, order_notes, {}, []
    styles: dict[str, str] = {}
    notes: dict[str, str] = {}
    candidates: dict[str, int] = {}
    no_rows: dict[str, str] = {}
    for n in layers.names:
        m = layers.by_name[n]
        if not is_linear_like(m) or n in layers.in_mha:
            continue
        unshardable = layers.unshardable(n)
        why = unshardable or _indivisible(m, "column", tp, full.fused.get(n, 1))
        if why is not None:
            notes[n] = why
        elif n in names.values():
            candidates[n] = full.fused.get(n, 1)
        row_why = unshardable or _indivisible(m, "row", tp)
        if row_why is not None:
            no_rows[n] = row_why
    _heads_error(layers, full, list(candidates), tp)
    pairing = pair_columns(root, names, sample, full, tp, candidates, no_rows)
    feeds: dict[str, list[str]] = {}
    for row, cols in sorted(pairing.rows.items()):
        styles[row] = "row"
        notes[row] = f"reads the shards of {', '.join(c for c in layers.names if c in cols)}"
        for c in cols:
            feeds.setdefault(c, []).append(row)
    for col, parts in pairing.columns.items():
        styles[col] = "column"
        note = f"feeds {', '.join(feeds[col])}"
        if col in full.heads:
            heads, d = full.heads[col]
            note += f"; {heads // tp} of {heads} heads (head_dim {d}) per rank"
        if parts > 1:
            note += f"; fused in {parts} parts, each rank keeps its slice of every part"
        notes[col] = note
    for n, why in pairing.reasons.items():
        notes[n] = why
    for n in layers.names:
        if is_linear_like(layers.by_name[n]) and n not in layers.in_mha and \
                n not in styles and n not in notes:
            notes[n] = "not paired: its input is not a column's shard and no row reads its output"
    _embeddings_and_classifier(layers, tp, styles, notes)
    fused = {c: p for c, p in pairing.columns.items() if p > 1}
    return styles, notes, fused, head_attributes(root, pairing.columns, full, tp)


def _embeddings_and_classifier(layers: Layers, tp: int, styles: dict[str, str],
                               notes: dict[str, str]) -> None:
    """Every nn.Embedding vocab-parallel; the last Linear, if the last layer, class-sharded."""
    for name in layers.names:
        m = layers.by_name[name]
        if type(m) is nn.Embedding and name not in layers.in_mha:
            why = layers.unshardable(name)
            styles[name] = "replicate" if why else "vocab"
            if why:
                tie = " ('auto' keeps a tie replicated; a dict plan that makes the Embedding " \
                      "'vocab' and the Linear 'column' shards both, one Parameter)" \
                    if layers.tied(name) else ""
                notes[name] = f"replicated ({why}){tie}"
    linears = [n for n in layers.names if (isinstance(layers.by_name[n], nn.Linear) or
                                           is_conv1d(layers.by_name[n])) and
               n not in layers.in_mha]
    leaves = [n for n in layers.names if not any(True for _ in layers.by_name[n].children())]
    if linears and linears[-1] not in styles:
        last = linears[-1]
        why = (f"it is not the last layer (then comes '{leaves[-1]}')"
               if leaves[-1] != last else (
                   layers.unshardable(last) or
                   _indivisible(layers.by_name[last], "column", tp)))
        if why is not None:
            why = f"'{last}': {why}"
        styles[last] = "replicate" if why else "column"
        notes[last] = f"final classifier replicated ({why})" if why else _LOGITS_NOTE


def _resolve_by_order(root: nn.Module, layers: Layers, tp: int
                      ) -> tuple[dict[str, str], dict[str, str]]:
    """The fallback when the forward cannot be followed: pairs by registration order."""
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
    _embeddings_and_classifier(layers, tp, styles, notes)
    return styles, notes


# converting -------------------------------------------------------------------------------------

def _convert(old: nn.Module, style: str, group: ProcessGroup, fused: int = 1) -> nn.Module:
    if style in ("vocab", "embedding_feature"):
        assert isinstance(old, nn.Embedding)
        return to_parallel_embedding(old, group, dim=0 if style == "vocab" else -1)
    cls = ParallelConv1D if is_conv1d(old) else ParallelLinear
    new = cls.from_module(old, 0 if style == "row" else -1, group=group,
                          fused=2 if style == "column_fused2" else fused)
    if style == "row":
        new.register_forward_pre_hook(TagShardedInput())
    if style == "column_gather":
        new.register_forward_hook(GatherOutput())
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
                  log: logging.Logger | None = None,
                  sample: _SAMPLE | None = None) -> _M:
    """Shard `module`'s layers over the tp `group` by `plan` (None, "auto" or a dict).

    Returns `module`, changed in place (same children names). `group` defaults to the tp
    group of `hybridpar.init`. The decisions are logged (info, on global rank 0, to `log`,
    default ``logging.getLogger("hybridpar")``) and kept: `plan_decisions(module)`.
    `sample` = (args, kwargs) of a small forward (meta tensors are best) for following the
    data flow; by default token ids (2, 3) or features (2, 3, in) from the first layer.
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
        ours, hf = split_plan(cast(Mapping[object, object], plan))
        strategies = {k: v for k, v in ours.items() if isinstance(k, str) and
                      isinstance(v, Sequence) and not isinstance(v, str)}
        styles = _resolve_dict({cast(str, k): v for k, v in ours.items()
                                if k not in strategies}, layers)
        for name, style in _resolve_hf(hf, module, layers).items():
            if styles.get(name, style) != style:
                raise ValueError(f"layer '{name}' has the style {styles[name]!r} and the "
                                 f"Hugging Face style for {style!r}; give it one")
            styles[name] = style
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
    fused: dict[str, int] = {}
    changes: list[tuple[nn.Module, str, str, int, int]] = []
    ties: list[tuple[str, list[str]]] = []
    if explicit:
        fused, changes = _explicit_flow(module, layers, styles, tp, sample)
        for name, style in styles.items():
            if style == "replicate":
                continue
            why = layers.unshardable(name)
            if why is not None:
                tie = _tie_group(name, styles, layers, tp)
                if tie is None:
                    raise ValueError(f"tp_plan: layer '{name}' cannot be made {style!r}: {why}; "
                                     f"mark it 'replicate' or leave it out of the plan")
                if tie[0] == name:
                    ties.append(tie)
                    shared = ", ".join(f"'{n}.weight'" for n in tie[1])
                    notes[name] = (f"its weight is one Parameter with {shared}: all sharded on "
                                   f"the vocab dim, the tie kept")
                else:
                    notes[name] = (f"its weight is '{tie[0]}.weight' (one Parameter, sharded "
                                   f"on the vocab dim): {_LOGITS_NOTE}")
            bad = _indivisible(layers.by_name[name], style, tp,
                               2 if style == "column_fused2" else fused.get(name, 1))
            if bad is not None:
                raise ValueError(f"layer '{name}': {bad}; choose a size that is a multiple "
                                 f"of {tp}, a tp that divides it, or mark the layer 'replicate'")
            if style == "column_gather":
                notes[name] = "output all-gathered (full), as HF's colwise_gather_output"
            elif style == "embedding_feature":
                notes[name] = "embedding dim sharded, output all-gathered (full)"
            elif fused.get(name, 1) > 1 or style == "column_fused2":
                notes[name] = (f"fused in {fused.get(name, 2)} parts, each rank keeps its "
                               f"slice of every part")
    else:
        styles, notes, fused, changes = _resolve_auto(module, layers, tp, sample)

    for name in layers.names:  # parents come before children: replace top-down
        how = styles.get(name)
        if how is None or how == "replicate":
            continue
        parent_name, _, key = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, key, _convert(layers.by_name[name], how, group, fused.get(name, 1)))
    for emb, tied_linears in ties:  # one Parameter again: the tie survives the sharding
        tied_weight = cast(nn.Parameter, module.get_submodule(emb).weight)
        for lin in tied_linears:
            module.get_submodule(lin).register_parameter("weight", tied_weight)
    for owner, _, attr, _, value in changes:  # the attention holds tp-th of the heads
        setattr(owner, attr, value)
    lines: dict[str, str] = {}
    extra: list[str] = []
    if prepared is not None:

        new, lines, extra = apply_strategies(module, prepared, group)
        module = cast(_M, new)
    hooked = _retag_between(module, group)
    for name in [n for n in styles if notes.get(n) == _LOGITS_NOTE]:  # guard "auto" logits
        module.register_forward_hook(ExpectShardedOutput(name))
        module.register_forward_pre_hook(RefuseLabels(name), with_kwargs=True)
        if "." in name:
            module.get_submodule(name.split(".")[0]).register_forward_hook(
                ExpectShardedOutput(name))

    decisions = [lines[""]] if "" in lines else []
    for name in layers.names:
        kind = type(layers.by_name[name])
        if name in lines:
            decisions.append(lines[name])
        elif name in styles or ((kind in (nn.Linear, nn.Embedding) or
                                 is_conv1d(layers.by_name[name])) and name not in layers.in_mha):
            note = notes.get(name) or ("" if name in styles else "not in the plan")
            shown = _SHOWN.get(styles.get(name, "replicate"), styles.get(name, "replicate"))
            decisions.append(f"{name} ({layers.describe(name)}): {shown}"
                             + (f" - {note}" if note else ""))
    by_module: dict[str, list[str]] = {}
    for _, owner_name, attr, old, value in changes:
        by_module.setdefault(owner_name, []).append(f"{attr} {old} -> {value}")
    for owner_name, what in by_module.items():
        decisions.append(f"{owner_name}: {', '.join(what)} (this rank's heads)")
    if hooked:
        decisions.append(f"re-tag the shard between column and row layers: {', '.join(hooked)}")
    decisions.extend(extra)
    setattr(module, DECISIONS_ATTR, decisions)
    if not dist.is_initialized() or dist.get_rank() == 0:
        label = "'auto'" if not explicit else "dict"
        logger.info("tp_plan %s (tp=%d):\n  %s", label, tp, "\n  ".join(decisions))
    return module


def _explicit_flow(module: nn.Module, layers: Layers, styles: Mapping[str, str], tp: int,
                   sample: _SAMPLE | None
                   ) -> tuple[dict[str, int], list[tuple[nn.Module, str, str, int, int]]]:
    """A dict plan's column layers: fused parts and heads from the forward (best effort)."""
    columns = [n for n, st in styles.items() if st in ("column", "column_fused2") and
               is_linear_like(layers.by_name[n])]
    if not columns:
        return {}, []
    try:
        full, _, _ = _trace(module, layers, sample)
    except TraceFailed:
        return {}, []
    fused = {n: full.fused[n] for n in columns if n in full.fused}
    fused.update({n: 2 for n in columns if styles[n] == "column_fused2"})
    _heads_error(layers, full, columns, tp)
    return fused, head_attributes(module, {n: fused.get(n, 1) for n in columns}, full, tp)


def plan_decisions(module: nn.Module) -> list[str]:
    """What `apply_tp_plan` did to `module`, one line per layer ([] if nothing was applied)."""
    return list(getattr(module, DECISIONS_ATTR, []))
