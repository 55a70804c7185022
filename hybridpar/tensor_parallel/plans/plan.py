"""apply_tp_plan: shard a model's Linear and Embedding layers over tp by a plan (dict or "auto").

    style        layer           becomes                         output
    "column"     nn.Linear       ParallelLinear(dim=-1)          (*, out / tp), tagged -1
                 HF Conv1D       ParallelConv1D(dim=-1)
    "row"        nn.Linear       ParallelLinear(dim=0)           (*, out), full
                 HF Conv1D       ParallelConv1D(dim=0)
    "vocab"      nn.Embedding    ParallelEmbedding(dim=0)        (*, D), full
    "replicate"  anything        left as it is
    "dense_gather", "dense_scatter" (``"..._async"``: the ring-overlapped forms)
                 nn.Linear       TPDense(mode=...)               (*, out / tp) or full, below

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
* every nn.Embedding becomes vocab-parallel (uneven vocabularies allowed), but a position
  table (indexed by an ``arange``, not by the input: GPT-2's wpe), which stays replicated;
* a replicated parameter used on a column's shard (Qwen3's q_norm) is tagged: its gradient
  is summed over tp after each step (`attrs.register_partial_grad`, `pipeline.parameters.partial`);
  one also used on a full activation leaves those columns replicated. Dict plans get the same
  tags (and a ValueError for such a parameter), and the style "replicate_sum_grad";
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

TPDense styles (`feature.TPDense`, feature-sharded in and out) follow shard's rules, so the
outputs equal the plain model's whatever the plan: a TPDense reading a full input keeps this
rank's slice of it; its output shard flows on (`pairing.RUN_ORDER`: through elementwise
modules, nested nn.Sequential flattened) into the next TPDense or row layer of matching width,
and is all-gathered otherwise. Their shards are tagged like a column's, so state dicts,
`HybridPipe.consolidated_state_dict` and checkpoints gather and reshard them as any other.

Hugging Face plans (``config.base_model_tp_plan``, ``model._tp_plan``) are dicts too: their
styles (``colwise``, ``rowwise``, ``colwise_gather_output``, ``embedding_rowwise``, ...) map
to these (`hf_plan`), ``*`` being a layer index and keys relative to the base model allowed.

Re-tagging (DESIGN "tags travel"): elementwise ops drop the tag of a column-parallel output.
Two forward hooks put it back (`pairing.SIBLINGS`), so no module is inserted and names stay
the same:

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

import logging
from collections.abc import Mapping, Sequence
from typing import TypeVar, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from hybridpar.sharded.attrs import register_parallel_attribute, register_partial_grad
from hybridpar.sharded.mappings import group_rank, group_size, shard_range
from hybridpar.tensor_parallel.feature.dense import TPDense
from hybridpar.tensor_parallel.fused import Fused
from hybridpar.tensor_parallel.plans.flow import is_conv1d, set_head_attribute
from hybridpar.tensor_parallel.plans.hooks import (
    ExpectShardedOutput,
    GatherOutput,
    RefuseLabels,
    SplitFullInput,
)
from hybridpar.tensor_parallel.plans.layer_graph import DECISIONS_ATTR, Layers
from hybridpar.tensor_parallel.plans.pairing import (
    RUN_ORDER,
    SIBLINGS,
    Link,
    convert_layer,
    gather_unlinked,
    link_shards,
)
from hybridpar.tensor_parallel.plans.plan_flow import (
    LOGITS_NOTE,
    SAMPLE,
    HeadChange,
    Partial,
    Sliced,
    resolve_auto,
)
from hybridpar.tensor_parallel.plans.plan_read import Tie, check_explicit, prepare_plan, read_dict
from hybridpar.tensor_parallel.plans.plan_styles import (
    DENSE_MODES,
    DENSE_STYLES,
    REPLICATED,
    STYLE_HELP,
    STYLES,
)
from hybridpar.tensor_parallel.plans.strategy import apply_strategies
from hybridpar.tensor_parallel.reduction import reduce_over_tp
from hybridpar.tensor_parallel.state import register_full_shape
from hybridpar.topology import default_tp_group

__all__ = ["DENSE_STYLES", "STYLES", "apply_tp_plan", "plan_decisions"]

_SHOWN = {"column_gather": "column", "column_fused2": "column",
          "embedding_feature": "feature"}
_log = logging.getLogger("hybridpar")
_M = TypeVar("_M", bound=nn.Module)


# changing the module ----------------------------------------------------------------------------

def _convert(old: nn.Module, style: str, group: ProcessGroup, fused: Fused = 1) -> nn.Module:
    """The parallel layer of `style` holding this rank's slice of `old` (no random number)."""
    if style in DENSE_MODES:
        mode, async_comm = DENSE_MODES[style]
        dense = TPDense.from_module(cast(nn.Linear, old), mode=mode, group=group,
                                    async_comm=async_comm)
        dense.register_forward_pre_hook(SplitFullInput())
        return dense
    kind = {"row": "row", "vocab": "vocab", "embedding_feature": "feature"}.get(style, "column")
    new = convert_layer(old, kind, group, fused=2 if style == "column_fused2" else fused)
    if style == "column_gather":
        new.register_forward_hook(GatherOutput())
    return new


