"""Optimizers over disjoint parts of a rank's parameters, stepped as one.

ZeRO-1 under expert parallelism (`pipe_optimizer`): the dense parameters are replicated over
the whole dp group and the experts only over the expert-dp group (the dp ranks that hold
the same experts), so their states are dealt over different groups:

    part        parameters            state dealt over          dp 4, ep 2: a rank holds
    dense       all but the experts   dp group (dp ranks)       1 / 4 of the dense state
    experts     its E / ep experts    expert-dp group (dp / ep) 1 / 2 of its experts' state

`SplitOptimizer` steps, zeroes and exposes the parts as one optimizer (``param_groups``:
every part's, so setting ``lr`` there reaches all); a checkpoint takes each part's state
(`parts_of`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["SplitOptimizer", "parts_of"]


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


def parts_of(optimizer: Any) -> list[Any]:
    """The optimizers `optimizer` is made of: a `SplitOptimizer`'s parts, else itself."""
    return list(optimizer.parts) if isinstance(optimizer, SplitOptimizer) else [optimizer]
