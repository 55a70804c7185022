"""Expert parallelism: tokens to the rank holding their expert and back, by all-to-all.

An ep group of P ranks holds the E experts, L = E / P on each (rank j: experts j·L ..
j·L + L - 1). Each rank routes its own tokens, sorts their copies by expert and then:

    1. counts      all_to_all_single of the counts (E,): rank j gets, from every rank s,
                   how many copies s sends to each of j's experts: recv (P, L)
    2. dispatch    all_to_all_single of the copies, split by destination rank
                   (send: counts.view(P, L).sum(1); receive: recv.sum(1))
    3. regroup     the received rows come by source, then expert; the experts want them by
                   expert, then source: one permutation (and its inverse after)
    4. experts     each local expert on its rows from every source (`Experts`)
    5. combine     all_to_all_single back, splits swapped: every copy home, in its order

The backward mirrors it: the all-to-all of a gradient runs with the forward's splits
swapped. Every rank of the group issues the same all-to-alls in the same order (the same
MoE layers, in the same schedule slots: the ep ranks are dp replicas of one stage), as
NCCL's collectives need. The split sizes are read on the host (one sync per layer and
direction, as dropless dispatch needs without padding). `trace` counts the bytes that leave
the rank (the rows it keeps for its own experts stay off the wire).

    example: P = 2, E = 4 (L = 2); rank 0 sends counts [3, 1 | 0, 2], rank 1 [1, 0 | 2, 2]
    rank 0 receives  from 0: [3, 1], from 1: [1, 0]   -> rows e0 e0 e0 e1 | e0
                     regrouped                         -> e0 e0 e0 e0 | e1   (local counts 4, 1)
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.distributed import ProcessGroup

from hybridpar import trace
from hybridpar.moe.grouped import even_split

__all__ = ["DispatchPlan", "all_to_all", "dispatch_plan"]


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with (output, input) splits; backward: the same, splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int],
                group: ProcessGroup) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x: Tensor, out_splits: list[int], in_splits: list[int],
              group: ProcessGroup) -> Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    with trace.collective("all_to_all", _sent(in_splits, x, group)):
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
    return out


def _sent(splits: list[int], x: Tensor, group: ProcessGroup) -> int:
    """The bytes of `x` that leave this rank: the rows split to the other ranks (trace
    counts them; the rows a rank keeps never cross the wire)."""
    row = math.prod(x.shape[1:]) * x.element_size()
    return (sum(splits) - splits[dist.get_rank(group)]) * row


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int],
               group: ProcessGroup) -> Tensor:
    """Rows of `x` split by `in_splits` to each rank of `group`; `out_splits` rows from each
    come back, in rank order (differentiable: the backward sends the gradients home)."""
    out: Tensor = _AllToAll.apply(x, out_splits, in_splits, group)
    return out


class DispatchPlan:
    """The splits and the regrouping of one MoE layer's dispatch (module docstring)."""

    def __init__(self, send: list[int], receive: list[int], local_counts: Tensor,
                 order: Tensor) -> None:
        self.send, self.receive = send, receive      # rows to / from each rank
        self.local_counts = local_counts             # (L,) rows for each local expert
        self.order = order                           # received row of each regrouped row
        self.inverse = torch.argsort(order)

    def to_experts(self, copies: Tensor, group: ProcessGroup) -> Tensor:
        """Copies sorted by global expert -> this rank's experts' rows, grouped by expert."""
        return all_to_all(copies, self.receive, self.send, group)[self.order]

    def back(self, out: Tensor, group: ProcessGroup) -> Tensor:
        """The experts' outputs -> each copy's output at home, in the copies' order."""
        return all_to_all(out[self.inverse], self.send, self.receive, group)


def dispatch_plan(counts: Tensor, group: ProcessGroup, rows: int) -> DispatchPlan:
    """The plan of a dispatch whose `rows` copies, sorted by expert, number `counts` (E,) per
    expert: the counts exchanged (step 1), the splits and the regrouping read from them."""
    P = dist.get_world_size(group)
    E = counts.shape[0]
    L = E // P
    received = torch.empty_like(counts)
    with trace.collective("all_to_all", _sent([L] * P, counts.view(E, 1), group)):
        dist.all_to_all_single(received, counts.contiguous(), group=group)
    sizes = received.view(P, L)                                      # (source, expert)
    if is_fake(counts) or counts.is_meta:   # no values: the balanced routing, each way
        send = even_split(rows, P)
        host = [even_split(send[dist.get_rank(group)], L) for _ in range(P)]
    else:
        host, send = sizes.tolist(), counts.view(P, L).sum(1).tolist()
    # received rows: source-major; wanted: expert-major, sources in order within an expert
    starts, offset = [[0] * L for _ in range(P)], 0
    for s in range(P):
        for e in range(L):
            starts[s][e] = offset
            offset += host[s][e]
    pieces = [torch.arange(starts[s][e], starts[s][e] + host[s][e])
              for e in range(L) for s in range(P)]
    order = torch.cat(pieces).to(counts.device) if pieces else \
        torch.zeros(0, dtype=torch.int64, device=counts.device)
    local = torch.tensor([sum(col) for col in zip(*host)], device=counts.device)
    return DispatchPlan(send, [sum(row) for row in host], local, order)
