"""Master weights: the optimizer steps float32 copies of bf16 parameters, sharded over dp.

With ``train.param_dtype = "bf16"`` the model holds bf16 weights and float32 gradients
(``main_grad``, `hybridpar.precision`); `MasterWeights` keeps a float32 copy of each weight
it owns (its master), hands the optimizer those copies with the float32 gradients, and
writes each updated master back into its bf16 weight. With ``shard=True`` (``parallel.zero
>= 1``) the parameters are dealt to the dp ranks whole, as ZeRO-1 deals them (largest first,
each to the rank holding the fewest elements so far, per parameter group; or by `owners`): a
rank keeps masters and optimizer state of its own only, and each rank then broadcasts the
weights it updated, in place, overlapped with the next step's forwards when given the module
(`optim.update_broadcast`). A float32 (or float64) weight is its own master (no copy): so
`MasterWeights` is also the fp32 optimizer of ``zero = 2``, whose gradients only the owner
holds (`pipeline.parameters.grad_shards`):

    per parameter (AdamW)    weight   float32 gradient   master + exp_avg + exp_avg_sq
    bf16, zero 0             2        4                  4 + 4 + 4 on every rank
    bf16, zero 1             2        4                  (4 + 4 + 4) / dp
    bf16, zero 2             2        4 / dp             (4 + 4 + 4) / dp
    fp32, zero 2             4        4 / dp             (the weight) + (4 + 4) / dp

so 18 bytes at zero 0, 6 + 12 / dp at zero 1, 2 + 16 / dp at zero 2 (bf16) and 4 + 12 / dp
(fp32; the gradient buckets are the gradients).

A checkpoint holds the masters as the model's values (``model/<name>``, float32, written by
their owner), so it resumes under either param_dtype, any dp, zero and layout, and exports
as a float32 run's does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.optim.update_broadcast import UpdateBroadcast
from hybridpar.optim.zero import check_no_expert_shards, check_shardable
from hybridpar.precision import grad_of, set_grad

__all__ = ["MasterWeights", "deal"]


def deal(groups: list[list[Tensor]], ranks: int, *, pinned: Mapping[int, int] | None = None,
         sizes: Mapping[int, int] | None = None) -> list[int]:
    """The owner of each tensor of `groups` (flattened in order): group by group, largest
    first, each to the rank holding the fewest elements so far over all groups (ties: the
    lowest rank), as torch's ZeroRedundancyOptimizer deals them. `pinned` (``id`` -> rank)
    fixes some owners beforehand (their elements count first); `sizes` (``id`` -> elements)
    replaces a tensor's ``numel`` in the dealing."""
    pinned = pinned or {}
    sizes = sizes or {}

    def size(t: Tensor) -> int:
        return sizes.get(id(t), t.numel())

    load = [0] * ranks
    for group in groups:
        for t in group:
            if id(t) in pinned:
                load[pinned[id(t)]] += size(t)
    owners: list[int] = []
    for group in groups:
        mine = [pinned.get(id(t), 0) for t in group]
        free = [k for k in range(len(group)) if id(group[k]) not in pinned]
        for k in sorted(free, key=lambda k: -size(group[k])):
            rank = min(range(ranks), key=lambda r: load[r])
            mine[k] = rank
            load[rank] += size(group[k])
        owners.extend(mine)
    return owners


