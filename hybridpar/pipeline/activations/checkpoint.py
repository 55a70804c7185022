"""Per-micro-batch checkpointing: which micro-batches drop activations, and exact replay.

    mode            micro-batches checkpointed (m micro-batches)
    "always"        all m
    "except_last"   the first m - 1 (the last one goes straight into backward)
    "never"         none
    "layers"        none whole: every layer of every micro-batch on its own
    "layers:K"      none whole: every K-th layer of every micro-batch on its own
    "selective"     none whole: the attention core of every layer (`hybridpar.recompute`)

(the modes inside a stage: `pipeline.activations.layer_checkpoint`.)

A checkpointed forward runs under `torch.no_grad()` inside torchgpipe's
`enable_checkpointing()`; its backward first recomputes the forward inside
`enable_recomputing()` from the RNG state saved at the first forward, so dropout masks
replay exactly and `is_recomputing()` tells modules to skip side effects.

Under autocast both run with autocast's weight-cast cache off: a cast cached by the first
forward, made under `no_grad`, has no grad history, and a recomputation that reused it
would give its weight no gradient (on CUDA, where autocast caches casts).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torchgpipe.checkpoint import enable_checkpointing, enable_recomputing

__all__ = ["CHECKPOINT_MODES", "RNGReplay", "check_checkpoint", "checkpoint_stop",
           "is_checkpointed", "layer_stride", "no_cast_cache"]

CHECKPOINT_MODES = ("always", "except_last", "never", "layers", "selective")   # + "layers:K"


def check_checkpoint(mode: object) -> str:
    """``str(mode)`` if it is a checkpoint mode (as torchgpipe, any object whose `str` is one),
    else a `ValueError` listing the modes."""
    text = str(mode)
    if text not in CHECKPOINT_MODES and _stride(text) is None:
        raise ValueError(f"checkpoint must be one of {', '.join(map(repr, CHECKPOINT_MODES))} "
                         f"or 'layers:K' (every K-th layer, K >= 1), got {mode!r}")
    return text


def _stride(text: str) -> int | None:
    """K of "layers:K" (a positive integer), else None."""
    head, _, k = text.partition(":")
    return int(k) if head == "layers" and k.isdigit() and int(k) >= 1 else None


def layer_stride(mode: str) -> int | None:
    """Every how many layers a layer mode checkpoints ("layers": 1); None for the
    micro-batch modes."""
    return 1 if mode == "layers" else _stride(mode)


def checkpoint_stop(mode: str, microbatches: int) -> int:
    """How many leading micro-batches are checkpointed whole under `mode`."""
    check_checkpoint(mode)
    if layer_stride(mode) is not None or mode == "selective":
        return 0
    return {"always": microbatches, "except_last": microbatches - 1, "never": 0}[mode]


def is_checkpointed(mode: str, microbatch: int, microbatches: int) -> bool:
    """Whether `microbatch` of `microbatches` is checkpointed under `mode`."""
    return microbatch < checkpoint_stop(mode, microbatches)


class RNGReplay:
    """Captures the RNG state at a first forward; replays it for the recomputation.

    `get_state` / `set_state` default to the CPU generator and the CUDA generator of `device`
    (the rank's; None: the current CUDA device's once CUDA is initialized), one GPU's and not
    every visible one's: they run for every checkpointed micro-batch. The pipe passes the
    tensor-parallel ones, which also cover the RNG tracker's named streams. `device_type`
    (autocast's) defaults to `device`'s type, else "cpu".
    """

    def __init__(self, get_state: Callable[[], Any] | None = None,
                 set_state: Callable[[Any], None] | None = None, *,
                 device_type: str | None = None, device: torch.device | None = None) -> None:
        self.get_state = get_state or functools.partial(_default_get, device)
        self.set_state = set_state or _default_set
        self.device_type = device_type or (device.type if device is not None else "cpu")

    @contextmanager
    def first_forward(self) -> Iterator[Any]:
        """Run a checkpointed forward; yields the state to replay later."""
        state = self.get_state()
        with torch.no_grad(), enable_checkpointing(), no_cast_cache(self.device_type):
            yield state

    @contextmanager
    def recompute(self, state: Any) -> Iterator[None]:
        """Run the recomputation from `state`, then put the RNG back as it was."""
        now = self.get_state()
        self.set_state(state)
        try:
            with torch.enable_grad(), enable_recomputing(), no_cast_cache(self.device_type):
                yield
        finally:
            self.set_state(now)


def no_cast_cache(device_type: str) -> contextlib.AbstractContextManager[Any]:
    """Autocast as it is, with its cast cache off (nothing when autocast is off)."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type),
                          cache_enabled=False)


def _default_get(device: torch.device | None) -> Any:
    cuda = None
    if device is None and torch.cuda.is_initialized():
        cuda = torch.cuda.current_device()
    elif device is not None and device.type == "cuda":
        cuda = device.index if device.index is not None else torch.cuda.current_device()
    return torch.get_rng_state(), None if cuda is None else (cuda, torch.cuda.get_rng_state(cuda))


def _default_set(state: Any) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        index, generator = cuda
        torch.cuda.set_rng_state(generator, index)
