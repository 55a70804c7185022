"""Selective recomputation: the part of a layer a model marks is recomputed in backward.

With ``checkpoint = "selective"`` the pipe runs each training forward inside `selective`, and
a model wraps what is cheap to recompute but costly to keep in `recompute_core`: the
attention core, softmax(QKᵀ)V with its dropout, whose (B, heads, T, T) probabilities are the
largest activation of a transformer block (Megatron's selective recomputation). Outside that
context (evaluation, the other modes, one device) `recompute_core(fn, ...)` is ``fn(...)``.

A leaf: models import it without the pipeline; the pipeline hands in the contexts of the
first forward and of the recomputation (`pipeline.activations.layer_checkpoint`: RNG replay, so the
attention dropout masks are the first forward's, and `is_recomputing()` true).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["recompute_core", "selective"]

Contexts = Callable[[], tuple[Any, Any]]   # -> (first forward's context, recomputation's)

_STATE = threading.local()


@contextmanager
def selective(contexts: Contexts) -> Iterator[None]:
    """Within: `recompute_core` checkpoints, each call under the contexts `contexts()` makes
    at that call (the RNG state of that moment is the one the recomputation replays)."""
    before = getattr(_STATE, "contexts", None)
    _STATE.contexts = contexts
    try:
        yield
    finally:
        _STATE.contexts = before


def recompute_core(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, recomputed in backward instead of kept when `selective` is
    on and autograd records (its tensor arguments are what is kept)."""
    contexts = getattr(_STATE, "contexts", None)
    if contexts is None or not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False,
                      context_fn=functools.partial(_given, contexts()), **kwargs)


def _given(made: tuple[Any, Any]) -> tuple[Any, Any]:
    """`checkpoint`'s `context_fn`: the contexts made at the call."""
    return made
