"""Tied parameters: one Parameter used by layers on different stages (Megatron's embedding group).

GPT-2 ties its token embedding (layer 0) to its head (the last layer). On one device that is
one tensor with one gradient; split over stages, each owning stage keeps its own copy:

    layer     0 (wte)        ...      5 (head)          one device: W, grad = g0 + g5
    stage     0                       1
    copy      W  (canonical)          W' (alias)        kept equal: start equal, then
    grad      g0 ----- all-reduce(sum) ----- g5          both get g0 + g5 before the step

* `find_ties` lists every Parameter the model holds under several names, the first name
  (in `named_parameters` order) canonical: checkpoints save it once under that name, and
  `consolidated_state_dict` gives every name the canonical tensor.
* `detach_other_stages` points the other stages' references at `meta` placeholders before
  they are freed, so freeing them cannot touch the copy this rank keeps (`module.to("meta")`
  rewrites a shared Parameter in place).
* `TiedGroups` builds, for every set of owning stages, one process group per (dp, tp)
  coordinate: exactly the ranks that hold a copy of the same tp shard. `sync` broadcasts
  the canonical owner's values to the others (copies start equal, also after a `meta`
  build); `reduce` sums the gradients after the schedule, before clipping. Ties within one
  stage stay one Parameter and need nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from hybridpar.pipeline.parameters.partial import sum_grads
from hybridpar.pipeline.parameters.partition import stage_bounds
from hybridpar.topology import Topology

__all__ = ["Tie", "TiedGroups", "aliases", "check_kept", "detach_other_stages", "find_ties",
           "names_by_id"]


@dataclass(frozen=True)
class Tie:
    """A Parameter held under several names: the canonical name first."""

    names: tuple[str, ...]
    stages: tuple[int, ...]     # the stages holding it, ascending: stages[0] owns the canonical

    @property
    def canonical(self) -> str:
        return self.names[0]

    @property
    def across_stages(self) -> bool:
        return len(self.stages) > 1


def names_by_id(module: nn.Module) -> dict[int, list[str]]:
    """Every Parameter of `module` (by id) with all the names it is held under, in order."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def find_ties(module: nn.Sequential, balance: Sequence[int]) -> list[Tie]:
    """The Parameters `module` holds under more than one name, and the stages holding them."""
    stage_of: dict[str, int] = {}
    for stage, (start, stop) in enumerate(stage_bounds(balance)):
        for key in list(module._modules)[start:stop]:
            stage_of[key] = stage
    ties = []
    for names in names_by_id(module).values():
        if len(names) > 1:
            stages = sorted({stage_of[n.split(".", 1)[0]] for n in names})
            ties.append(Tie(names=tuple(names), stages=tuple(stages)))
    return ties


def aliases(ties: Sequence[Tie]) -> dict[str, str]:
    """``{other name: canonical name}`` of every tie."""
    return {alias: tie.canonical for tie in ties for alias in tie.names[1:]}


def detach_other_stages(stages: Sequence[nn.Module], keep: Collection[int],
                        ties: Sequence[Tie]) -> None:
    """In every stage not in `keep`, replace the tied Parameters shared with those by meta
    copies (the stages kept share theirs: one rank, one Parameter)."""
    kept = {id(p) for k in keep for p in stages[k].parameters()}
    for index, stage in enumerate(stages):
        if index in keep:
            continue
        placeholders: dict[int, nn.Parameter] = {}
        for module in stage.modules():
            for key, param in list(module._parameters.items()):
                if param is not None and id(param) in kept:
                    if id(param) not in placeholders:
                        placeholders[id(param)] = nn.Parameter(
                            torch.empty_like(param, device="meta"),
                            requires_grad=param.requires_grad)
                    module._parameters[key] = placeholders[id(param)]


class TiedGroups:
    """The process groups of the ties across stages, and the two things done over them.

    Built on every rank in the same order (`dist.new_group` is collective); a rank keeps
    the groups it is in, with the local Parameters of each.
    """

    def __init__(self, ties: Sequence[Tie], params: Mapping[str, nn.Parameter],
                 topology: Topology, *, placement: Sequence[int] | None = None) -> None:
        """`placement`: the pipeline rank of each (virtual) stage (default: stage s on rank
        s); a tie whose stages are all on one rank is one Parameter there, with no group."""
        self.stage = topology.pp_rank
        self._groups: list[tuple[ProcessGroup, int, list[nn.Parameter]]] = []
        self.not_counted: set[int] = set()   # ids of copies whose norm another stage counts
        where = list(range(topology.pp)) if placement is None else list(placement)
        by_stages: dict[tuple[int, ...], list[Tie]] = {}
        for tie in ties:
            holders = tuple(dict.fromkeys(where[s] for s in tie.stages))   # the owner first
            if len(holders) > 1:
                by_stages.setdefault(holders, []).append(tie)
        for stages, group_ties in by_stages.items():   # the pipeline ranks of the ties
            mine: list[nn.Parameter] = []
            for tie in group_ties:
                local = [params[n] for n in tie.names if n in params]
                if self.stage in stages:
                    assert local, f"stage {self.stage} holds none of {tie.names}"
                    mine.append(local[0])
                    if self.stage != stages[0]:
                        self.not_counted.add(id(local[0]))
            for dp in range(topology.dp):
                for tp in range(topology.tp):
                    ranks = [topology.global_rank(dp, s, tp) for s in stages]
                    group = dist.new_group(ranks, timeout=topology.timeout)
                    if topology.rank in ranks:
                        self._groups.append((group, ranks[0], mine))

    def __bool__(self) -> bool:
        return bool(self._groups)

    @property
    def groups(self) -> list[tuple[ProcessGroup, list[nn.Parameter]]]:
        """The groups this rank is in, each with its local copies (the same order on every
        rank of the group)."""
        return [(group, params) for group, _, params in self._groups]

    @torch.no_grad()
    def sync(self) -> None:
        """Every copy takes the canonical owner's values (once, at construction)."""
        for group, owner, params in self._groups:
            for p in params:
                dist.broadcast(p.data, owner, group=group)

    def reduce(self, *, only: Container[int] | None = None) -> None:
        """Sum the gradients of every tie over its owners, one all-reduce per group.

        A copy without a gradient (its stage did not use it this step) adds zeros and gets
        the sum. `only`: the ids of the copies whose gradients this rank holds (zero 2: a
        tie's copies have one dp owner on every stage), the others skipped.
        """
        for group, _, params in self._groups:
            mine = params if only is None else [p for p in params if id(p) in only]
            if mine:
                sum_grads(mine, group)


def check_kept(before: Mapping[int, list[str]], module: nn.Module) -> None:
    """Raise if a Parameter tied under several names before a change no longer is after it."""
    after = {tuple(names) for names in names_by_id(module).values()}
    for names in before.values():
        if len(names) > 1 and tuple(names) not in after:
            raise ValueError(
                f"the tp plan untied the parameters {list(names)}: they were one Parameter and "
                "are now separate copies that would train apart; shard all of them alike (one "
                "style for every layer that shares the weight) or replicate them "
                "(tp_plan={name: 'replicate'})")
