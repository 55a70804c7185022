"""Hugging Face's sparse MoE blocks run by hybridpar: their modules and weights, our routing.

A view of the block replaces it in its decoder layer: it shares the block's children (so
every state-dict name stays Hugging Face's: ``mlp.gate.weight``, ``mlp.experts.gate_up_proj``)
and runs its forward with the block's own router, expert weights and gate, but grouped by
expert (`hybridpar.moe.grouped`), dropless, and adding its routing sums (the load-balancing
loss's, `hybridpar.moe.balance_loss`) to `stats` when the decoder block hands them in:

    block class              router    shared expert (+ sigmoid gate)         returns
    MixtralSparseMoeBlock    gate      -                                      out
    Qwen2MoeSparseMoeBlock   gate      shared_expert (shared_expert_gate)     out
    Qwen3MoeSparseMoeBlock   gate      -                                      out
    OlmoeSparseMoeBlock      gate      -                                      out
    GraniteMoeMoE            router    -                                      out
    GptOssMLP                router    -  (transposed experts, biases)        (out, scores)
    Cohere2MoeSparseMoeBlock, FlexOlmoSparseMoeBlock, MellumSparseMoeBlock,
    MiniMaxSparseMoeBlock    gate      -                                      out

In float64 each equals the block's own forward to the last bits (tests/test_moe_hf.py).
Mixtral's router jitter (training noise) is refused. Under expert parallelism
(`shard_experts`, which HybridPipe applies when its topology has ep > 1) each rank keeps
E / ep of the block's experts and dispatches as `hybridpar.moe.MoE` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.moe.balance_loss import routing_stats
from hybridpar.moe.block import routed
from hybridpar.moe.experts import expert_mlp, gated
from hybridpar.sharded.attrs import register_expert_shard

__all__ = ["RECIPES", "HFMoE", "Recipe", "hf_moe", "shard_experts"]


@dataclass(frozen=True)
class Recipe:
    """Where a sparse block keeps its parts (module docstring's table)."""

    router: str = "gate"
    shared: str | None = None
    shared_gate: str | None = None
    transposed: bool = False          # GPT-OSS: (E, H, 2I) experts with biases
    returns_scores: bool = False      # GPT-OSS: the decoder layer unpacks (out, scores)


RECIPES: dict[str, Recipe] = {
    "MixtralSparseMoeBlock": Recipe(),
    "Qwen2MoeSparseMoeBlock": Recipe(shared="shared_expert", shared_gate="shared_expert_gate"),
    "Qwen3MoeSparseMoeBlock": Recipe(),
    "OlmoeSparseMoeBlock": Recipe(),
    "GraniteMoeMoE": Recipe(router="router"),
    "GptOssMLP": Recipe(router="router", transposed=True, returns_scores=True),
    "Cohere2MoeSparseMoeBlock": Recipe(),
    "FlexOlmoSparseMoeBlock": Recipe(),
    "MellumSparseMoeBlock": Recipe(),
    "MiniMaxSparseMoeBlock": Recipe(),
}


class HFMoE(nn.Module):
    """A Hugging Face sparse block run as hybridpar's MoE (module docstring). `top_k`: the
    router's k. Set `stats` before a forward to have this layer's routing sums added: the
    sum is in `stats` after it."""

    hf_block: nn.Module   # the wrapped module, not registered (a view)

    def __init__(self, block: nn.Module, recipe: Recipe, *, top_k: int) -> None:
        super().__init__()
        if block._parameters or block._buffers:
            raise ValueError(f"{type(block).__name__} holds tensors of its own; the MoE view "
                             "expects them all in its children")
        known = {recipe.router, "experts", recipe.shared, recipe.shared_gate}
        unknown = sorted(set(block._modules) - known)
        if unknown:
            raise ValueError(f"{type(block).__name__} has parts the MoE view does not run "
                             f"({', '.join(unknown)}: a shared expert of another kind?); "
                             "hybridpar runs this block only without them")
        if getattr(block, "jitter_noise", 0.0):
            raise ValueError(f"{type(block).__name__} has router_jitter_noise = "
                             f"{block.jitter_noise}: random noise on the routed inputs is not "
                             "supported; set it to 0")
        self._modules = block._modules                   # one dict for both: the same children
        object.__setattr__(self, "hf_block", block)
        self.recipe, self.top_k = recipe, top_k
        self.stats: Tensor | None = None
        self.group: ProcessGroup | None = None           # expert parallelism: `shard`
        self.train(block.training)

    def shard(self, group: ProcessGroup) -> None:
        """Keep this rank's E / P of the experts (P: `group`'s size) and send the tokens to
        their experts' ranks from now on (`hybridpar.moe.dispatch`). The experts' tensors
        become their slices, tagged as expert shards (reduced over the dp ranks holding
        them, stored at their global index)."""
        P, rank = dist.get_world_size(group), dist.get_rank(group)
        experts: Any = self._modules["experts"]
        E = int(experts.gate_up_proj.shape[0])
        if E % P:
            raise ValueError(f"ep={P} does not divide the {E} experts of "
                             f"{type(self.hf_block).__name__}: each ep rank holds E / ep")
        local = E // P
        for name, p in list(experts._parameters.items()):
            if p is not None and p.shape[0] == E:
                piece = nn.Parameter(p.detach()[rank * local:(rank + 1) * local].clone(),
                                     requires_grad=p.requires_grad)
                register_expert_shard(piece, rank=rank, ep=P)
                experts._parameters[name] = piece
        self.group = group

    def forward(self, hidden: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        shape = hidden.shape
        flat = hidden.reshape(-1, shape[-1])                             # (N, H)
        parts: dict[str, Any] = dict(self._modules)
        logits, weights, chosen = parts[self.recipe.router](flat)
        experts = parts["experts"]
        out = routed(flat, chosen, weights, logits.shape[-1],
                     lambda rows, counts: self._experts(experts, rows, counts),
                     self.group)                                         # (N, H)
        if self.recipe.shared is not None:
            shared = parts[self.recipe.shared](flat)
            if self.recipe.shared_gate is not None:
                shared = parts[self.recipe.shared_gate](flat).sigmoid() * shared
            out = out + shared
        if self.stats is not None:
            self.stats = self.stats + routing_stats(logits, self.top_k)
        out = out.reshape(shape)
        return (out, weights) if self.recipe.returns_scores else out

    def _experts(self, experts: Any, rows: Tensor, counts: Tensor) -> Tensor:
        """The block's experts (this rank's) on rows grouped by expert."""
        if self.recipe.transposed:
            return expert_mlp(rows, counts, experts.gate_up_proj, experts.down_proj,
                              gate=experts._apply_gate, transposed=True,
                              biases=(experts.gate_up_proj_bias, experts.down_proj_bias))
        return expert_mlp(rows, counts, experts.gate_up_proj, experts.down_proj,
                          gate=lambda h: gated(h, experts.act_fn))

    def extra_repr(self) -> str:
        return f"{type(self.hf_block).__name__}, top_k={self.top_k}"


def shard_experts(module: nn.Module, group: ProcessGroup) -> int:
    """`HFMoE.shard` every Hugging Face sparse block of `module` over the ep `group` (built
    whole: each rank slices what it holds); how many."""
    views = [m for m in module.modules() if isinstance(m, HFMoE) and m.group is None]
    for view in views:
        view.shard(group)
    return len(views)


def hf_moe(layer: nn.Module, config: Any) -> tuple[str, HFMoE] | None:
    """A decoder layer's sparse block as an `HFMoE`: (its attribute, the view) — None for a
    layer without one (a dense layer of a model that mixes them). A block of a class not in
    `RECIPES` in a model with experts is a `ValueError` naming it."""
    for name, child in layer.named_children():
        kind = type(child).__name__
        if kind in RECIPES:
            top_k = int(config.num_experts_per_tok)
            return name, HFMoE(child, RECIPES[kind], top_k=top_k)
        if "experts" in child._modules:
            raise ValueError(f"{type(layer).__name__}.{name} is a mixture-of-experts block "
                             f"({kind}) hybridpar does not run yet; the supported ones: "
                             f"{', '.join(sorted(RECIPES))}")
    return None
