"""What a training step's routing did, for the metrics: each layer's load, the aux loss.

Forward hooks on a stage's modules, no change to the model:

    hooked on                 records (training forwards only, not recomputations)
    each MoE block called     its copies per expert: the counts it added to the routing sums
    with routing sums         (`stats` out − `stats` in; a Hugging Face block's view: its
                              `stats` after − before), summed over the step's micro-batches
    the stage's last module   the aux loss of each micro-batch, where the output is
                              (logits, aux (1,)) (what `hybridpar.moe.split_aux` reads)

`take` (a collective over the pp and dp groups, on every rank at the same steps) sums the
counts of every layer over the stages and replicas and returns, for each MoE layer, the
fewest and most copies an expert received, and on the last stage the step's mean aux loss.
`reset` starts a step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchgpipe.checkpoint import is_recomputing

from hybridpar.moe.balance_loss import stats_experts
from hybridpar.moe.block import MoE
from hybridpar.moe.hf_blocks import HFMoE
from hybridpar.topology import Topology

__all__ = ["RoutingLog"]


class RoutingLog:
    """Routing numbers of a stage's MoE layers (module docstring). `layers`: the model's
    layer count; `n_experts`: E of its MoE layers (the same shape on every rank, which may
    hold none of them)."""

    def __init__(self, stage: nn.Module, *, layers: int, n_experts: int) -> None:
        self.layers, self.n_experts = layers, n_experts
        self.counts: dict[int, Tensor] = {}          # layer -> (E,) copies this step
        self.aux: list[Tensor] = []
        self._handles: list[Any] = []
        for name, module in stage.named_modules():
            layer = int(name.split(".", 1)[0]) if name else -1
            if isinstance(module, MoE):
                self._handles.append(module.register_forward_hook(self._counter(layer)))
            elif isinstance(module, HFMoE):   # its sums in `module.stats`, before and after
                before: dict[str, Any] = {}
                self._handles += [
                    module.register_forward_pre_hook(
                        lambda m, args, before=before: before.update(stats=m.stats)),
                    module.register_forward_hook(self._hf_counter(layer, before))]
        children = list(stage.children())
        if children:
            self._handles.append(children[-1].register_forward_hook(self._aux_hook))

    def _counter(self, layer: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if not _counted(module) or len(args) < 2 or not isinstance(output, tuple):
                return
            E = stats_experts(output[1])
            added = (output[1] - args[1])[:E].detach()
            self.counts[layer] = self.counts.get(layer, 0) + added
        return hook

    def _hf_counter(self, layer: int, before: dict[str, Any]) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            start, end = before.pop("stats", None), getattr(module, "stats", None)
            if not _counted(module) or start is None or end is None:
                return
            added = (end - start)[:stats_experts(end)].detach()
            self.counts[layer] = self.counts.get(layer, 0) + added
        return hook

    def _aux_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        # the model's output (logits, aux (1,)); a middle stage's (hidden, stats) is not it
        if _counted(module) and isinstance(output, tuple) and len(output) == 2 \
                and output[1].numel() == 1:
            self.aux.append(output[1].detach().sum())

    def reset(self) -> None:
        """Forget what was recorded: the next step starts."""
        self.counts, self.aux = {}, []

    def take(self, topology: Topology) -> dict[str, Any]:
        """``{"expert_load": {layer: [fewest, most copies an expert got]}, "aux_loss": ...}``
        of the step (aux on the ranks that computed it); a collective over pp and dp."""
        device = topology.device
        table = torch.zeros(self.layers, self.n_experts, dtype=torch.float64, device=device)
        for layer, counts in self.counts.items():
            table[layer] = counts.to(table)
        for size, group in ((topology.pp, "pp_group"), (topology.dp, "dp_group")):
            if size > 1:
                dist.all_reduce(table, group=getattr(topology, group))
        rows = [i for i in range(self.layers) if bool(table[i].any())]
        out: dict[str, Any] = {}
        if rows:
            low, high = table[rows].min(dim=1).values, table[rows].max(dim=1).values
            out["expert_load"] = {str(i): [int(a), int(b)] for i, a, b in
                                  zip(rows, low.tolist(), high.tolist())}
        if self.aux:
            out["aux_loss"] = float(torch.stack(self.aux).mean())
        self.reset()
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _counted(module: nn.Module) -> bool:
    """A training forward that is not a recomputation: a checkpointed micro-batch runs its
    forward twice (first without autograd, then again in its backward); the first counts."""
    return module.training and not is_recomputing()
