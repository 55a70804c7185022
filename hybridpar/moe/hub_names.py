"""Hub checkpoints' per-expert tensors against the model's fused (E, ...) experts.

transformers 5 keeps a layer's experts fused (``mlp.experts.gate_up_proj`` (E, 2I, H),
``mlp.experts.down_proj`` (E, H, I)); most Hub checkpoints, and ``save_pretrained``, store
them one expert at a time. transformers' conversion mapping says how, and hybridpar reads
it (`merges`): each merge names the per-expert sources (``*``: the expert) and the fused
target; several sources are the parts of each expert, along its dim 0:

    family        per-expert sources (after renames)                  fused target
    mixtral       .experts.*.w1.weight | .experts.*.w3.weight         .experts.gate_up_proj
                  .experts.*.w2.weight                                .experts.down_proj
    qwen2_moe,    mlp.experts.*.gate_proj.weight | *.up_proj.weight   mlp.experts.gate_up_proj
    qwen3_moe,    mlp.experts.*.down_proj.weight                      mlp.experts.down_proj
    olmoe, ...

    fused[e] = cat(source_0[e], source_1[e], ...)  (dim 0)      e = 0 .. E - 1

Only merges of that form are read (``MergeModulelist(dim=0)``, then ``Concatenate(dim=1)``
for several parts); another conversion leaves the names as the model's. Renames (Mixtral's
``block_sparse_moe.`` for ``mlp.``, Granite-MoE's ``input_linear``) are `hf.keys.KeyMap`'s.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["Merge", "Piece", "fuse_experts", "merges", "piece_view", "pieces_of",
           "split_name"]

@dataclass(frozen=True)
class Merge:
    """Per-expert sources (name endings, ``*`` the expert) fused into one target."""

    sources: tuple[str, ...]
    target: str


@dataclass(frozen=True)
class Piece:
    """One expert's part of a fused tensor, stored under `name` (model-side: renamed)."""

    name: str
    expert: int
    part: int
    parts: int


def merges(config: Any) -> tuple[Merge, ...]:
    """transformers' per-expert merges for the model of `config` (its class, or model type;
    `config`: a config, a model or a config.json dict)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    config = getattr(config, "config", config)       # a model: its config
    fields = config if isinstance(config, dict) else vars(config)   # or a config.json dict
    names = [*(fields.get("architectures") or []), getattr(config, "model_type", None)
             or fields.get("model_type", "")]
    found: list[Any] = next((m for m in map(get_checkpoint_conversion_mapping, names) if m), [])
    out = []
    for t in found:
        if type(t) is not WeightConverter or len(t.target_patterns) != 1:
            continue
        ops = list(t.operations)
        sources = tuple(t.source_patterns)
        merge_first = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
        concat = ops[1:] == [] if len(sources) == 1 else (
            len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1)
        if merge_first and concat and all(s.count("*") == 1 for s in sources):
            out.append(Merge(sources, t.target_patterns[0]))
    return tuple(out)


def _source_pattern(source: str) -> re.Pattern[str]:
    head, tail = source.split("*")
    return re.compile(f"^(.*?){re.escape(head)}(\\d+){re.escape(tail)}$")


def split_name(name: str, found: Iterable[Merge]) -> tuple[str, Piece] | None:
    """A per-expert name's fused target and its `Piece` (None: not a per-expert name)."""
    for merge in found:
        for part, source in enumerate(merge.sources):
            match = _source_pattern(source).match(name)
            if match:
                return (match[1] + merge.target,
                        Piece(name, int(match[2]), part, len(merge.sources)))
    return None


def pieces_of(target: str, experts: Iterable[int], found: Iterable[Merge]) -> list[Piece] | None:
    """The per-expert names a fused tensor `target` is stored under, for `experts` (None: not
    a merge's target)."""
    for merge in found:
        if target.endswith(merge.target):
            prefix = target[:len(target) - len(merge.target)]
            n = len(merge.sources)
            return [Piece(prefix + source.replace("*", str(e)), e, part, n)
                    for e in experts for part, source in enumerate(merge.sources)]
    return None


def piece_view(fused: Tensor, piece: Piece, first: int = 0) -> Tensor:
    """The part of `fused` (experts from `first`) that `piece` holds: a view."""
    size = fused.shape[1] // piece.parts
    return fused[piece.expert - first].narrow(0, piece.part * size, size)


def fuse_experts(state: Mapping[str, Any], found: Iterable[Merge], *,
                 named: Callable[[str], str] = str) -> dict[str, Any]:
    """`state` with every per-expert tensor fused into its target (each expert 0 .. E - 1
    present, every part: a `ValueError` naming the first missing one as `named` gives it,
    e.g. its name in the file)."""
    found = tuple(found)
    out: dict[str, Any] = {}
    groups: dict[str, dict[tuple[int, int], Tensor]] = {}
    parts: dict[str, int] = {}
    for name, value in state.items():
        split = split_name(name, found)
        if split is None:
            out[name] = value
            continue
        target, piece = split
        groups.setdefault(target, {})[piece.expert, piece.part] = value
        parts[target] = piece.parts
    for target, held in groups.items():
        count = 1 + max(e for e, _ in held)
        wanted = {piece.name: (piece.expert, piece.part)
                  for piece in pieces_of(target, range(count), found) or []}
        missing = [name for name, at in wanted.items() if at not in held]
        if missing:
            raise ValueError(f"the checkpoint's experts of {target} are incomplete: "
                             f"{named(missing[0])} is missing ({len(missing)} of {len(wanted)} "
                             f"per-expert tensors); a download or a conversion was cut short")
        out[target] = torch.stack([torch.cat([held[e, p] for p in range(parts[target])])
                                   for e in range(count)])
    return out
