"""Replicated parameters used on tp shards: their gradients summed over the tp group each step.

A parameter replicated over tp but applied to a sharded activation gets, on each rank, the
gradient of that rank's shard only. Qwen3 normalizes each head of q and k with one weight:

    one device        q_norm.weight (hd)  x  q (B, T, heads, hd)    grad = sum over all heads
    tp = 2, rank r    q_norm.weight (hd)  x  q (B, T, heads/2, hd)  grad_r = sum over r's heads
                                                                     grad_0 + grad_1 = grad

`PartialGrads.reduce` sums them (one all-reduce of their flat concatenation over tp), after the
schedule and before clipping, so every replica takes the one-device gradient and the copies
stay equal. Which parameters: those the tp plan found used on a shard or was told about (its
'replicate_sum_grad' style, HF's 'replicated_with_grad_allreduce'), and those tagged by
`hybridpar.nn.register_partial_grad` (`sharded.attrs`). A parameter used only on
full activations costs nothing: with none on a rank, no collective is issued.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from hybridpar import trace
from hybridpar.precision import grad_of, grad_or_zeros, set_grad

__all__ = ["PartialGrads", "sum_grads"]


class PartialGrads:
    """Sum the gradients of `params` over the tp `group` (None or size 1: nothing to do)."""

    def __init__(self, params: Sequence[nn.Parameter], group: ProcessGroup | None) -> None:
        size = 1 if group is None else dist.get_world_size(group)
        self.params = list(dict.fromkeys(params)) if size > 1 else []
        self.group = group

    def __bool__(self) -> bool:
        return bool(self.params)

    def reduce(self, *, only: Container[int] | None = None) -> None:
        """Sum every gradient over tp (`sum_grads`); no collective when there are none.
        `only`: the ids of the parameters whose gradients this rank holds (zero 2; the same
        on every tp rank), the others skipped."""
        params = self.params if only is None else [p for p in self.params if id(p) in only]
        if params:
            sum_grads(params, self.group)


@torch.no_grad()
def sum_grads(params: Sequence[nn.Parameter], group: ProcessGroup | None) -> None:
    """One all-reduce (sum) of the gradients of `params` over `group`, as one flat tensor.

    A parameter without a gradient (unused on this rank this step) adds zeros and gets the
    sum.
    """
    grads = [grad_or_zeros(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    with trace.collective("all_reduce", flat.numel() * flat.element_size()):
        dist.all_reduce(flat, group=group)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n
        if grad_of(p) is None:
            set_grad(p, g)

