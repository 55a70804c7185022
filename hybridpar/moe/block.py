"""The MoE block: route each token to k experts, run them grouped, sum the weighted results.

    x (N, H) --router--> experts (N, k), weights (N, k)
    copies   (N·k, H)    each token once per chosen expert, sorted by expert (stable,
                         slot by slot: transformers' order of each expert's rows)
    experts  (N·k, H)    each copy through its expert's MLP (`Experts`, grouped)
    combine  (N, H)      Σ over a token's k copies of weight · output, in expert order
    + shared (N, H)      an optional dense expert every token takes (DeepSeek, Qwen2-MoE),
                         scaled by sigmoid(gate(x)) when gated (Qwen2-MoE)

Dropless: every token reaches its k experts, whatever the load (no capacity, no padding).
The adds of the combine run in expert order for each token, as transformers' eager loop
does, so a float64 block equals HF's to the bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.moe.balance_loss import routing_stats
from hybridpar.moe.dispatch import dispatch_plan
from hybridpar.moe.experts import Experts
from hybridpar.moe.router import Router

__all__ = ["MoE", "SharedExpert", "combine", "group_by_expert", "routed"]


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP every token takes: ``down_proj(silu(gate_proj(x)) * up_proj(x))``,
    with `gated` scaled by ``sigmoid(gate(x))`` (Qwen2-MoE's `shared_expert_gate`)."""

    def __init__(self, hidden: int, intermediate: int, *, gated: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate = nn.Linear(hidden, 1, bias=False) if gated else None

    def forward(self, x: Tensor) -> Tensor:
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))      # (N, H)
        return out if self.gate is None else torch.sigmoid(self.gate(x)) * out


class MoE(nn.Module):
    """A router, E experts and an optional shared expert (module docstring).

    ``forward(x)`` takes (..., H) and returns the same shape; ``forward(x, stats)`` also adds
    this layer's routing sums to `stats` (`hybridpar.moe.balance_loss`) and returns
    ``(out, stats)``. With an ep `group` of P ranks, `experts` holds this rank's E / P of
    them and the copies travel to their experts and back by all-to-all
    (`hybridpar.moe.dispatch`)."""

    def __init__(self, router: Router, experts: Experts, shared: SharedExpert | None = None,
                 *, group: ProcessGroup | None = None) -> None:
        super().__init__()
        E = router.n_experts
        P = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        if experts.n_experts != E or E % P or (experts.first, experts.local) != (
                rank * (E // P), E // P):
            raise ValueError(
                f"the router scores {E} experts over an ep group of {P}: rank {rank} must "
                f"hold experts {rank * (E // P)}..{(rank + 1) * (E // P) - 1} (E / ep each, "
                f"ep dividing E), but the block holds {experts.first}.."
                f"{experts.first + experts.local - 1} of {experts.n_experts}")
        self.router, self.experts, self.shared = router, experts, shared
        self.group = group if P > 1 else None
        experts.routed = router.top_k / E          # the share of the experts a token uses

    def forward(self, x: Tensor, stats: Tensor | None = None
                ) -> Tensor | tuple[Tensor, Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])                                  # (N, H)
        routing = self.router(flat)
        out = routed(flat, routing.experts, routing.weights, self.router.n_experts,
                     self.experts, self.group)                               # (N, H)
        if self.shared is not None:
            out = out + self.shared(flat)
        out = out.reshape(shape)
        if stats is None:
            return out
        return out, stats + routing_stats(routing.logits, self.router.top_k)


def routed(x: Tensor, chosen: Tensor, weights: Tensor, n_experts: int,
           run: Callable[[Tensor, Tensor], Tensor], group: ProcessGroup | None) -> Tensor:
    """x (N, H) through its chosen experts (N, k) -> (N, H), the weighted sum: copies grouped
    by expert, `run(rows, counts)` on them (on the experts' ranks of the ep `group`, if
    any: `hybridpar.moe.dispatch`), combined. What `MoE` and the Hugging Face views run."""
    copies, counts, order = group_by_expert(x, chosen, n_experts)
    if group is None:
        done = run(copies, counts)                                           # (N·k, H)
    else:                                               # to the experts' ranks and back
        plan = dispatch_plan(counts, group, copies.shape[0])
        done = plan.back(run(plan.to_experts(copies, group), plan.local_counts), group)
    return combine(done, weights, order)


def group_by_expert(x: Tensor, experts: Tensor, n_experts: int
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """x (N, H), experts (N, k) -> (copies (N·k, H) sorted by expert, counts (E,) int64,
    order (N·k,): which (slot, token) each copy is, as slot · N + token).

    Within an expert the copies come slot by slot, tokens in order (a stable sort of the
    slot-major choices): the rows, in the order, that transformers' eager loop gives each
    expert (`torch.where` over its (k, N) mask), so each matrix product is the same call."""
    N = x.shape[0]
    chosen = experts.t().reshape(-1)                                     # (k·N,) slot-major
    order = torch.argsort(chosen, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, chosen, torch.ones_like(chosen))
    return x[order % N], counts, order


def combine(out: Tensor, weights: Tensor, order: Tensor) -> Tensor:
    """The experts' outputs (N·k, H) in `group_by_expert`'s `order`, weights (N, k) ->
    (N, H): each token's copies weighted and summed, in expert order."""
    N = weights.shape[0]
    weighted = (out * weights.t().reshape(-1)[order].unsqueeze(-1)).to(out.dtype)  # (N·k, H)
    return out.new_zeros(N, out.shape[-1]).index_add_(0, order % N, weighted)
