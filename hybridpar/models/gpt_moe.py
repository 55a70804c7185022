"""The GPT's mixture of experts: each block's MLP an MoE, the routing sums carried along.

`gpt(n_experts=E, top_k=k)` replaces every block's MLP by `hybridpar.moe.MoE` (a softmax
router, renormalized top-k as Mixtral's, and E SwiGLU experts of `expert_hidden` features,
by default 4·C / k, so a token's routed FLOPs are about the dense MLP's). The load-balancing
loss needs sums over every layer of a micro-batch (`hybridpar.moe.balance_loss`), so what
travels between the layers, and between the stages, carries them:

    layer          dense GPT          MoE GPT                    packed MoE GPT
    Embeddings     x                  (x, stats)                 (x, positions, stats)
    Block          x                  (x, stats + its sums)      (x, positions, stats + ...)
    last Block     x                  (x, stats)                 (x, stats)
    LayerNorm      x                  (x, stats)                 (x, stats)
    Head           logits             (logits, aux) training, logits in eval

``aux`` (1,) is ``balance_coef · balance_loss(stats)``, already scaled; `gpt_loss` adds it
to the cross-entropy (`hybridpar.moe.split_aux`). Tensor parallelism keeps each MoE whole
on every tp rank (replicated, as the LayerNorms); with ``ep`` each rank of an ep group holds
E / ep experts and sends the tokens to them (`hybridpar.moe.dispatch`).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.moe import Experts, MoE, Router

__all__ = ["StatsLayerNorm", "gpt_moe"]


def gpt_moe(n_embd: int, n_experts: int, top_k: int, expert_hidden: int | None, *,
            group: ProcessGroup | None = None, router: str = "softmax",
            bias_rate: float = 0.0, capacity_factor: float | None = None,
            drop_policy: str = "position") -> MoE:
    """A GPT block's MoE: a top-k router (softmax, renormalized; or sigmoid with a correction
    bias moved by `bias_rate`), SwiGLU experts; with an ep `group` of P ranks, this rank's
    E / P experts."""
    hidden = expert_hidden if expert_hidden is not None else max(1, 4 * n_embd // top_k)
    P = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    local = n_experts // P
    return MoE(Router(n_embd, n_experts, top_k, scoring=router, normalize=True,
                      bias_rate=bias_rate),
               Experts(n_experts, n_embd, hidden, activation="silu", first=rank * local,
                       local=local), group=group, capacity_factor=capacity_factor,
               drop_policy=drop_policy)


class StatsLayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` of the hidden state that passes the routing sums on: (x, stats)."""

    def forward(self, x: Tensor | tuple[Tensor, ...]  # type: ignore[override]
                ) -> Tensor | tuple[Tensor, ...]:
        if isinstance(x, tuple):
            return super().forward(x[0]), *x[1:]
        return super().forward(x)
