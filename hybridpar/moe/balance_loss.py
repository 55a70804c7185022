"""The load-balancing loss, from routing sums that travel with the micro-batch.

transformers' `load_balancing_loss_func` (Switch Transformer, eqs. 4–6) sums, over all the
MoE layers of one forward, how many of the top-k choices went to each expert (C) and the
router probability each expert got (P), with R rows (tokens × layers) in all, then

    loss = E · Σ_e (C_e / R) · (P_e / R)

A product of sums over layers does not split into per-layer terms, and under pipeline
parallelism the layers of one micro-batch sit on several stages. So the sums travel with the
micro-batch, one small float32 vector beside the hidden state, each MoE layer adding its own:

    stats (2E + 2,)   [ C_0 .. C_{E-1} | P_0 .. P_{E-1} | R | Z ]
    embedding -> zeros -> layer 0 adds -> ... (stage boundary: sent on) -> layer L-1 adds
    -> the loss on the last stage; its gradient flows back along the same path

Z is the router z-loss of ST-MoE (eq. 5), which penalizes large router logits: each layer's
mean over its N tokens of logsumexp(logits)², summed over the layers (a sum of per-layer
terms, carried with the rest so that it reaches the loss on the last stage the same way).

so every schedule (GPipe, 1F1B, interleaved, ZB-H1, ZBV) computes, per micro-batch, the loss
and gradients of that micro-batch's forward on one device: plain transformers trained with
gradient accumulation over the same micro-batches. The sums are float32 and computed as
transformers computes them (softmax in the logits' dtype, top-k of it, counts by histogram),
layer after layer in the same order, so they agree to the bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["balance_loss", "choice_counts", "empty_stats", "expert_load", "routing_stats",
           "split_aux", "stats_experts", "z_loss"]


def empty_stats(n_experts: int, *, device: torch.device | str | None = None) -> Tensor:
    """The sums before the first MoE layer: zeros (2E + 2,) float32."""
    return torch.zeros(2 * n_experts + 2, dtype=torch.float32, device=device)


def stats_experts(stats: Tensor) -> int:
    """E of a stats vector (2E + 2,)."""
    return (stats.shape[-1] - 2) // 2


def routing_stats(logits: Tensor, top_k: int) -> Tensor:
    """One layer's sums for router logits (N, E): counts of the top-k choices of
    softmax(logits), the probabilities summed over the N rows, N, and the layer's z-loss:
    (2E + 2,) float32."""
    N, E = logits.shape
    probs = torch.softmax(logits, dim=-1)                                # (N, E)
    chosen = torch.topk(probs, top_k, dim=-1)[1]                         # (N, k)
    counts = choice_counts(chosen, E)
    rows = torch.full((1,), float(N), dtype=torch.float32, device=logits.device)
    z = torch.logsumexp(logits.float(), dim=-1).square().mean().reshape(1)
    return torch.cat([counts, probs.float().sum(dim=0), rows, z])


def choice_counts(chosen: Tensor, n_experts: int) -> Tensor:
    """How many of the choices `chosen` (any shape, expert ids) went to each expert: (E,)
    float32, a histogram of float ids (no host sync, deterministic on every device)."""
    return torch.histc(chosen.reshape(-1).float(), bins=n_experts, min=0, max=n_experts)


def z_loss(stats: Tensor) -> Tensor:
    """Σ over layers of mean(logsumexp(logits)²), a 0-dim float32 (module docstring)."""
    return stats[-1]


def balance_loss(stats: Tensor) -> Tensor:
    """E · Σ_e (C_e / R) · (P_e / R), a 0-dim float32 (module docstring)."""
    E = stats_experts(stats)
    counts, probs, rows = stats[:E], stats[E:2 * E], stats[2 * E]
    return torch.sum((counts / rows) * (probs / rows)) * E


def expert_load(stats: Tensor) -> tuple[float, float]:
    """(min, max) top-k choices per expert and layer-row, as a fraction of the even share
    (1.0 = perfectly balanced); a host read, for logging."""
    E = stats_experts(stats)
    stats = stats.detach()
    counts, rows = stats[:E], float(stats[2 * E])
    if rows == 0:
        return 0.0, 0.0
    share = counts * E / counts.sum()
    return float(share.min()), float(share.max())


def split_aux(output: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, Tensor | None]:
    """A model's output -> (logits, aux loss (1,) or None): a model with experts returns
    (logits, aux) in training (`hybridpar.models.gpt` with n_experts); anything else is
    logits alone."""
    if isinstance(output, tuple):
        if len(output) != 2 or output[1].numel() != 1:
            raise TypeError(f"the model returned a tuple of {len(output)} tensors; a loss "
                            "takes logits, or (logits, aux loss (1,)) from a model with experts")
        return output[0], output[1]
    return output, None