def _replace(module: nn.Module, layers: Layers, styles: Mapping[str, str],
             fused: Mapping[str, Fused], group: ProcessGroup, ties: list[Tie],
             changes: list[HeadChange]) -> None:
    """Swap in the parallel layers, share tied weights again, give attentions their heads."""
    for name in layers.names:  # parents come before children: replace top-down
        how = styles.get(name)
        if how is None or how in REPLICATED:
            continue
        parent_name, _, key = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, key, _convert(layers.by_name[name], how, group, fused.get(name, 1)))
    for emb, tied_linears in ties:  # one Parameter again: the tie survives the sharding
        tied_weight = cast(nn.Parameter, module.get_submodule(emb).weight)
        for lin in tied_linears:
            module.get_submodule(lin).register_parameter("weight", tied_weight)
    for owner, _, attr, _, value in changes:  # the attention holds tp-th of the heads
        set_head_attribute(owner, attr, value)


def _mark_partial(module: nn.Module, styles: Mapping[str, str], partial: Partial
                  ) -> list[str]:
    """Tag the parameters whose gradients are partial over tp (`attrs.register_partial_grad`):
    those the forward uses on a shard, and the own parameters of 'replicate_sum_grad' layers
    (not their children's). One decision line each."""
    params = dict(module.named_parameters())
    why = {p: f"used on the shards of {', '.join(sorted(cols))}" for p, cols in partial.items()}
    for layer, style in styles.items():
        if style == "replicate_sum_grad":
            for key, _ in module.get_submodule(layer).named_parameters(recurse=False):
                why.setdefault(f"{layer}.{key}", f"'{layer}' is {style!r} in the plan")
    for name in why:
        register_partial_grad(params[name])
    return [f"{name}: replicated, gradient summed over tp ({reason})"
            for name, reason in sorted(why.items())]


def shard_per_head(module: nn.Module, sliced: Sliced, group: ProcessGroup) -> list[str]:
    """Cut each per-head parameter (`flow_heads`) to this rank's slice along its dim, the
    heads its column keeps, tagged (that dim, its full shape) so that state dicts, loads and
    exports see the whole; one decision line each."""
    tp, rank = group_size(group), group_rank(group)
    lines = []
    for name, dim in sorted(sliced.items()):
        owner_name, _, key = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        whole = getattr(owner, key)
        start, stop = shard_range(whole.shape[dim], tp, rank)
        with torch.no_grad():
            part = nn.Parameter(whole.detach().narrow(dim, start, stop - start).clone(),
                                requires_grad=whole.requires_grad)
        register_parallel_attribute(part, -1 if dim == whole.dim() - 1 else dim, 1)
        register_full_shape(part, whole.shape)
        setattr(owner, key, part)
        if getattr(owner, "group", None) is None:   # `state.module_group`: its tp group
            vars(owner)["group"] = group               # a plain attribute, as nn.Module's
        lines.append(f"{name}: sharded by head (dim {dim}: {stop - start} of "
                     f"{whole.shape[dim]} per rank), as the column whose heads it meets")
    return lines


def _dense_note(name: str, links: list[Link]) -> str:
    into = next((link for link in links if link.consumer == name), None)
    out = next((link for link in links if link.producer == name), None)
    read = f"reads the shard of {into.producer}" if into is not None else \
        "keeps this rank's slice of a full input"
    if out is None:
        return f"{read}; output all-gathered (no TPDense or row layer reads its shard)"
    through = f" through {', '.join(out.between)}" if out.between else ""
    return f"{read}; its shard flows into {out.consumer}{through}"