class MasterWeights:
    """`optimizer_class` over float32 masters of `params` (tensors or parameter groups);
    with `shard` and a dp `group` of several ranks, each rank holds the masters and state of
    its own share (call it on every rank of the group with the same parameters in order).

    ``step()`` reads each owned parameter's float32 gradient (`hybridpar.precision.grad_of`),
    steps the masters, writes them into the parameters and, sharded, broadcasts each rank's
    share. ``param_groups`` are the inner optimizer's (set ``lr`` there as usual).
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[torch.optim.Optimizer], *,
                 group: ProcessGroup | None = None, shard: bool = False,
                 owners: Sequence[int] | None = None, module: nn.Module | None = None,
                 master_dtype: torch.dtype = torch.float32, experts: bool = False,
                 **defaults: Any) -> None:
        if not (isinstance(optimizer_class, type) and
                issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer class, got "
                            f"{optimizer_class!r}")
        groups = _as_groups(params)
        if shard:
            check_shardable(optimizer_class)
            if not experts:    # (`experts`: `group` is the expert dp group)
                check_no_expert_shards(groups)
        self.group = group
        self.ranks = dist.get_world_size(group) if shard and group is not None else 1
        self.rank = dist.get_rank(group) if self.ranks > 1 else 0
        self.params: list[nn.Parameter] = [p for g in groups for p in g["params"]]
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("a parameter is listed twice in the optimizer's parameters")
        if owners is not None and (not shard or len(owners) != len(self.params)):
            raise ValueError(f"owners (one dp rank per parameter, {len(self.params)} here) "
                             f"need shard=True, got {len(owners)} with shard={shard}")
        self.owners = list(owners) if owners is not None and self.ranks > 1 else \
            deal([g["params"] for g in groups], self.ranks)
        #: id(parameter) -> its float32 master (the parameters this rank owns); a parameter
        #: of `master_dtype` already is its own master
        self.masters: dict[int, nn.Parameter] = {}
        inner = []
        k = 0
        for g in groups:
            owned = []
            for p in g["params"]:
                if self.owners[k] == self.rank:
                    master = p if _is_own_master(p, master_dtype) else nn.Parameter(
                        p.detach().to(master_dtype, copy=True), requires_grad=p.requires_grad)
                    self.masters[id(p)] = master
                    owned.append(master)
                k += 1
            inner.append({**{key: v for key, v in g.items() if key != "params"},
                          "params": owned})
        #: the optimizer over this rank's masters
        self.optim = optimizer_class(inner, **defaults)
        # fixed for the optimizer's life: (parameter, its master) here
        self._owned = [(p, self.masters[id(p)]) for p in self.params
                       if id(p) in self.masters and self.masters[id(p)] is not p]
        #: sharded: the update's broadcast, in `module`'s parameter order when given, whose
        #: layers then wait for their own parameters only (`optim.update_broadcast`)
        self.broadcast: UpdateBroadcast | None = None
        if self.ranks > 1:
            assert group is not None
            owner_of = {id(p): o for p, o in zip(self.params, self.owners, strict=True)}
            order = [p for p in module.parameters() if id(p) in owner_of] \
                if module is not None else []
            seen = {id(p) for p in order}
            order += [p for p in self.params if id(p) not in seen]
            self.broadcast = UpdateBroadcast(order, [owner_of[id(p)] for p in order], group)
            if module is not None:
                self._hooks = self.broadcast.attach(module)
        self.overlap = module is not None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property
    def state(self) -> Mapping[Any, Any]:
        """The inner optimizer's state, keyed by master."""
        return self.optim.state

    def copies(self) -> list[nn.Parameter]:
        """The masters that are copies (of lower weights), not the parameters themselves."""
        return [master for _, master in self._owned]

    def master_of(self, param: Tensor) -> nn.Parameter | None:
        """`param`'s master on this rank (None: another rank owns it)."""
        return self.masters.get(id(param))

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) the model's gradients: float32 (``main_grad``) and bf16."""
        for p in self.params:
            if set_to_none:
                set_grad(p, None)
                p.grad = None
                continue
            for grad in (grad_of(p), p.grad):
                if grad is not None:
                    grad.zero_()

    def wait_params(self) -> None:
        """Finish the last update's broadcast (every parameter current on this rank)."""
        if self.broadcast is not None:
            self.broadcast.wait()

    @torch.no_grad()
    def step(self) -> None:
        """One update of the owned masters from the float32 gradients; the weights follow
        (with a `module`, the others' arrive during its next forwards)."""
        self.wait_params()
        for p, master in self._owned:
            grad = grad_of(p)
            master.grad = None if grad is None else grad.to(master.dtype).view_as(master)
        self.optim.step()
        for _, master in self._owned:
            master.grad = None
        self.copy_to_params(wait=not self.overlap)

    @torch.no_grad()
    def copy_to_params(self, *, wait: bool = True) -> None:
        """Each owned master into its parameter (cast; a parameter that is its own master
        already holds it), then, sharded, each owner's parameters broadcast in place
        (`UpdateBroadcast`; `wait=False`: left on the wire for the forwards to wait for)."""
        for p, master in self._owned:
            p.copy_(master)
        if self.broadcast is not None:
            self.broadcast.launch()
            if wait:
                self.broadcast.wait()

    @torch.no_grad()
    def copy_from_params(self) -> None:
        """Each owned master from its parameter (after the parameters were loaded)."""
        for p, master in self._owned:
            master.copy_(p)


def _is_own_master(param: Tensor, master_dtype: torch.dtype) -> bool:
    """Whether `param` is precise enough to be stepped as it is (float32, float64)."""
    return not param.is_floating_point() or param.dtype == master_dtype or \
        torch.finfo(param.dtype).bits > torch.finfo(master_dtype).bits


def _as_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """`params` as a list of parameter groups (dicts with a "params" list)."""
    items = list(params)
    if not items:
        raise ValueError("MasterWeights got an empty parameter list")
    if all(isinstance(g, dict) for g in items):
        return [{**g, "params": list(g["params"])} for g in items]
    return [{"params": items}]
