"""What a plan learns from the forward: "auto"'s styles, a dict plan's fused parts and heads.

    function           for           gives
    resolve_auto       "auto"        styles and notes by the data flow (`flow.pair_columns`), or
                                     by registration order when the forward cannot be followed
    explicit_flow      a dict plan   fused parts and attention head attributes of its columns
    heads_error        both          ValueError naming an attention whose heads tp splits

Both also give the replicated parameters used on a column's shard (`Partial`: {parameter:
the columns}): their gradients on a tp rank are that rank's part, to be summed over tp; and
the per-head parameters its shard meets (`Sliced`: {parameter: dim}, `flow_heads`), which each
rank holds the slice of, as the column.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from torch import nn

from hybridpar.tensor_parallel.fused import Fused, part_count
from hybridpar.tensor_parallel.plans.flow import (
    FullTrace,
    Pairing,
    TraceFailed,
    head_attributes,
    is_conv1d,
    is_linear_like,
    pair_columns,
    partial_uses,
    sample_input,
    trace_full,
)
from hybridpar.tensor_parallel.plans.layer_graph import Layers, is_elementwise
from hybridpar.tensor_parallel.plans.plan_styles import indivisible

__all__ = ["LOGITS_NOTE", "SAMPLE", "HeadChange", "Partial", "Reduced", "Sliced", "explicit_flow",
           "heads_error", "resolve_auto", "trace_model"]

SAMPLE = tuple[tuple[Any, ...], dict[str, Any]]
HeadChange = tuple[nn.Module, str, str, int, int]
Partial = dict[str, set[str]]       # replicated parameter -> the columns whose shards it meets
Sliced = dict[str, int]             # per-head parameter -> the dim each rank holds a slice of
Reduced = dict[str, set[str]]       # module summing its reductions over tp -> the columns
LOGITS_NOTE = "class-sharded logits (tagged -1): train with ParallelCrossEntropyLoss"


def heads_error(layers: Layers, full: FullTrace, columns: Sequence[str], tp: int) -> None:
    """ValueError naming the attention and its head counts when tp splits a head."""
    for name in columns:
        if name not in full.heads or all(n % tp == 0 for n in full.counts.get(name, ())):
            continue
        parent = name.rpartition(".")[0]
        kin = [n for n in layers.names if n.rpartition(".")[0] == parent and n in full.heads]
        shown = {n: " / ".join(map(str, sorted(full.counts[n], reverse=True))) for n in kin}
        counts = ", ".join(f"{n.rpartition('.')[2]} {shown[n]}" for n in kin)
        numbers = sorted(set().union(*(full.counts[n] for n in kin)))
        raise ValueError(
            f"tp={tp} does not divide the heads of '{parent or name}': heads per projection "
            f"{counts} (head_dim {full.heads[name][1]}); '{name}' has {shown[name]}. "
            f"Each rank must hold whole heads, query and key/value heads alike: use a tp "
            f"that divides {' and '.join(map(str, numbers))}, or a dict tp_plan that marks "
            f"'{parent}.*' 'replicate'")


def trace_model(module: nn.Module, layers: Layers, sample: SAMPLE | None
                ) -> tuple[FullTrace, dict[int, str], SAMPLE]:
    """The one-device forward on meta tensors, the Linear-like layers it follows, the sample."""
    names = {id(layers.by_name[n]): n for n in layers.names
             if is_linear_like(layers.by_name[n]) and n not in layers.in_mha and
             len(layers.names_of[id(layers.by_name[n])]) == 1}
    sample = sample if sample is not None else sample_input(module)
    if sample is None:
        raise TraceFailed("no sample input: the model does not start with an Embedding or a "
                          "Linear (give apply_tp_plan(..., sample=(args, kwargs)))")
    return trace_full(module, names, sample), names, sample


def _candidates(layers: Layers, full: FullTrace, names: Mapping[int, str], tp: int,
                notes: dict[str, str]) -> tuple[dict[str, Fused], dict[str, str]]:
    """The Linears that may be columns (-> fused parts), those that may not be rows (-> why)."""
    candidates: dict[str, Fused] = {}
    no_rows: dict[str, str] = {}
    for n in layers.names:
        m = layers.by_name[n]
        if not is_linear_like(m) or n in layers.in_mha:
            continue
        unshardable = layers.unshardable(n)
        why = unshardable or indivisible(m, "column", tp, full.fused.get(n, 1))
        if why is not None:
            notes[n] = why
        elif n in names.values():
            candidates[n] = full.fused.get(n, 1)
        row_why = unshardable or indivisible(m, "row", tp)
        if row_why is not None:
            no_rows[n] = row_why
    return candidates, no_rows


def _styles_of(layers: Layers, full: FullTrace, pairing: Pairing, tp: int,
               notes: dict[str, str]) -> dict[str, str]:
    """Rows and columns as the simulation paired them, with a note for every Linear."""
    styles: dict[str, str] = {}
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
        if part_count(parts) > 1:
            widths = f" {parts}" if isinstance(parts, tuple) else ""
            note += f"; fused in {part_count(parts)} parts{widths}, each rank keeps its " \
                    f"slice of every part"
        notes[col] = note
    for n, why in pairing.reasons.items():
        notes[n] = why
    for n in layers.names:
        if is_linear_like(layers.by_name[n]) and n not in layers.in_mha and \
                n not in styles and n not in notes:
            notes[n] = "not paired: its input is not a column's shard and no row reads its output"
    return styles


def resolve_auto(root: nn.Module, layers: Layers, tp: int, sample: SAMPLE | None
                 ) -> tuple[dict[str, str], dict[str, str], dict[str, Fused], list[HeadChange],
                            Partial, Sliced, Reduced]:
    """Styles, notes, fused parts, head attribute changes, partial and per-head parameters,
    modules whose reductions are summed over tp, by the data flow of the forward."""
    try:
        full, names, sample = trace_model(root, layers, sample)
    except TraceFailed as e:
        by_order, order_notes = _resolve_by_order(root, layers, tp)
        for n in layers.names:
            if is_linear_like(layers.by_name[n]) and n not in order_notes and \
                    n not in by_order:
                order_notes[n] = (f"not paired: the forward could not be followed ({e}), so "
                                  f"layers were paired by registration order")
        return by_order, order_notes, {}, [], {}, {}, {}
    notes: dict[str, str] = {}
    candidates, no_rows = _candidates(layers, full, names, tp, notes)
    heads_error(layers, full, list(candidates), tp)
    pairing = pair_columns(root, names, sample, full, tp, candidates, no_rows)
    styles = _styles_of(layers, full, pairing, tp, notes)
    _embeddings_and_classifier(layers, tp, styles, notes, full.positional)
    fused = {c: p for c, p in pairing.columns.items() if part_count(p) > 1}
    return styles, notes, fused, head_attributes(root, pairing.columns, full, tp), \
        pairing.partial, pairing.sliced, pairing.reduced


def _embeddings_and_classifier(layers: Layers, tp: int, styles: dict[str, str],
                               notes: dict[str, str], positional: Collection[str] = ()) -> None:
    """Every nn.Embedding vocab-parallel but position tables (`positional`: weights the
    forward indexes by positions, not by the input); the last Linear, if the last layer,
    class-sharded."""
    for name in layers.names:
        m = layers.by_name[name]
        if isinstance(m, nn.Embedding) and name not in layers.in_mha:
            if f"{name}.weight" in positional:
                styles[name] = "replicate"
                notes[name] = ("replicated: a position table (indexed by positions, not by "
                               "the input); sharded, its output would cost an all-reduce")
                continue
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
                   indivisible(layers.by_name[last], "column", tp)))
        if why is not None:
            why = f"'{last}': {why}"
        styles[last] = "replicate" if why else "column"
        notes[last] = f"final classifier replicated ({why})" if why else LOGITS_NOTE


def _resolve_by_order(root: nn.Module, layers: Layers, tp: int
                     ) -> tuple[dict[str, str], dict[str, str]]:
    """The fallback when the forward cannot be followed: pairs by registration order."""
    styles: dict[str, str] = {}
    notes: dict[str, str] = {}

    def blocked(column: str, *others: str) -> str | None:
        """Why `column` (to be column-parallel) and `others` must stay replicated, or None."""
        for n in (column, *others):
            why = layers.unshardable(n) or (
                indivisible(layers.by_name[n], "column", tp) if n == column else None)
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


def explicit_flow(module: nn.Module, layers: Layers, styles: Mapping[str, str], tp: int,
                  sample: SAMPLE | None
                  ) -> tuple[dict[str, Fused], list[HeadChange], Partial, Sliced, Reduced]:
    """A dict plan's column layers: fused parts, heads, partial and per-head parameters from
    the forward (best effort: nothing when it cannot be followed). A parameter used both on a
    column's shard and on a full activation is a ValueError."""
    columns = [n for n, st in styles.items() if st in ("column", "column_fused2") and
               is_linear_like(layers.by_name[n])]
    if not columns:
        return {}, [], {}, {}, {}
    try:
        full, names, sample = trace_model(module, layers, sample)
    except TraceFailed:
        return {}, [], {}, {}, {}
    fused: dict[str, Fused] = {n: full.fused[n] for n in columns if n in full.fused}
    fused.update({n: 2 for n in columns if styles[n] == "column_fused2"})
    heads_error(layers, full, columns, tp)
    parts = {n: fused.get(n, 1) for n in columns}
    try:
        partial, mixed, sliced, reduced = partial_uses(module, names, sample, full, tp, parts)
    except TraceFailed:
        partial, mixed, sliced, reduced = {}, {}, {}, {}
    for p, cols in mixed.items():
        raise ValueError(
            f"tp_plan: the parameter '{p}' is used on the shards of {sorted(cols)} and on full "
            f"activations: on a tp rank its gradient would be part shard, part whole, and no "
            f"reduction makes it the one-device gradient; replicate those columns (and their "
            f"rows), or give the layers using '{p}' separate parameters")
    return fused, head_attributes(module, parts, full, tp), partial, sliced, reduced
