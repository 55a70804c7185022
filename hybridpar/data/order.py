"""The seeded, endless order in which a run visits its windows: (epoch, index), resumable."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["WindowOrder"]


class WindowOrder:
    """Epoch e visits window ids ``randperm(windows, generator seeded with seed + e)``; the
    stream runs on into the next epoch. A subclass sets ``windows`` and ``seed`` and calls
    `start_order`; (``epoch``, ``index`` into its order) is the position it saves."""

    windows: int
    seed: int
    epoch: int
    index: int

    def start_order(self) -> None:
        """Position 0 of epoch 0."""
        self.epoch, self.index = 0, 0
        self._order_epoch, self._order = -1, torch.empty(0, dtype=torch.int64)

    def order(self, epoch: int) -> Tensor:
        """The window ids of `epoch` in visiting order: ``(windows,)``."""
        if epoch != self._order_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._order, self._order_epoch = torch.randperm(self.windows, generator=g), epoch
        return self._order

    def _take(self, count: int) -> Tensor:
        """The next `count` window ids of the stream, advancing the position."""
        parts = []
        while count:
            n = min(count, self.windows - self.index)
            parts.append(self.order(self.epoch)[self.index:self.index + n])
            self.index, count = self.index + n, count - n
            if self.index == self.windows:
                self.epoch, self.index = self.epoch + 1, 0
        return torch.cat(parts)
