"""The bytes a step keeps for backward: autograd's saved tensors, counted by storage.

    class              counts                                  used by
    StorageSum         distinct storages while they live, and  both below, LiveBytes
                       the peak of their sum
    SavedActivations   what autograd saves (pack hook) and     `hybridpar check` (fake
                       what a split backward's I keeps for     ranks), a traced step of a
                       its W (`split_backward.observing_kept`) real run (`HybridPipe(trace=
                                                               True)`: "kept" in the table)

A storage counts once (a view and its base, a tensor saved by two operations), with its
size, from its first save until it is freed; a freed storage is found (its weak reference
expired) when a new one would make a new peak, so the peak is exact and the bookkeeping
cheap. Parameters and buffers are excluded (`exclude`): they are there anyway. Inside a
checkpointed region (torch's checkpoint: `pipeline.activations.layer_checkpoint`, `recompute`)
torch's own hooks take the saves, so what such a region drops is not counted, what it keeps (its
inputs) is, and so is not its recomputation in backward (one region at a time); the pipe's
own recomputation of a stage (``"always"``, ``"except_last"``) runs under these hooks and is
counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from hybridpar.pipeline.activations.split_backward import observing_kept

__all__ = ["SavedActivations", "StorageSum", "storage_key"]


def storage_key(t: Tensor) -> int:
    """The identity of `t`'s storage (views of one base share it)."""
    return int(t.untyped_storage()._cdata)


class StorageSum:
    """The bytes of the distinct storages counted while they live, and their peak sum."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.total = 0   # of `live`, freed storages included until the next sweep
        self.peak = 0

    def _add(self, key: int, t: Tensor) -> None:
        """Count `t`'s storage once while it lives; a new peak when the sum passes it."""
        known = self.live.get(key)
        if known is not None and not known[0].expired():
            return
        if known is not None:   # a freed storage's address, reused
            self.total -= known[1]
        storage = t.untyped_storage()
        self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.total += storage.nbytes()
        if self.total > self.peak:   # a new peak only if the freed ones do not hide it
            for k in [k for k, (ref, _) in self.live.items() if ref.expired()]:
                self.total -= self.live.pop(k)[1]
            self.peak = max(self.peak, self.total)


class SavedActivations(StorageSum):
    """The peak bytes of tensors saved for backward while `track()` is active (see above)."""

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        super().__init__()
        self.exclude = {storage_key(t) for t in exclude}

    def _pack(self, t: Tensor) -> Tensor:
        key = storage_key(t)
        if key not in self.exclude:
            self._add(key, t)
        return t

    @contextmanager
    def track(self) -> Iterator[SavedActivations]:
        """Count what autograd saves, and what a split backward's I keeps for its W (the
        output gradients of the linear layers: `split_backward.observing_kept`)."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t), \
                observing_kept(self._pack):
            yield self
