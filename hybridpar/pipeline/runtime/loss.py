"""The step's loss on every rank: sent from the last stage to the others, averaged over dp.

    backend   during the schedule                  after the schedule
    NCCL      -                                    pp-group broadcast from the last stage
    gloo      the others post a receive on its     the last stage sends it to each of them
              own tag (`LOSS_TAG`) when they
              first wait for a peer

gloo moves a message once its receive is posted, so a loss received only after the schedule
costs a round trip at the end of every step, on the stage that ends last. Posted before the
schedule, it costs the first stage's first compute (the whole pipeline waits for it) a post;
posted when the stage first waits for a peer, it costs nothing (`StageExecutor.run`'s
`when_idle`). gloo has no rendezvous and honours tags: on its own tag the loss never meets a
stage-to-stage message (all on tag 0), so posting it early is safe there. On NCCL a receive
posted early would hold the rank's P2P stream until the end of the schedule: there the loss
is broadcast after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar import trace
from hybridpar.pipeline.runtime.step import nbytes
from hybridpar.topology import Topology

__all__ = ["LOSS_TAG", "Guard", "LossShare"]

LOSS_TAG = 1 << 13   # gloo only: the loss, last stage -> the others (NCCL: a broadcast)

Guard = Callable[[str, ProcessGroup], contextlib.AbstractContextManager[None]]


class LossShare:
    """Brings the last stage's loss of each step to every rank of its pipeline (see above).

    `guard(operation, group)` wraps the collectives so that a timeout names them.
    """

    def __init__(self, topology: Topology, guard: Guard, *, last: int | None = None) -> None:
        """`last`: the pipeline rank of the stage that computes the loss (default pp - 1)."""
        self.topology, self.guard = topology, guard
        self.device = topology.device
        self.last_stage = topology.pp - 1 if last is None else last
        self.last = topology.stage_rank(self.last_stage)
        self._posted: tuple[Tensor, Any] | None = None

    def post(self) -> None:
        """During the schedule (gloo, not the last stage): post the loss's receive."""
        topo = self.topology
        self._posted = None
        if self.device.type != "cpu" or topo.pp_rank == self.last_stage or topo.pp == 1:
            return
        box = torch.zeros((), dtype=torch.float32, device=self.device)
        self._posted = box, dist.irecv(box, self.last, tag=LOSS_TAG)

    def share(self, local: Tensor | None) -> Tensor:
        """After the schedule: the loss on every rank (float32), averaged over dp replicas.

        A one-to-all over the pp group, counted as one broadcast per rank.
        """
        topo = self.topology
        loss = local.detach().to(self.device, torch.float32, copy=True) if local is not None \
            else torch.zeros((), dtype=torch.float32, device=self.device)
        posted, self._posted = self._posted, None
        if topo.pp > 1:
            with trace.collective("broadcast", nbytes(loss)), self.guard(
                    "the loss from the last stage", topo.pp_group):
                if self.device.type != "cpu":
                    dist.broadcast(loss, self.last, group=topo.pp_group)
                elif topo.pp_rank == self.last_stage:
                    works = [dist.isend(loss, topo.stage_rank(s), tag=LOSS_TAG)
                             for s in range(topo.pp) if s != self.last_stage]
                    for work in filter(None, works):
                        work.wait(topo.timeout)
                else:   # posted when the step first waited (at the latest for its sends)
                    assert posted is not None, "the loss's receive was never posted"
                    loss, work = posted
                    work.wait(topo.timeout)
        if topo.dp > 1:
            with trace.collective("all_reduce", nbytes(loss)), self.guard(
                    "the all-reduce of the loss over dp", topo.dp_group):
                dist.all_reduce(loss, group=topo.dp_group)
            loss /= topo.dp
        return loss
