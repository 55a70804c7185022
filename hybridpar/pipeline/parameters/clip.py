"""Gradient clipping by the global 2-norm over every stage and tp shard of a pipeline.

    parameter                        its square counts
    tp-sharded                       on every tp rank (each holds a different shard)
    replicated over tp               1 / tp on each tp rank (once in all)
    a tie's copy on a later stage    not at all (the first owning stage counts it)
    an expert shard (ep > 1)         on every ep rank (each holds other experts), 1 / tp

The sum is all-reduced over tp, then over pp (dp replicas hold equal gradients after their
reduction; at zero 2 each holds its share of them, and the sum is all-reduced over dp too).
The scale min(1, max_norm / norm) stays a tensor: no host synchronisation.

A few kernels, not a few per parameter: the gradients are grouped by (device, dtype, weight)
and each group takes one `torch._foreach_norm` (float64 accumulation) and one stack of its
norms; the scale is one `torch._foreach_mul_` per (device, dtype). The sum of squares then
agrees with a per-parameter float64 sum to float64's last bits, not bit for bit (each norm
is a root, squared back).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridpar import trace
from hybridpar.pipeline.runtime.loss import Guard
from hybridpar.precision import grad_of
from hybridpar.sharded.attrs import get_parallel_dim, is_expert_shard
from hybridpar.topology import Topology

__all__ = ["clip_grad_norm_", "local_square_sum"]


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, topology: Topology, *,
                    guard: Guard, not_counted: Collection[int] = (),
                    norm_type: float = 2.0, sharded: bool = False) -> Tensor:
    """Scale the gradients of `params` so that their global norm is at most `max_norm`.

    Returns the norm before clipping (float32). `not_counted`: ids of parameters another
    stage counts (copies of a tie). `sharded`: each gradient lives on one dp rank (zero 2),
    so the sum is all-reduced over dp too.
    """
    if norm_type != 2.0:
        raise ValueError(f"clip_grad_norm_ supports the 2-norm only, got norm_type="
                         f"{norm_type}; leave norm_type at 2.0")
    params = list(params)
    tp = topology.tp
    experts = [p for p in params if is_expert_shard(p)]
    total = local_square_sum([p for p in params if not is_expert_shard(p)], tp,
                             topology.device, not_counted=not_counted)
    nbytes = total.element_size()
    if sharded and topology.dp > 1 and experts:
        # zero 2: each expert gradient lives on one rank of the dp group (ep x expert dp),
        # so the dp all-reduce below counts each once
        total = total + local_square_sum(experts, tp, topology.device,
                                         not_counted=not_counted)
    elif topology.ep > 1:   # each ep rank holds other experts: their squares summed over ep
        mine = local_square_sum(experts, tp, topology.device, not_counted=not_counted)
        with trace.collective("all_reduce", nbytes), guard(
                "the all-reduce of the experts' gradient norm over ep", topology.ep_group):
            dist.all_reduce(mine, group=topology.ep_group)
        total = total + mine
    if tp > 1:
        with trace.collective("all_reduce", nbytes), guard(
                "the all-reduce of the gradient norm over tp", topology.tp_group):
            dist.all_reduce(total, group=topology.tp_group)
    if topology.pp > 1:
        with trace.collective("all_reduce", nbytes), guard(
                "the all-reduce of the gradient norm over pp", topology.pp_group):
            dist.all_reduce(total, group=topology.pp_group)
    if sharded and topology.dp > 1:
        with trace.collective("all_reduce", nbytes), guard(
                "the all-reduce of the gradient norm over dp", topology.dp_group):
            dist.all_reduce(total, group=topology.dp_group)
    norm = total.sqrt()
    # in float64, so float64 models clip as on one device; a multiply by 1.0 leaves a
    # gradient as it was
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    grads: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for p in params:
        grad = grad_of(p)
        if grad is not None:
            grads.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), group in grads.items():
        torch._foreach_mul_(group, scale.to(device, dtype))
    return norm.to(torch.float32)


def local_square_sum(params: Iterable[nn.Parameter], tp: int, device: torch.device, *,
                     not_counted: Collection[int] = ()) -> Tensor:
    """This rank's part of the squared norm (float64 on `device`), weighted as above.

    One `_foreach_norm` per (device, dtype, counted in full or 1 / tp) group of gradients:

        group                       norms (float64)      its part
        sharded (or tp = 1)         n_1 .. n_k           sum n_i^2
        replicated over tp          m_1 .. m_j           sum m_i^2 / tp
    """
    groups: dict[tuple[torch.device, torch.dtype, bool], list[Tensor]] = {}
    for p in params:
        grad = grad_of(p)
        if grad is None or id(p) in not_counted:
            continue
        whole = tp == 1 or get_parallel_dim(p) is not None
        grad = grad.detach()
        groups.setdefault((grad.device, grad.dtype, whole), []).append(grad)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for (_, _, whole), grads in groups.items():
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
        square = torch.stack(norms).square().sum().to(device)   # (len(grads),) -> ()
        total += square if whole else square / tp
    return total
