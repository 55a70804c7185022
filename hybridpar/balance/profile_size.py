"""The profiler's size pass: the activation bytes one forward of a layer keeps until backward.

Activation bytes (CPU): the unique storages the layer's forward keeps alive until backward,
excluding its parameters and buffers: those saved for backward (saved-tensor hooks) and
every tensor the forward made that is still referenced after it (a leaf of the graph, a
tensor the module stores; a dispatch mode tracks them), its output only if it saved it. An
input the previous layer already saved (its output, kept by both) counts once, toward the
earlier layer. On a GPU: the growth of `torch.cuda.memory_allocated`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hybridpar.balance.layer_run import ProfileSkipTracker, feed, run_forward, sync

__all__ = ["size_layer"]


def _storages(tensors: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


class _Allocations(TorchDispatchMode):
    """Every tensor an op makes inside the block, by weak reference: `alive` are those still
    referenced afterwards (by the autograd graph, the output or the module)."""

    def __init__(self) -> None:
        super().__init__()
        self._made: list[weakref.ref[Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self._made.append(weakref.ref(t))
        return out

    def alive(self) -> dict[int, int]:
        """{storage address: bytes} of the tensors made in the block and still alive."""
        found: dict[int, int] = {}
        for ref in self._made:
            t = ref()
            if t is not None:
                storage = t.untyped_storage()
                found[storage.data_ptr()] = storage.nbytes()
        return found


def size_layer(layer: nn.Module, index: int, name: str, x: tuple[Tensor, ...], grad: bool,
               tracker: ProfileSkipTracker, device: torch.device,
               kept: set[int]) -> tuple[int, tuple[Tensor, ...], set[int]]:
    """Activation bytes saved by one forward of `layer` on the micro-batch `x`.

    `kept`: storages of `x` that the previous layer already saved. Returns the bytes, the
    output, and which of the output's storages this layer saved (for the next layer).
    """
    inputs = tuple(feed(t, grad) for t in x)
    if device.type == "cuda":
        # what the forward allocates and keeps: saved tensors and the output (not tested on CI)
        sync(device)
        before = torch.cuda.memory_allocated(device)
        out = run_forward(layer, index, name, x, inputs)
        sync(device)
        used = torch.cuda.memory_allocated(device) - before
        tracker.fresh.clear()
        return max(used, 0), tuple(t.detach() for t in out), set()
    own = _storages([*layer.parameters(), *layer.buffers()])
    saved: dict[int, int] = {}
    hold: list[Tensor] = []  # keeps saved storages alive so their addresses stay unique

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        hold.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _Allocations() as made:
        out = run_forward(layer, index, name, x, inputs)
    # kept alive until backward without being saved for it (a leaf made in the forward, held
    # by the graph; a tensor the module stores): every tensor the forward made that is still
    # alive, but the output (the next layer's input) unless this layer saved it too
    outputs = _storages(out)
    for ptr, nbytes in made.alive().items():
        if ptr not in outputs:
            saved.setdefault(ptr, nbytes)
    # the inputs are copies of x: a copy of a storage the previous layer saved is that storage
    skip = own | {c.untyped_storage().data_ptr() for t, c in zip(x, inputs)
                  if t.untyped_storage().data_ptr() in kept}
    used = sum(n for ptr, n in saved.items() if ptr not in skip and ptr != 0)
    out_kept = {ptr for ptr in _storages(out) if ptr in saved}
    tracker.fresh.clear()
    return used, tuple(t.detach() for t in out), out_kept
