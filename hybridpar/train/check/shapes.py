"""A dry run's shape pass: what every stage sends, and what the headers it receives say.

In a step of new shapes every forward-direction message carries a header that the receiver
reads on the host (`comm.Incoming.learn`), and a fake receive delivers nothing. So before its
steps each rank runs its stages on fake inputs shaped as their upstream stages send them and
derives the `comm.MessageSpec` of every FWD / SKIP message they send, for each dry step's
batch (`ShapePass.run`); ranks go in order, stage s - 1 before stage s, or in rounds with
virtual stages (`ShapePass.done` says when a rank's stages all had theirs). In the steps the
headers travel (sent, received, waited for, in the groups NCCL sees), and what a received one
says is the spec its sender's pass found (`ShapePass.headers`, for
`comm.delivering_headers`): the receiver decodes it and posts its payloads from it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hybridpar.comm import p2p as comm
from hybridpar.pipe import HybridPipe
from hybridpar.pipeline.runtime.microbatch import signature
from hybridpar.pipeline.schedules.layout import Layout
from hybridpar.pipeline.schedules.lowering import FWD, SKIP
from hybridpar.topology import Topology

__all__ = ["ShapePass"]

SpecKey = tuple[int, int, int]   # (channel, peer stage, micro-batch), as executor.SpecKey
Where = tuple[int, int, int, int]   # (dry step, dp, stage, tp)


class ShapePass:
    """The specs every stage sends and receives in each dry step, as the passes found them."""

    def __init__(self) -> None:
        self.inbox: dict[Where, dict[SpecKey, comm.MessageSpec]] = {}   # what a stage receives
        self.passed: set[Where] = set()
        self.current = 0   # the dry step running: its specs answer the headers

    def done(self, at: Any, layout: Layout, steps: int) -> bool:
        """Whether every stage of the rank at coordinate `at` had its pass for every step."""
        return all((k, at.dp, s, at.tp) in self.passed for s in layout.stages_of(at.pp)
                   for k in range(steps))

    def run(self, pipe: HybridPipe, topo: Topology, inputs_of_steps: list[list[Any]]) -> None:
        """The pass of each stage of the rank not passed yet whose inputs are known, for each
        dry step's input micro-batches: run it on fake inputs shaped as its upstream stages
        send them, put what it sends in the inboxes of its downstream stages."""
        for k, inputs in enumerate(inputs_of_steps):
            for s in pipe.stages:
                self._stage(pipe, topo, s, inputs, k)

    def _stage(self, pipe: HybridPipe, topo: Topology, s: int, inputs: list[Any],
               k: int) -> None:
        dp, tp = topo.dp_rank, topo.tp_rank
        skip_in, _ = pipe.skips_of(s)
        received = self.inbox.get((k, dp, s, tp), {})
        needs = [(FWD, s - 1)] if s > 0 else []
        needs += [(SKIP, src) for src in skip_in]
        if (k, dp, s, tp) in self.passed or not all(
                (channel, src, i) in received for channel, src in needs
                for i in range(len(inputs))):
            return
        sends: dict[Any, dict[tuple[int, int], Any]] = {}   # input specs -> what it sends
        part = pipe.partition_of(s)
        modes = {m: m.training for m in part.modules()}
        part.eval()   # the same shapes; no batch-norm statistics, no dropout drawn
        try:
            for i, first_input in enumerate(inputs):
                # outputs depend on input shapes only (the executor requires it): equal
                # micro-batches need one forward
                key = (signature([first_input]) if s == 0 else received[FWD, s - 1, i],
                       *(received[SKIP, src, i] for src in skip_in))
                if key not in sends:
                    sends[key] = _sends(pipe, s, first_input, received, i)
                for (channel, dst), spec in sends[key].items():
                    self.inbox.setdefault((k, dp, dst, tp), {})[channel, s, i] = spec
        finally:
            for m, training in modes.items():
                m.training = training
        self.passed.add((k, dp, s, tp))

    def headers(self, topo: Topology, signatures: list[int]
                ) -> Callable[[comm.Incoming], Tensor]:
        """What each header rank `topo` receives says: the spec its sender's pass found for
        the dry step running (`current`), and that step's signature."""
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        def deliver(message: comm.Incoming) -> Tensor:
            k = self.current
            received = self.inbox[k, topo.dp_rank, message.at, topo.tp_rank]
            spec = received[message.channel, message.stage, message.microbatch]
            with unset_fake_temporarily():   # a real header, read on the host for real
                return comm.header(spec, signatures[k], torch.device("cpu"))

        return deliver


def _sends(pipe: HybridPipe, s: int, first_input: Any, received: dict[SpecKey, Any],
           i: int) -> dict[tuple[int, int], Any]:
    """{(channel, peer stage): spec} of the messages stage `s` sends for micro-batch `i`."""
    from torchgpipe.skip.tracker import use_skip_tracker

    from hybridpar.pipeline.runtime.skip import StageSkipTracker

    skip_in, skip_out = pipe.skips_of(s)
    tp = pipe.topology.tp
    x = first_input if s == 0 else _fake_message(received[FWD, s - 1, i], pipe.device)
    incoming: dict[Any, Tensor | None] = {}
    for src, routes in skip_in.items():
        tensors = _fake_message(received[SKIP, src, i], pipe.device)
        incoming.update((r.key, t) for r, t in zip(routes, tensors))
    routes_here = [r for routes in (*skip_in.values(), *skip_out.values()) for r in routes]
    tracker = StageSkipTracker(routes_here, s, incoming)
    with torch.no_grad(), use_skip_tracker(tracker):
        out = pipe.partition_of(s)(x)
    last = s == pipe.layout.stages - 1
    sent = {} if last else {(FWD, s + 1): comm.spec_of(
        out if isinstance(out, tuple) else (out,), tp, grads=True,
        single=isinstance(out, Tensor))}
    for dst, routes in skip_out.items():
        sent[SKIP, dst] = comm.spec_of([tracker.outgoing[r.key] for r in routes], tp,
                                       grads=True, single=False)
    return sent


def _fake_message(spec: Any, device: torch.device) -> Any:
    """The tensors `comm.Incoming.finish` delivers for a message of `spec`."""
    from hybridpar.sharded.attrs import register_parallel_dim

    out: list[Tensor | None] = []
    for s in spec.tensors:
        if s.absent:
            out.append(None)
            continue
        t = torch.empty(s.shape, dtype=s.dtype, device=device)
        if s.tag is not None:
            register_parallel_dim(t, s.tag)
        out.append(t.requires_grad_(s.requires_grad))
    return out[0] if spec.single else tuple(out)
