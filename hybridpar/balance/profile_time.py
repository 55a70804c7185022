"""The profiler's time pass: a layer's forward + backward, the lower median of repeated runs."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridpar.balance.layer_run import ProfileSkipTracker, feed, run_backward, run_forward, sync
from hybridpar.balance.tp import collective_group

__all__ = ["time_layer"]


def time_layer(layer: nn.Module, index: int, name: str, x: tuple[Tensor, ...], grad: bool,
               tracker: ProfileSkipTracker, budget: float,
               device: torch.device) -> tuple[float, tuple[Tensor, ...]]:
    """Lower-median forward + backward seconds of runs filling `budget` s, after a warm-up.

    The warm-up (not counted) absorbs one-off costs: allocator growth, lazy initialization,
    the first autograd call of the process. At least two runs are timed, so that one late
    wake-up or preemption cannot decide a layer's time on its own.
    """
    runs: list[float] = []
    out = run_forward(layer, index, name, x, tuple(feed(t, grad) for t in x))
    run_backward(out, tracker)
    began = time.perf_counter()
    group = collective_group(layer)

    def more() -> bool:
        want = len(runs) < 2 or time.perf_counter() - began < budget
        if group is None:
            return want
        # a sharded layer runs collectives: every rank repeats while any rank wants to
        flag = torch.tensor([int(want)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    while more():
        inputs = tuple(feed(t, grad) for t in x)  # copied outside the timed region
        sync(device)
        tick = time.perf_counter()
        out = run_forward(layer, index, name, x, inputs)
        run_backward(out, tracker)
        sync(device)
        runs.append(time.perf_counter() - tick)
    # the lower median: noise (preemption, late wake-ups) only ever adds time
    return statistics.median_low(runs), tuple(t.detach() for t in out)
