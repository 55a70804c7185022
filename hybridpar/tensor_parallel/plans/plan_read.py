"""Reading and checking a dict tp plan: styles, strategies, ties and notes, before any change."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any, cast

from torch import nn

from hybridpar.tensor_parallel.fused import Fused, part_count
from hybridpar.tensor_parallel.plans.hf_plan import split_plan
from hybridpar.tensor_parallel.plans.layer_graph import Layers
from hybridpar.tensor_parallel.plans.plan_flow import (
    LOGITS_NOTE,
    SAMPLE,
    HeadChange,
    Partial,
    Reduced,
    Sliced,
    explicit_flow,
)
from hybridpar.tensor_parallel.plans.plan_styles import (
    REPLICATED,
    indivisible,
    resolve_dict,
    resolve_hf,
    tie_group,
)
from hybridpar.tensor_parallel.plans.strategy import StrategyPlan, prepare_strategies

__all__ = ["Tie", "check_explicit", "pack_plan_problem", "prepare_plan", "read_dict"]

Tie = tuple[str, list[str]]


def read_dict(plan: Mapping[Any, Any], module: nn.Module, layers: Layers
               ) -> tuple[dict[str, str], dict[str, Sequence[int]]]:
    """{layer: style} (hybridpar's and Hugging Face's styles) and {parameter: strategy}."""
    ours, hf = split_plan(cast(Mapping[object, object], plan))
    strategies = {k: v for k, v in ours.items() if isinstance(k, str) and
                  isinstance(v, Sequence) and not isinstance(v, str)}
    styles = resolve_dict({cast(str, k): v for k, v in ours.items()
                           if k not in strategies}, layers)
    for name, style in resolve_hf(hf, module, layers).items():
        if styles.get(name, style) != style:
            raise ValueError(f"layer '{name}' has the style {styles[name]!r} and the "
                             f"Hugging Face style for {style!r}; give it one")
        styles[name] = style
    return styles, cast(dict[str, Sequence[int]], strategies)


def prepare_plan(module: nn.Module, strategies: Mapping[str, Sequence[int]],
             styles: Mapping[str, str], tp: int) -> StrategyPlan:
    """The strategies checked (`strategy.prepare_strategies`); a layer takes them or a style."""
    prepared = prepare_strategies(module, strategies, None, tp)
    for layer in prepared.given:
        if styles.get(layer, "replicate") not in REPLICATED:
            raise ValueError(f"tp_plan: layer '{layer}' has the style "
                             f"{styles[layer]!r} and the strategies "
                             f"{', '.join(prepared.given[layer])}; give one or the other")
    return prepared


def tie_note(name: str, style: str, why: str, styles: Mapping[str, str], layers: Layers,
              tp: int, ties: list[Tie]) -> str:
    """The note of a layer tied to others sharded alike, or the ValueError when it is not."""
    tie = tie_group(name, styles, layers, tp)
    if tie is None:
        raise ValueError(f"tp_plan: layer '{name}' cannot be made {style!r}: {why}; "
                         f"mark it 'replicate' or leave it out of the plan")
    if tie[0] != name:
        return (f"its weight is '{tie[0]}.weight' (one Parameter, sharded on the vocab "
                f"dim): {LOGITS_NOTE}")
    ties.append(tie)
    shared = ", ".join(f"'{n}.weight'" for n in tie[1])
    return f"its weight is one Parameter with {shared}: all sharded on the vocab dim, the tie kept"


def check_explicit(module: nn.Module, layers: Layers, styles: Mapping[str, str], tp: int,
                    sample: SAMPLE | None
                    ) -> tuple[dict[str, str], dict[str, Fused], list[HeadChange], list[Tie],
                               Partial, Sliced, Reduced]:
    """A dict plan's notes, fused parts, head changes, ties, partial and per-head parameters,
    modules summing their reductions over tp; ValueError before any change."""
    notes: dict[str, str] = {}
    ties: list[Tie] = []
    fused, changes, partial, sliced, reduced = explicit_flow(module, layers, styles, tp, sample)
    for name, style in styles.items():
        if style in REPLICATED:
            continue
        why = layers.unshardable(name)
        if why is not None:
            notes[name] = tie_note(name, style, why, styles, layers, tp, ties)
        bad = indivisible(layers.by_name[name], style, tp,
                          2 if style == "column_fused2" else fused.get(name, 1))
        if bad is not None:
            raise ValueError(f"layer '{name}': {bad}; choose a size that is a multiple "
                             f"of {tp}, a tp that divides it, or mark the layer 'replicate'")
        if style == "column_gather":
            notes[name] = "output all-gathered (full), as HF's colwise_gather_output"
        elif style == "embedding_feature":
            notes[name] = "embedding dim sharded, output all-gathered (full)"
        elif part_count(fused.get(name, 1)) > 1 or style == "column_fused2":
            notes[name] = (f"fused in {part_count(fused.get(name, 2))} parts, each rank "
                           f"keeps its slice of every part")
    return notes, fused, changes, ties, partial, sliced, reduced


def pack_plan_problem(plan: Mapping[Any, Any], key: str = "tp_plan") -> str | None:
    """Why a dict tp `plan` cannot shard a packed model (`models.packing.pack_documents`): it
    replaces layer 0, which passes the positions on; None when it leaves layer 0. `key` names
    the plan (``parallel.tp_plan`` in a config): the config check and `HybridPipe` ask it."""
    bad = [g for g, style in plan.items() if isinstance(g, str) and fnmatch.fnmatchcase("0", g)
           and not (isinstance(style, str) and style in REPLICATED)]
    if not bad:
        return None
    return (f"{key}[{bad[0]!r}] shards layer 0, which passes the document positions of "
            "data.pack = 'documents' (pack_documents) on (a sharded replacement would not): "
            "leave layer 0 out of the plan or mark it 'replicate', or set data.pack = 'none'")
