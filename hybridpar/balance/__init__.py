"""Choose a pipeline balance: split an nn.Sequential by time, memory, parameters or evenly.

torchgpipe-compatible entry points (same positional arguments, more keyword options)::

    balance = balance_by_time(4, model, sample, timeout=1.0)         # [3, 4, 4, 3]
    balance = balance_by_size(4, model, batch, chunks=8, param_scale=4.0)

    by        cost of a layer (profiled; see `profile`)                 solver
    "time"    forward + backward ms (tp shard, + its collectives)        min-max, boundary =
              + boundary: 2 * output bytes / p2p_bandwidth               send after the stage
    "size"    params * param_scale + buffers + activations of one        min-max
              micro-batch (ceil(batch / chunks) rows)
    "params"  parameter count (+ a tie-breaking epsilon per layer)       min-max
    "uniform" -                                                          counts as even as possible

Every split is exact (`solver.solve`, not torchgpipe's approximate blockpartition), never
has an empty stage, and is deterministic for given costs. `balance_by_time(...,
max_stage_bytes=...)` returns the fastest split whose stages all fit the cap, or raises a
ValueError naming the smallest cap that works. `profile_layers` + `balance_profiles` +
`stage_table` / `format_table` give the numbers behind a split (``hybridpar balance``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from hybridpar.balance.profile import (
    DEFAULT_BANDWIDTH,
    LayerProfile,
    TensorOrTensors,
    boundary_ms,
    check_module,
    link_bandwidth,
    profile_layers,
)
from hybridpar.balance.solver import min_cap, solve
from hybridpar.balance.table import StageRow, format_table, imbalance, stage_table

__all__ = [
    "BALANCERS",
    "LayerProfile",
    "StageRow",
    "balance_by",
    "balance_by_params",
    "balance_by_size",
    "balance_by_time",
    "balance_profiles",
    "balance_uniform",
    "format_table",
    "imbalance",
    "profile_layers",
    "solve",
    "stage_table",
]

BALANCERS = ("time", "size", "params", "uniform")
_MiB = 2**20


def _check_partitions(partitions: object, module: nn.Sequential) -> int:
    if isinstance(partitions, bool) or not isinstance(partitions, int):
        raise TypeError(f"partitions must be an int (the number of stages), got {partitions!r}")
    if not 1 <= partitions <= len(module):
        raise ValueError(f"cannot split {len(module)} layers into {partitions} non-empty "
                         f"stages; choose partitions between 1 and {len(module)}")
    return partitions


def balance_profiles(profiles: Sequence[LayerProfile], partitions: int, *, by: str = "time",
                     p2p_bandwidth: float = DEFAULT_BANDWIDTH["cpu"],
                     max_stage_bytes: float | None = None,
                     param_scale: float = 2.0) -> list[int]:
    """The exact split of profiled layers by "time" (with boundaries) or "size"."""
    memory = [p.memory(param_scale) for p in profiles]
    if by == "size":
        return solve(memory, partitions)
    if by != "time":
        raise ValueError(f"balance_profiles splits by 'time' or 'size', got {by!r}")
    times = [p.time_ms for p in profiles]
    boundary = boundary_ms(list(profiles), p2p_bandwidth)
    if max_stage_bytes is None:
        return solve(times, partitions, boundary=boundary)
    need = min_cap(memory, partitions)
    if max_stage_bytes < need:
        need_bytes = math.ceil(need)
        raise ValueError(
            f"max_stage_bytes={max_stage_bytes} ({max_stage_bytes / _MiB:.1f} MiB) is too "
            f"small for {partitions} stages: the smallest cap that works is {need_bytes} bytes "
            f"({need_bytes / _MiB:.1f} MiB); raise max_stage_bytes to at least that, or use "
            "more stages, more chunks, or a smaller param_scale"
        )
    return solve(times, partitions, boundary=boundary, memory=memory,
                 max_block_memory=max_stage_bytes)


def balance_by_time(partitions: int, module: nn.Sequential, sample: TensorOrTensors, *,
                    timeout: float = 1.0, device: torch.device | str = "cpu", tp: int = 1,
                    max_stage_bytes: float | None = None, chunks: int = 1,
                    param_scale: float = 2.0, p2p_bandwidth: float | None = None,
                    tp_bandwidth: float | None = None, progress: bool = False,
                    init_fn: Callable[[nn.Module], None] | None = None) -> list[int]:
    """Layer counts per stage minimizing the slowest stage's forward + backward time.

    Each layer is profiled on `sample` for about ``timeout / len(module)`` s (median). A
    stage's time includes sending its output (and receiving the gradient) at
    `p2p_bandwidth` bytes/s (default `DEFAULT_BANDWIDTH` of the device type; ``math.inf``
    ignores it). With `max_stage_bytes`, stages must also fit that memory (measured as
    `balance_by_size` does, with `chunks` and `param_scale`). With tp > 1, layers count as
    their tensor-parallel shard (`hybridpar.balance.tp`).
    """
    _check_partitions(partitions, check_module(module))
    bandwidth = link_bandwidth(p2p_bandwidth, torch.device(device), "p2p_bandwidth")
    if tp_bandwidth is None:
        tp_bandwidth = bandwidth
    profiles = profile_layers(module, sample, timeout=timeout, chunks=chunks, device=device,
                              tp=tp, tp_bandwidth=tp_bandwidth,
                              measure_size=max_stage_bytes is not None, progress=progress,
                              init_fn=init_fn)
    return balance_profiles(profiles, partitions, by="time", p2p_bandwidth=bandwidth,
                            max_stage_bytes=max_stage_bytes, param_scale=param_scale)


def balance_by_size(partitions: int, module: nn.Sequential, input: TensorOrTensors, *,
                    chunks: int = 1, param_scale: float = 2.0,
                    device: torch.device | str = "cpu", tp: int = 1,
                    progress: bool = False,
                    init_fn: Callable[[nn.Module], None] | None = None) -> list[int]:
    """Layer counts per stage minimizing the largest stage memory.

    A layer's memory is its parameters times `param_scale` (2: weights + gradients; about 4
    with Adam) plus buffers plus the activations it saves for backward on the first
    micro-batch of `input` split into `chunks`.
    """
    _check_partitions(partitions, check_module(module))
    profiles = profile_layers(module, input, chunks=chunks, device=device, tp=tp,
                              measure_time=False, progress=progress, init_fn=init_fn)
    return balance_profiles(profiles, partitions, by="size", param_scale=param_scale)


def balance_by_params(partitions: int, module: nn.Sequential) -> list[int]:
    """Layer counts per stage minimizing the largest stage parameter count (no profiling).

    A layer costs ``params * 2n + 1`` (integers, exact): the +1 only separates splits with
    the same largest stage, so layers without parameters spread out instead of piling up,
    and a model without parameters splits evenly.
    """
    n = len(check_module(module))
    _check_partitions(partitions, module)
    counts = [sum(p.numel() for p in layer.parameters()) for layer in module.children()]
    return solve([c * 2 * n + 1 for c in counts], partitions)


def balance_uniform(partitions: int, module: nn.Sequential) -> list[int]:
    """Layer counts as even as possible, the larger first (10 layers, 4 stages: [3, 3, 2, 2])."""
    n = len(check_module(module))
    _check_partitions(partitions, module)
    base, extra = divmod(n, partitions)
    return [base + 1] * extra + [base] * (partitions - extra)


def balance_by(name: str, partitions: int, module: nn.Sequential,
               sample: TensorOrTensors | None = None, **kw: Any) -> list[int]:
    """Dispatch on `name`: "time" | "size" (need `sample`) | "params" | "uniform"."""
    if name not in BALANCERS:
        raise ValueError(f"unknown balance {name!r}; choose one of "
                         + ", ".join(repr(b) for b in BALANCERS))
    if name in ("params", "uniform"):
        fn = balance_by_params if name == "params" else balance_uniform
        return fn(partitions, module, **kw)
    if sample is None:
        raise ValueError(f"balance {name!r} profiles the model and needs a sample input; "
                         "pass an example mini-batch, or use 'params' or 'uniform'")
    if name == "time":
        return balance_by_time(partitions, module, sample, **kw)
    return balance_by_size(partitions, module, sample, **kw)
