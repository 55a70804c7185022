"""The replica check: every copy of a replicated parameter holds the same values and gradients.

A parameter is held by several ranks when it is replicated over tp (not a shard), over dp
(every parameter), or tied across stages (one copy per owning stage). Training keeps the
copies equal only if every rank gets the same gradient; a gradient that is one rank's part
(`pipeline.parameters.partial`) lets them drift apart silently. The check makes that an error:

    group      the copies                                compared
    tp         a parameter without a parallel dim        values; gradients (after reduction)
    dp         every parameter                           values; gradients (after reduction)
    tie        the copies of a tie on its stages         values; gradients (after reduction)

Per group, two all-reduces (MAX and MIN) of the copies, flattened in chunks and widened to at
least float32, give every rank of the group the spread max - min of each element; a spread
above `atol` is a mismatch, named by the parameter, its group, the ranks and the difference.
Then one all-reduce of each rank's worst spread over the world, so that every rank raises,
those outside the group pointing at the ranks that name it. Cost: per group, twice the
parameters and gradients in all-reduces, and the same again in memory for one chunk.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar import trace
from hybridpar.pipeline.runtime.loss import Guard
from hybridpar.precision import grad_or_zeros

__all__ = ["CHUNK", "ReplicaGroup", "ReplicaMismatchError", "check_replicas"]

CHUNK = 1 << 24                 # elements per all-reduce (64 MiB in float32)


_HINTS = {   # what makes copies of each group drift, and what to do
    "tp": "tp: a parameter used on a tp shard gets only its rank's part of the gradient: mark "
          "it with hybridpar.nn.register_partial_grad(param) or the 'replicate_sum_grad' style "
          "of a tp_plan (or report the model);",
    "dp": "dp: the replicas' gradients were not averaged alike (a parameter unused on some "
          "replicas, an optimizer stepped on one rank only); on GPUs, non-deterministic "
          "kernels differ by rounding: allow it with atol (parallel.replica_atol);",
    "tie": "tie: the copies of a tied parameter on different stages started or stepped apart "
           "(an optimizer that skips one of them);",
}


class ReplicaMismatchError(RuntimeError):
    """Copies of a replicated parameter differ across the ranks that hold them."""


@dataclass
class ReplicaGroup:
    """A group of ranks holding copies of `params` (named), in the same order on each."""

    kind: str                               # "tp", "dp" or "tie"
    group: ProcessGroup
    params: list[tuple[str, nn.Parameter]]
    grads: bool = True                      # compare gradients too (not when dp-sharded)


def _chunks(tensors: Sequence[tuple[str, Tensor]]) -> Iterator[list[tuple[str, Tensor]]]:
    """`tensors` in runs of about CHUNK elements (a larger tensor alone)."""
    run: list[tuple[str, Tensor]] = []
    size = 0
    for name, t in tensors:
        if run and size + t.numel() > CHUNK:
            yield run
            run, size = [], 0
        run.append((name, t))
        size += t.numel()
    if run:
        yield run


def _spreads(tensors: Sequence[tuple[str, Tensor]], group: ProcessGroup
             ) -> list[tuple[float, str]]:
    """(max over elements of max - min across the group, name) of each tensor."""
    out: list[tuple[float, str]] = []
    for run in _chunks(tensors):
        dtype = torch.promote_types(run[0][1].dtype, torch.float32)
        high = torch.cat([t.detach().reshape(-1).to(dtype) for _, t in run])
        low = high.clone()
        with trace.collective("all_reduce", 2 * high.numel() * high.element_size()):
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        spread = (high - low).nan_to_num(nan=0.0)   # equal NaN / inf copies are no mismatch
        sizes = [t.numel() for _, t in run]
        worst = [s.max() if s.numel() else spread.new_zeros(())
                 for s in spread.split(sizes)]
        out.extend(zip(torch.stack(worst).tolist(), [name for name, _ in run]))  # one sync
    return out


def check_replicas(groups: Sequence[ReplicaGroup], *, rank: int, world: int,
                   device: torch.device, guard: Guard, atol: float = 0.0) -> float:
    """Raise `ReplicaMismatchError` on every rank when any copies differ by more than `atol`.

    Call it on every rank at the same point (after a `train_step`: the gradients are
    reduced). Returns the largest difference found (0.0: all copies equal).
    """
    found: list[str] = []
    worst = 0.0
    for g in groups:
        ranks = dist.get_process_group_ranks(g.group)
        values = [(name, p) for name, p in g.params if p.is_floating_point()]
        grads = [(name, grad_or_zeros(p)) for name, p in values] if g.grads else []
        with guard(f"the replica check over {g.kind}", g.group):
            spreads = [(d, name, "values") for d, name in _spreads(values, g.group)] + \
                [(d, name, "gradients") for d, name in _spreads(grads, g.group)]
        for d, name, what in spreads:
            worst = max(worst, d)
            if d > atol:
                found.append(f"'{name}' differs in {what} by {d:.3g} across its {g.kind} "
                             f"replicas (ranks {ranks})")
    board = torch.zeros(world, dtype=torch.float64, device=device)
    board[rank] = worst
    world_group = dist.group.WORLD
    assert world_group is not None
    with guard("the replica check's agreement", world_group):
        dist.all_reduce(board)
    bad = [r for r in range(world) if board[r] > atol]
    if found:
        more = f" (and {len(found) - 4} more)" if len(found) > 4 else ""
        kinds = [k for k in _HINTS if any(f"its {k} replicas" in f for f in found)]
        raise ReplicaMismatchError(
            f"replicated parameters differ on rank {rank}: {'; '.join(found[:4])}{more}. "
            + " ".join(_HINTS[k] for k in kinds))
    if bad:
        raise ReplicaMismatchError(
            f"replicated parameters differ on ranks {bad} (largest difference "
            f"{float(board.max()):.3g}); their errors name the parameters and groups")
    return float(board.max())
