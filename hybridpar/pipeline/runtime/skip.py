"""Cross-stage skip connections on top of torchgpipe.skip: routes and a per-stage tracker.

A skippable layer calls ``current_skip_tracker().save / .load``; the tracker of a stage
decides where a stashed tensor goes:

    stashed on   popped on   what happens
    stage a      stage a     kept in the tracker, popped locally
    stage a      stage b>a   sent a -> b directly after F(i) on a; received before F(i) on b;
                             its gradient returns b -> a in B(i)

Routes are ordered by (stash layer, pop layer, name): the same on every process, unlike
torchgpipe's own order, which sorts namespaces by a random UUID per process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor, nn
from torchgpipe.microbatch import Batch
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.skippable import Skippable, verify_skippables
from torchgpipe.skip.tracker import SkipTracker

__all__ = ["SkipRoute", "StageSkipTracker", "skip_routes"]


@dataclass(frozen=True)
class SkipRoute:
    """One skip tensor: stashed by layer `stash_layer` on `src`, popped on `dst`."""

    ns: Namespace
    name: str
    stash_layer: int
    pop_layer: int
    src: int
    dst: int

    @property
    def key(self) -> tuple[Namespace, str]:
        return (self.ns, self.name)


def skip_routes(module: nn.Sequential, balance: Sequence[int]) -> list[SkipRoute]:
    """Every skip of `module` with its stages under `balance`, in a process-independent order.

    Raises torchgpipe's `TypeError` (from `verify_skippables`) for a stash without a pop, a
    pop without a stash, or a name used twice in one namespace.
    """
    verify_skippables(module)
    stage_of = [s for s, count in enumerate(balance) for _ in range(count)]
    stashed: dict[tuple[Namespace, str], int] = {}
    routes = []
    for index, layer in enumerate(module.children()):
        if not isinstance(layer, Skippable):
            continue
        for ns, name in layer.stashable():
            stashed[(ns, name)] = index
        for ns, name in layer.poppable():
            at = stashed.pop((ns, name))
            routes.append(SkipRoute(ns, name, at, index, stage_of[at], stage_of[index]))
    routes.sort(key=lambda r: (r.stash_layer, r.pop_layer, r.name))
    return routes


class StageSkipTracker(SkipTracker):
    """The skip tracker of one stage for one micro-batch (see the module table)."""

    def __init__(self, routes: Sequence[SkipRoute], stage: int,
                 incoming: dict[tuple[Namespace, str], Tensor | None]) -> None:
        super().__init__()
        self.dst_of = {r.key: r.dst for r in routes}
        self.stage = stage
        self.incoming = incoming
        self.outgoing: dict[tuple[Namespace, str], Tensor | None] = {}

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Tensor | None) -> None:
        if self.dst_of.get((ns, name), self.stage) == self.stage:
            super().save(batch, ns, name, tensor)
            return
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(f"skip '{name}' crosses stages and must be a Tensor or None, "
                            f"got {type(tensor).__name__}")
        self.outgoing[(ns, name)] = tensor   # None travels as an absent tensor (no bytes)

    def load(self, batch: Batch, ns: Namespace, name: str) -> Tensor | None:
        if (ns, name) in self.incoming:
            # Not popped: a recomputation of this micro-batch loads the same tensor again.
            return self.incoming[(ns, name)]
        return super().load(batch, ns, name)
