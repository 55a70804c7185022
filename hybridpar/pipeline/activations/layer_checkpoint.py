"""Checkpointing inside a stage: layer by layer (``checkpoint = "layers"`` / ``"layers:K"``)
and the attention core (``"selective"``, through `hybridpar.recompute`).

The micro-batch modes (`pipeline.activations.checkpoint`) drop a whole stage's activations and
recompute the whole stage in backward, so the backward of a checkpointed micro-batch holds every
activation of the stage again. The layer modes checkpoint each layer (every K-th, the others
keep theirs) of every micro-batch with torch's non-reentrant checkpoint:

    mode          kept per micro-batch until its backward         held again in backward
    "always"      the stage's input                               the whole stage's
    "layers"      each layer's input                              one layer's at a time
    "layers:K"    the input of every K-th layer, the activations  one layer's, plus the
                  of the others                                   others' kept ones

The recomputation replays the RNG state of the layer's first forward (the pipe's
`RNGReplay`: CPU, the device's and the tp tracker's streams, so dropout masks are the first
forward's), with `is_recomputing()` true, autocast's cast cache off, and under a split
backward's `SplitLinear` when the first forward ran under it (the same operations save the
same tensors). A `@skippable` layer is never checkpointed here: its stash and pop happen in
the stage's forward, not in a recomputation.

    "selective"   each layer's activations but its attention core's   the core of one layer
                  (q, k, v kept; not the (B, h, T, T) probabilities)  at a time
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from types import TracebackType
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint
from torchgpipe.checkpoint import enable_checkpointing, enable_recomputing
from torchgpipe.skip.skippable import Skippable

from hybridpar.pipeline.activations.checkpoint import RNGReplay, no_cast_cache

__all__ = ["contexts", "run_layers"]


def run_layers(layers: nn.Sequential, x: Any, *, every: int, replay: RNGReplay,
               split_mode: Callable[[], AbstractContextManager[Any]] | None = None) -> Any:
    """`layers(x)`, each `every`-th layer (the first, then every `every` after it)
    checkpointed on its own; `split_mode` makes the context the first forward ran in (a
    split backward's `SplitLinear`) for the recomputation too."""
    for k, layer in enumerate(layers):
        if k % every or isinstance(layer, Skippable):
            x = layer(x)
            continue
        x = checkpoint(layer, x, use_reentrant=False, preserve_rng_state=False,
                       context_fn=functools.partial(_given, contexts(replay, split_mode)))
    return x


def contexts(replay: RNGReplay, split_mode: Callable[[], AbstractContextManager[Any]] | None
             ) -> tuple[Any, Any]:
    """The contexts of a checkpointed region starting now: its first forward's, and its
    recomputation's (this moment's RNG state replayed)."""
    return _FirstForward(replay), _Recompute(replay, replay.get_state(), split_mode)


def _given(made: tuple[Any, Any]) -> tuple[Any, Any]:
    """`checkpoint`'s `context_fn`: the (first forward, recomputation) contexts made."""
    return made


class _FirstForward:
    """The checkpointed forward's context: `is_checkpointing()` true, no autocast cache."""

    def __init__(self, replay: RNGReplay) -> None:
        self.replay = replay
        self.stack = ExitStack()

    def __enter__(self) -> None:
        self.stack.enter_context(enable_checkpointing())
        self.stack.enter_context(no_cast_cache(self.replay.device_type))

    def __exit__(self, *exc: object) -> None:
        self.stack.close()


class _Recompute:
    """The recomputation's context: the first forward's RNG state (restored after),
    `is_recomputing()` true, no autocast cache, the split mode when there was one."""

    def __init__(self, replay: RNGReplay, state: Any,
                 split_mode: Callable[[], AbstractContextManager[Any]] | None) -> None:
        self.replay, self.state, self.split_mode = replay, state, split_mode
        self.stack = ExitStack()

    def __enter__(self) -> None:
        now = self.replay.get_state()
        self.replay.set_state(self.state)
        self.stack.callback(self.replay.set_state, now)
        self.stack.enter_context(enable_recomputing())
        self.stack.enter_context(no_cast_cache(self.replay.device_type))
        self.stack.enter_context(self.split_mode() if self.split_mode else nullcontext())

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stack.close()
