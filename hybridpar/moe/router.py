"""The router: which k experts each token goes to, and with what weight.

Four recipes cover the Hugging Face families, each the exact order of operations of
transformers' own router (in float64 the same bits, so a model converted from HF trains
exactly as HF does):

    scoring                         families                     weights of the k chosen
    "softmax"   softmax, top-k      mixtral qwen2_moe qwen3_moe  probabilities; renormalized
                                    olmoe                        to sum 1 with `normalize`
    "topk_softmax"  top-k of the    gpt_oss (router bias)        softmax over the k logits
                logits, softmax     granitemoe
    "sigmoid"   sigmoid, + bias,    deepseek_v3, glm4_moe        sigmoid scores of the k;
                group-limited top-k                              `normalize`, × `scale`

Softmax scores are computed in float32 as transformers does (bf16 routing flips experts on
ties; `score_dtype=None` keeps the logits' dtype, as GPT-OSS does); the sigmoid recipe runs
its whole linear in float32 (DeepSeek-V3). Group-limited top-k (``groups`` > 1) keeps, for
each token, the `top_groups` groups of E / groups experts with the largest sum of their two
best scores and chooses the k experts among those only:

    scores + bias   (E = 8, groups = 4, top_groups = 2, k = 2)
      groups        [.9 .1] [.3 .2] [.8 .7] [.4 .0]
      best two sum   1.0     0.5     1.5     0.4     -> groups 2 and 0
      chosen         experts 0 and 4 (0.9, 0.8)

The correction bias (a buffer, not trained by the gradient) steers the choice only; the
weights are the scores without it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["SCORINGS", "Router", "Routing"]

SCORINGS = ("softmax", "topk_softmax", "sigmoid")


class Routing(NamedTuple):
    """A router's answer for N tokens."""
    logits: Tensor     # (N, E) router logits (the load-balancing loss reads them)
    weights: Tensor    # (N, k) weight of each chosen expert, in the input's dtype
    experts: Tensor    # (N, k) int64 global index of each chosen expert


class Router(nn.Module):
    """A linear gate (E, H) scoring the experts of each token, then top-k (module docstring).

    `bias` adds a trained bias to the logits (GPT-OSS); ``scoring="sigmoid"`` holds the
    correction bias buffer `correction_bias` (E,), zero until the aux-loss-free update
    (`hybridpar.moe.ExpertBiasUpdate`) moves it by `bias_rate` a step."""

    def __init__(self, hidden: int, n_experts: int, top_k: int, *, scoring: str = "softmax",
                 normalize: bool = True, bias: bool = False, groups: int = 1,
                 top_groups: int = 1, scale: float = 1.0,
                 score_dtype: torch.dtype | None = torch.float32,
                 bias_rate: float = 0.0) -> None:
        super().__init__()
        check_router(n_experts=n_experts, top_k=top_k, scoring=scoring, groups=groups,
                     top_groups=top_groups, bias_rate=bias_rate)
        self.bias_rate = bias_rate
        self.n_experts, self.top_k, self.scoring = n_experts, top_k, scoring
        self.normalize, self.scale, self.score_dtype = normalize, scale, score_dtype
        self.groups, self.top_groups = groups, top_groups
        self.weight = nn.Parameter(torch.empty(n_experts, hidden))
        self.bias = nn.Parameter(torch.empty(n_experts)) if bias else None
        self.correction_bias: Tensor | None
        self.register_buffer("correction_bias",
                             torch.zeros(n_experts) if scoring == "sigmoid" else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)
        if self.correction_bias is not None:
            self.correction_bias.zero_()

    def forward(self, x: Tensor) -> Routing:
        """x (N, H) -> `Routing` of the N tokens."""
        if self.scoring == "sigmoid":
            return self._sigmoid(x)
        logits = F.linear(x, self.weight, self.bias)                     # (N, E)
        dtype = self.score_dtype or logits.dtype
        if self.scoring == "softmax":
            probs = torch.softmax(logits, dim=-1, dtype=dtype)           # (N, E)
            weights, experts = torch.topk(probs, self.top_k, dim=-1)     # (N, k)
            if self.normalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:                                                            # topk_softmax
            top, experts = torch.topk(logits.to(dtype), self.top_k, dim=-1)
            weights = torch.softmax(top, dim=-1)                         # (N, k)
        return Routing(logits, weights.to(x.dtype), experts)

    def _sigmoid(self, x: Tensor) -> Routing:
        logits = F.linear(x.float(), self.weight.float())                # (N, E) float32
        scores = logits.sigmoid()
        assert self.correction_bias is not None
        choice = scores + self.correction_bias                           # (N, E)
        if self.groups > 1:
            N, E = choice.shape
            grouped = choice.view(N, self.groups, E // self.groups)      # (N, G, E / G)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)        # (N, G)
            kept = torch.topk(group_scores, self.top_groups, dim=-1, sorted=False)[1]
            mask = torch.zeros_like(group_scores).scatter_(1, kept, 1)   # (N, G)
            mask = mask.unsqueeze(-1).expand_as(grouped).reshape(N, E).bool()
            choice = choice.masked_fill(~mask, float("-inf"))
        experts = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]   # (N, k)
        weights = scores.gather(1, experts)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(logits, (weights * self.scale).to(x.dtype), experts)


def check_router(*, n_experts: int, top_k: int, scoring: str, groups: int,
                 top_groups: int, bias_rate: float = 0.0) -> None:
    """Raise `ValueError` naming what is wrong with a router's numbers."""
    if scoring not in SCORINGS:
        raise ValueError(f"router scoring {scoring!r} is not one of {', '.join(SCORINGS)}")
    if not bias_rate >= 0 or (bias_rate and scoring != "sigmoid"):
        raise ValueError(f"bias_rate={bias_rate} moves the correction bias of a sigmoid "
                         "router (DeepSeek-V3's aux-loss-free balancing): a rate >= 0 with "
                         "scoring='sigmoid'")
    if n_experts < 1 or not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts "
                         f"({n_experts}): each token goes to k distinct experts")
    if groups < 1 or n_experts % groups:
        raise ValueError(f"groups={groups} must divide the {n_experts} experts")
    if groups > 1 and scoring != "sigmoid":
        raise ValueError("group-limited top-k (groups > 1) is a recipe of the sigmoid "
                         "router (DeepSeek-V3); use scoring='sigmoid' or groups=1")
    if not 1 <= top_groups <= groups:
        raise ValueError(f"top_groups={top_groups} must be between 1 and groups={groups}")
    if groups > 1 and (n_experts // groups < 2 or top_k > top_groups * (n_experts // groups)):
        raise ValueError(f"group-limited top-k needs at least 2 experts per group and "
                         f"top_k={top_k} <= top_groups × experts per group "
                         f"({top_groups} × {n_experts // groups})")
