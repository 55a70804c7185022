"""The updated weights sent from their owner to the other dp ranks, overlapped with the next
forwards.

With the optimizer sharded over dp (`MasterWeights` at ``parallel.zero >= 1``) each rank
updates the parameters it owns and sends them to the others. The parameters are laid out once
as views of flat message buffers, each a run of consecutive parameters (in the model's order)
of one owner and one dtype, up to `bucket_bytes`, so a broadcast writes the receivers'
parameters in place (no copy, as ZeroRedundancyOptimizer's ``parameters_as_bucket_view``):

    model order   p0 p1 p2 p3 p4 p5        owners  0  0  1  1  1  0
    messages      m0 = [p0 p1] from 0      m1 = [p2 p3 p4] from 1      m2 = [p5] from 0

`launch` starts every message's broadcast, in that order on every rank, and returns; `wait`
finishes the messages that hold given parameters. `attach(module)` makes each layer of the
module (each of a pipe's stage layers) wait, in a forward pre-hook, for the messages of its
own parameters: the first forwards of the next step run while later messages are still on
the wire. Reading parameters otherwise (``state_dict``, a checkpoint, the replica
check) waits for everything first (`wait` with no argument; ``state_dict`` does it itself).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup, Work

from hybridpar import trace

__all__ = ["UpdateBroadcast"]


class UpdateBroadcast:
    """Broadcast `params` (each from its rank in `owners`, over the dp `group`) in place."""

    def __init__(self, params: Sequence[nn.Parameter], owners: Sequence[int],
                 group: ProcessGroup, *, bucket_bytes: int = 25 << 20) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        #: per message: (owner, its flat buffer, its parameters)
        self.messages: list[tuple[int, Tensor, list[nn.Parameter]]] = []
        self._message_of: dict[int, int] = {}     # id(parameter) -> message index
        run: list[nn.Parameter] = []
        run_owner = -1
        for p, owner in zip(params, owners, strict=True):
            if run and (owner != run_owner or p.dtype != run[0].dtype
                        or p.device != run[0].device
                        or sum(q.numel() for q in run) * p.element_size() >= bucket_bytes):
                self._add(run, run_owner)
                run = []
            run.append(p)
            run_owner = owner
        if run:
            self._add(run, run_owner)
        self._works: dict[int, Work] = {}          # message index -> its broadcast in flight

    @torch.no_grad()
    def _add(self, run: list[nn.Parameter], owner: int) -> None:
        """Message of `run`: one flat buffer, every parameter of it a view of its slice."""
        flat = torch.empty(sum(p.numel() for p in run), dtype=run[0].dtype,
                           device=run[0].device)
        offset = 0
        for p in run:
            view = flat[offset:offset + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
            self._message_of[id(p)] = len(self.messages)
            offset += p.numel()
        self.messages.append((owner, flat, run))

    @property
    def pending(self) -> int:
        """How many messages are on the wire."""
        return len(self._works)

    def launch(self) -> None:
        """Start every message's broadcast from its owner (after the owners' update)."""
        self.wait()                                  # a step's messages before the next's
        for m, (owner, flat, _) in enumerate(self.messages):
            with trace.collective("broadcast", flat.numel() * flat.element_size()):
                work = dist.broadcast(flat, src=dist.get_global_rank(self.group, owner),
                                      group=self.group, async_op=True)
            assert work is not None
            self._works[m] = work

    def wait(self, params: Iterable[Tensor] | None = None) -> None:
        """Finish the broadcasts of the messages holding `params` (None: all of them)."""
        if not self._works:
            return
        if params is None:
            needed = sorted(self._works)
        else:
            needed = sorted({self._message_of[id(p)] for p in params
                             if id(p) in self._message_of} & set(self._works))
        for m in needed:
            self._works.pop(m).wait()

    def attach(self, module: nn.Module) -> list[Any]:
        """Forward pre-hooks on `module`'s layers (its children: a pipe's stage layers) that
        hold parameters of a message (each waits for its own), and a ``state_dict`` pre-hook
        that waits for all; the handles. The hooks run eager (`torch.compiler.disable`): in a
        compiled block they are one break before its graph, never part of a guard."""
        handles = []
        for layer in module.children():
            own = [p for p in layer.parameters() if id(p) in self._message_of]
            if own:
                handles.append(layer.register_forward_pre_hook(
                    torch.compiler.disable(lambda _layer, _args, own=own: self.wait(own))))
        handles.append(module.register_state_dict_pre_hook(
            lambda *_: self.wait()))
        waiters = getattr(module, "param_waiters", None)   # HybridPipe's other readers
        if waiters is not None:
            waiters.append(self.wait)
        return handles
