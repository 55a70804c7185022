"""A balance by name ("time", "size", "params", "uniform"): the same list on every rank."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hybridpar.balance import BALANCERS, balance_by
from hybridpar.comm.agreement import fail_together
from hybridpar.comm.broadcast import broadcast_tensors
from hybridpar.pipeline.runtime.microbatch import TensorOrTensors
from hybridpar.sharded.attrs import get_parallel_dim
from hybridpar.topology import Topology

__all__ = ["choose_balance"]

log = logging.getLogger(__name__)


def choose_balance(module: nn.Sequential, name: str, topo: Topology, *,
                   sample: TensorOrTensors | None, chunks: int,
                   init_fn: Callable[[nn.Module], None] | None,
                   parts: int | None = None) -> list[int]:
    """Resolve ``balance="time" | "size" | "params" | "uniform"`` to the same list on every rank
    (`parts` layer counts: by default one per pipeline stage, pp).

    Global rank 0 profiles and broadcasts its choice; when the model already holds sharded
    layers (their collectives need every tp peer), every rank profiles alongside it.
    """
    if name not in BALANCERS:
        raise ValueError(f"unknown balance {name!r}; give a list of layer counts per stage or "
                         "one of " + ", ".join(repr(b) for b in BALANCERS))
    if name in ("time", "size") and sample is None:
        raise ValueError(f"balance={name!r} profiles the model on a sample: pass "
                         "balance_sample=<a mini-batch of input> (one rank profiles it), or use "
                         "balance='params' / 'uniform'")
    sharded = any(get_parallel_dim(p) is not None for p in module.parameters())
    # profiled on the run's device, under the caller's autocast (timing synchronises it)
    options: dict[str, Any] = {"tp": topo.tp, "device": topo.device, "init_fn": init_fn} \
        if name in ("time", "size") else {}
    if name == "size":
        options["chunks"] = chunks
    choice: list[int] = []
    with fail_together((ValueError, TypeError, RuntimeError)):  # profiling may fail on one rank
        if topo.rank == 0 or (sharded and name in ("time", "size")):
            choice = list(balance_by(name, parts or topo.pp, module, sample, **options))
    (counts,) = broadcast_tensors(
        (torch.tensor(choice, dtype=torch.int64),) if topo.rank == 0 else None, 0,
        device=topo.device)
    if topo.rank == 0:
        log.info("balance=%r chose %s for %d stages", name, choice, parts or topo.pp)
    return [int(c) for c in counts.tolist()]