def _link_dense(module: nn.Module, styles: Mapping[str, str], group: ProcessGroup,
                notes: dict[str, str]) -> None:
    """The TPDense layers' shards flow into the next TPDense / row layer, or are gathered."""
    dense = [module.get_submodule(n) for n, st in styles.items() if st in DENSE_STYLES]
    if not dense:
        return
    links = link_shards(module, group, RUN_ORDER, only={id(m) for m in dense})
    gather_unlinked(module, dense, links)
    for name, style in styles.items():
        if style in DENSE_STYLES:
            notes[name] = _dense_note(name, links)


def _guard_logits(module: nn.Module, styles: Mapping[str, str],
                  notes: Mapping[str, str]) -> None:
    """"auto"'s class-sharded logits: raise if an op drops their tag; refuse labels=."""
    for name in [n for n in styles if notes.get(n) == LOGITS_NOTE]:
        module.register_forward_hook(ExpectShardedOutput(name))
        module.register_forward_pre_hook(RefuseLabels(name), with_kwargs=True)
        if "." in name:
            module.get_submodule(name.split(".")[0]).register_forward_hook(
                ExpectShardedOutput(name))


def _decisions(layers: Layers, styles: Mapping[str, str], notes: Mapping[str, str],
               lines: Mapping[str, str], changes: list[HeadChange], hooked: list[str]
               ) -> list[str]:
    """One line per Linear / Embedding (style and why), head changes, re-tagged modules."""
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
    return decisions


# the entry point --------------------------------------------------------------------------------

def apply_tp_plan(module: _M, plan: str | Mapping[str, str | Sequence[int]] | None, *,
                  group: ProcessGroup | None = None,
                  log: logging.Logger | None = None,
                  sample: SAMPLE | None = None) -> _M:
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
        hf = ("; 'hf' (a Hugging Face model's own plan) is HybridPipe's: here pass "
              "hybridpar.hf.tp_plan(model)" if plan == "hf" else "")
        raise ValueError(f"tp_plan must be None, 'auto' or a dict {{'name pattern': style, "
                         f"'parameter name': (slices per dimension)}} (HybridPipe also takes "
                         f"'hf'), got {plan!r}{hf}; {STYLE_HELP}")
    layers = Layers(module)
    styles, strategies = read_dict(plan, module, layers) if isinstance(plan, Mapping) \
        else ({}, {})
    group = group if group is not None else default_tp_group()
    tp = group_size(group)
    logger = log if log is not None else _log
    prepared = prepare_plan(module, strategies, styles, tp) if strategies else None
    if tp == 1:
        logger.debug("tp_plan: tp=1, nothing to shard")
        return module
    ties: list[Tie] = []
    if isinstance(plan, Mapping):
        notes, fused, changes, ties, partial, sliced, reduced = check_explicit(
            module, layers, styles, tp, sample)
    else:
        styles, notes, fused, changes, partial, sliced, reduced = resolve_auto(
            module, layers, tp, sample)
    partial_lines = _mark_partial(module, styles, partial)
    _replace(module, layers, styles, fused, group, ties, changes)
    partial_lines += shard_per_head(module, sliced, group)
    for name, columns in sorted(reduced.items()):   # a distributed norm
        reduce_over_tp(module.get_submodule(name), group)
        partial_lines.append(f"{name}: its means / sums over the features summed over tp (the "
                             f"features of {', '.join(sorted(columns))} are sharded)")
    lines: dict[str, str] = {}
    extra: list[str] = []
    if prepared is not None:
        new, lines, extra = apply_strategies(module, prepared, group)
        module = cast(_M, new)
    hooked = [name for link in link_shards(module, group, SIBLINGS) for name in link.between]
    _link_dense(module, styles, group, notes)
    _guard_logits(module, styles, notes)
    decisions = _decisions(layers, styles, notes, lines, changes, hooked) + extra + \
        partial_lines
    setattr(module, DECISIONS_ATTR, decisions)
    if not dist.is_initialized() or dist.get_rank() == 0:
        label = "dict" if isinstance(plan, Mapping) else "'auto'"
        logger.info("tp_plan %s (tp=%d):\n  %s", label, tp, "\n  ".join(decisions))
    return module


def plan_decisions(module: nn.Module) -> list[str]:
    """What `apply_tp_plan` did to `module`, one line per layer ([] if nothing was applied)."""
    return list(getattr(module, DECISIONS_ATTR, []))
