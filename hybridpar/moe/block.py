"""The MoE block: route each token to k experts, run them grouped, sum the weighted results.

    x (N, H) --router--> experts (N, k), weights (N, k)
    copies   (N·k, H)    each token once per chosen expert, sorted by expert (stable,
                         slot by slot: transformers' order of each expert's rows)
    experts  (N·k, H)    each copy through its expert's MLP (`Experts`, grouped)
    combine  (N, H)      Σ over a token's k copies of weight · output, in expert order
    + shared (N, H)      an optional dense expert every token takes (DeepSeek, Qwen2-MoE),
                         scaled by sigmoid(gate(x)) when gated (Qwen2-MoE)

Dropless by default: every token reaches its k experts, whatever the load (no padding).
The adds of the combine run in expert order for each token, as transformers' eager loop
does, so a float64 block equals HF's to the bit.

With a capacity factor f each expert takes at most C = ceil(f · N · k / E) copies of the N
tokens a rank routes (per micro-batch; under ep, of each source rank's tokens), and drops
the rest (a dropped copy adds nothing: the block's residual carries the token on):

    drop_policy   which copies an expert keeps
    "position"    the first C in slot-major order: every token's first choice before any
                  second choice, tokens in order within a slot (GShard, Switch)
    "probs"       the C with the largest routing weights (Megatron-LM's "probs")

Each expert then gets exactly C rows (its kept copies, then zero rows): static shapes, so
with a capacity no value is read on the host to shape the work (dropless grouping reads
each expert's count), at the cost of computing the padding rows.
"""

from __future__ import annotations

import math
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

__all__ = ["DROP_POLICIES", "MoE", "SharedExpert", "capacity", "combine", "group_by_expert",
           "group_with_capacity", "routed"]

DROP_POLICIES = ("position", "probs")


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
                 *, group: ProcessGroup | None = None, capacity_factor: float | None = None,
                 drop_policy: str = "position") -> None:
        super().__init__()
        check_capacity(capacity_factor, drop_policy)
        self.capacity_factor, self.drop_policy = capacity_factor, drop_policy
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
                     self.experts, self.group, capacity=capacity(
                         self.capacity_factor, flat.shape[0], self.router.top_k,
                         self.router.n_experts), by_weight=self.drop_policy == "probs")
        if self.shared is not None:
            out = out + self.shared(flat)
        out = out.reshape(shape)
        if stats is None:
            return out
        return out, stats + routing_stats(routing.logits, self.router.top_k)


def check_capacity(capacity_factor: float | None, drop_policy: str) -> None:
    """Raise `ValueError` naming a capacity factor that drops every token, or an unknown
    policy."""
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy {drop_policy!r} is not one of "
                         f"{', '.join(DROP_POLICIES)}")
    if capacity_factor is not None and not capacity_factor > 0:
        raise ValueError(f"capacity_factor={capacity_factor} drops every token (each expert "
                         "keeps ceil(factor · tokens · top_k / experts) copies): give a factor "
                         "> 0 (1.0: an even share; 1.25 is common), or None for dropless")


def capacity(factor: float | None, tokens: int, top_k: int, n_experts: int) -> int | None:
    """The copies an expert keeps, ceil(factor · tokens · top_k / E); None: dropless."""
    return None if factor is None else math.ceil(factor * tokens * top_k / n_experts)


def routed(x: Tensor, chosen: Tensor, weights: Tensor, n_experts: int,
           run: Callable[[Tensor, Tensor], Tensor], group: ProcessGroup | None, *,
           capacity: int | None = None, by_weight: bool = False) -> Tensor:
    """x (N, H) through its chosen experts (N, k) -> (N, H), the weighted sum: copies grouped
    by expert (at most `capacity` each, kept by position or `by_weight`: module docstring),
    `run(rows, counts)` on them (on the experts' ranks of the ep `group`, if any:
    `hybridpar.moe.dispatch`), combined. What `MoE` and the Hugging Face views run."""
    if capacity is None:
        copies, counts, order = group_by_expert(x, chosen, n_experts)
    else:
        copies, counts, order = group_with_capacity(x, chosen, n_experts, capacity,
                                                    weights=weights if by_weight else None)
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
    return x[order % N], _counts(chosen, n_experts), order


def _counts(chosen: Tensor, n_experts: int) -> Tensor:
    counts = torch.zeros(n_experts, dtype=torch.int64, device=chosen.device)
    return counts.scatter_add_(0, chosen, torch.ones_like(chosen))


def group_with_capacity(x: Tensor, experts: Tensor, n_experts: int, capacity: int, *,
                        weights: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """`group_by_expert` with each expert's `capacity` C: copies (E·C, H), C rows an expert,
    its first C copies (slot-major, or by `weights` (N, k), largest first) then zero rows;
    counts C each; order (E·C,): the copy each row is, -1 for padding. Static shapes: no
    value is read on the host (a GPU keeps going)."""
    N, H = x.shape
    chosen = experts.t().reshape(-1)                                     # (k·N,) slot-major
    if weights is None:
        order = torch.argsort(chosen, stable=True)
    else:                                  # by weight, then (stable) by expert
        first = torch.argsort(weights.t().reshape(-1), descending=True, stable=True)
        order = first[torch.argsort(chosen[first], stable=True)]
    counts = _counts(chosen, n_experts)
    by_expert = chosen[order]
    place = torch.arange(order.shape[0], device=x.device) - \
        (torch.cumsum(counts, 0) - counts)[by_expert]                  # among its expert's
    slots = n_experts * capacity                                         # the last: dropped
    row = torch.where(place < capacity, by_expert * capacity + place, slots)
    order = torch.full((slots + 1,), -1, dtype=order.dtype, device=x.device) \
        .scatter_(0, row, order)[:slots]
    rows = torch.cat([x, x.new_zeros(1, H)])[torch.where(order >= 0, order % N, N)]
    return rows, torch.full_like(counts, capacity), order


def combine(out: Tensor, weights: Tensor, order: Tensor) -> Tensor:
    """The experts' outputs (N·k, H) in `group_by_expert`'s `order`, weights (N, k) ->
    (N, H): each token's copies weighted and summed, in expert order (rows of order -1, a
    capacity's padding, add nothing)."""
    N = weights.shape[0]
    flat = weights.t().reshape(-1)
    if order.shape[0] == flat.shape[0]:                                  # dropless
        weighted = (out * flat[order].unsqueeze(-1)).to(out.dtype)       # (N·k, H)
        return out.new_zeros(N, out.shape[-1]).index_add_(0, order % N, weighted)
    pad = order < 0                                       # -> a row N, dropped at the end
    weight = torch.where(pad, 0, flat[order.clamp(min=0)])
    weighted = (out * weight.unsqueeze(-1)).to(out.dtype)
    token = torch.where(pad, N, order % N)
    return out.new_zeros(N + 1, out.shape[-1]).index_add_(0, token, weighted)[:N]
