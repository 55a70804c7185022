"""DeepSeek-V3's auxiliary-loss-free balancing: a router's correction bias moved each step.

A sigmoid router (`hybridpar.moe.Router`, ``scoring="sigmoid"``) chooses its experts by
score + correction bias (the weights are the scores alone). After each optimizer step the
bias of a layer with ``bias_rate`` γ > 0 moves towards an even load (DeepSeek-V3, §2.1.2):

    load_e   copies routed to expert e in the step: every micro-batch's training forward
             (a recomputed one counted once), summed over the dp replicas
    b_e     += γ · sign(mean_e(load) − load_e)      (overloaded down, underloaded up)

The loads are summed over `group` (the dp group: every replica then applies the same update
and the biases stay equal); tp ranks route the same tokens and each router lives on one
stage, so nothing else is summed. One all-reduce of every router's loads per step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torchgpipe.checkpoint import is_recomputing

from hybridpar import trace
from hybridpar.moe.balance_loss import choice_counts
from hybridpar.moe.router import Router

__all__ = ["ExpertBiasUpdate"]


class ExpertBiasUpdate:
    """The aux-loss-free bias update of the sigmoid routers of `stage` whose ``bias_rate``
    is > 0 (module docstring); `group`: the dp group the loads are summed over. Call `step`
    after each optimizer step (on every rank of `group`, a collective when it has ranks)."""

    def __init__(self, stage: nn.Module, *, group: ProcessGroup | None = None) -> None:
        self.group = group
        self.routers = [m for m in stage.modules() if isinstance(m, Router)
                        and m.correction_bias is not None and m.bias_rate > 0]
        self.loads: dict[int, Tensor] = {}
        self._handles = [r.register_forward_hook(self._count) for r in self.routers]

    def __bool__(self) -> bool:
        return bool(self.routers)

    def _count(self, router: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not router.training or is_recomputing():
            return
        assert isinstance(router, Router)
        load = choice_counts(output.experts, router.n_experts).detach()
        self.loads[id(router)] = self.loads.get(id(router), 0) + load

    @torch.no_grad()
    def step(self, *, apply: bool = True) -> None:
        """Move each router's bias by its step's loads (summed over `group`), then forget
        them (`apply=False`: only forget, a skipped step's); a router that routed nothing
        this step counts zero loads."""
        if not self.routers or not apply:
            self.loads = {}
            return
        loads = torch.cat([self.loads.get(id(r), torch.zeros(
            r.n_experts, device=r.weight.device)).float() for r in self.routers])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            with trace.collective("all_reduce", loads.numel() * loads.element_size()):
                dist.all_reduce(loads, group=self.group)
        for router, load in zip(self.routers, loads.split([r.n_experts for r in self.routers])):
            assert router.correction_bias is not None
            router.correction_bias.add_(
                (load.mean() - load).sign().to(router.correction_bias) * router.bias_rate)
        self.loads = {}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
