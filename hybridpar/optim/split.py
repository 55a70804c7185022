"""Optimizers over disjoint parts of a rank's parameters, stepped as one.

ZeRO under expert parallelism (`pipe_optimizer`): the dense parameters are replicated over
the whole dp group and the experts only over the expert-dp group (the dp ranks that hold
the same experts), so their states (at zero 2 their gradients too) are dealt over
different groups:

    part        parameters            state dealt over          dp 4, ep 2: a rank holds
    dense       all but the experts   dp group (dp ranks)       1 / 4 of the dense state
    experts     its E / ep experts    expert-dp group (dp / ep) 1 / 2 of its experts' state

`SplitOptimizer` steps, zeroes and exposes the parts as one optimizer (``param_groups``:
every part's, so setting ``lr`` there reaches all); a checkpoint takes each part's state
(`parts_of`). With bf16 weights the parts are `MasterWeights` (each sharding its masters
over its group) and the split answers for them as one (`masters`, `wait_params`, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridpar.optim.master import MasterWeights

__all__ = ["SplitOptimizer", "has_masters", "parts_of"]


class SplitOptimizer:
    """`parts` (optimizers over disjoint parameters) stepped as one (module docstring)."""

    def __init__(self, parts: Sequence[Any]) -> None:
        self.parts = list(parts)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for part in self.parts for g in part.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for part in self.parts:
            part.step()

    # bf16 weights: the parts are `MasterWeights`, and what is asked of one goes to each
    @property
    def masters(self) -> dict[int, Any] | None:
        held = [part.masters for part in self.parts if isinstance(part, MasterWeights)]
        return {k: v for masters in held for k, v in masters.items()} if held else None

    def copies(self) -> list[Any]:
        return [t for part in self._masters() for t in part.copies()]

    def wait_params(self) -> None:
        for part in self._masters():
            part.wait_params()

    def copy_to_params(self, *, wait: bool = True) -> None:
        for part in self._masters():
            part.copy_to_params(wait=wait)

    def copy_from_params(self) -> None:
        for part in self._masters():
            part.copy_from_params()

    def _masters(self) -> list[MasterWeights]:
        return [part for part in self.parts if isinstance(part, MasterWeights)]


def parts_of(optimizer: Any) -> list[Any]:
    """The optimizers `optimizer` is made of: a `SplitOptimizer`'s parts, else itself."""
    return list(optimizer.parts) if isinstance(optimizer, SplitOptimizer) else [optimizer]


def has_masters(optimizer: Any) -> bool:
    """Whether `optimizer` steps float32 masters of bf16 weights (`MasterWeights`, or a
    `SplitOptimizer` of them)."""
    return any(isinstance(part, MasterWeights) for part in parts_of(optimizer))
