"""Gradient clipping by the global 2-norm over every stage and tp shard of a pipeline.

    parameter                        its square counts
    tp-sharded                       on every tp rank (each holds a different shard)
    replicated over tp               1 / tp on each tp rank (once in all)
    a tie's copy on a later stage    not at all (the first owning stage counts it)

The sum is all-reduced over tp, then over pp (dp replicas hold equal gradients after their
reduction). The scale min(1, max_norm / norm) stays a tensor: no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridpar import trace
from hybridpar.pipeline.loss import Guard
from hybridpar.tensor_parallel.attrs import get_parallel_dim
from hybridpar.topology import Topology

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, topology: Topology, *,
                    guard: Guard, not_counted: Collection[int] = (),
                    norm_type: float = 2.0) -> Tensor:
    """Scale the gradients of `params` so that their global norm is at most `max_norm`.

    Returns the norm before clipping (float32). `not_counted`: ids of parameters another
    stage counts (copies of a tie).
    """
    if norm_type != 2.0:
        raise ValueError(f"clip_grad_norm_ supports the 2-norm only, got norm_type="
                         f"{norm_type}; leave norm_type at 2.0")
    params = list(params)
    tp = topology.tp
    total = torch.zeros((), dtype=torch.float64, device=topology.device)
    for p in params:
        if p.grad is None or id(p) in not_counted:
            continue
        square = p.grad.detach().double().pow(2).sum()
        sharded = get_parallel_dim(p) is not None
        total += square if sharded or tp == 1 else square / tp
    nbytes = total.element_size()
    if tp > 1:
        with trace.collective("all_reduce", nbytes), guard(
                "the all-reduce of the gradient norm over tp", topology.tp_group):
            dist.all_reduce(total, group=topology.tp_group)
    if topology.pp > 1:
        with trace.collective("all_reduce", nbytes), guard(
                "the all-reduce of the gradient norm over pp", topology.pp_group):
            dist.all_reduce(total, group=topology.pp_group)
    norm = total.sqrt()
    # in float64, so float64 models clip as on one device; a multiply by 1.0 leaves a
    # gradient as it was
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(scale.to(p.grad.dtype))
    return norm.to(torch.float32)
