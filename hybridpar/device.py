"""The GPU switch: the one test every CUDA-only branch reads, and the CUDA calls they make.

hybridpar does a few things differently on a GPU. Each such branch asks `is_cuda` (of a
device) or `has_cuda` (of the process) under its name, and makes its CUDA calls through
`cuda()`:

    branch            where                                     on a GPU
    watchdog          pipe/build.py              the watchdog is on by default
                      watchdog_timeout
    pinned batch      train/trainer.py (via `pinned`)           the batch is pinned: its
                                                                copies to the GPU overlap
                                                                compute
    nccl dtypes       pipeline/runtime/messages.py _send        a boundary of new shapes is
                                                                checked against NCCL's dtypes
    rng streams       tensor_parallel/random.py                 the RNG streams keep the CUDA
                                                                generator's state too
    dropout scale     tensor_parallel/random.py                 half inputs scaled in float32,
                      ParallelDropout                           as CUDA's fused kernel does
    recompute rng     pipeline/activations/checkpoint.py        a recomputation restores the
                                                                CUDA generator
    watch the device  pipe/steps.py _communicating              the watchdog stays armed
                                                                until the GPU did the step's
                                                                work
    trace clock       pipe/steps.py _recording,                 CUDA events time a trace
                      trace.DeviceClock

On a GPU the switch is ``device.type == "cuda"`` (`has_cuda`: torch.cuda's own answer) and
`cuda()` is torch.cuda. `hybridpar check` dry-runs on CPU-only builds of torch, where a
tensor of type ``cuda`` cannot go through autograd (`train.check.fake_gpu`), so its fake GPU
has a device type of its own; while it runs, `standing_in` makes the switch true for that
type too and puts a fake runtime behind `cuda()` (events that are done, pinning that keeps
the tensor, an RNG state kept in a tensor), which counts the branches taken (`reached`). So
every branch above runs in a dry run exactly as on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["BRANCHES", "Cuda", "cuda", "has_cuda", "is_cuda", "pinned", "standing_in"]

BRANCHES = ("watchdog", "pinned batch", "nccl dtypes", "rng streams", "dropout scale",
            "recompute rng", "watch the device", "trace clock")


class Cuda:
    """torch.cuda, as far as hybridpar's CUDA branches call it (a dry run's fake overrides
    every method)."""

    def reached(self, branch: str) -> None:
        """A CUDA branch was taken (a dry run's runtime counts them)."""

    def available(self) -> bool:
        return torch.cuda.is_available()

    def initialized(self) -> bool:
        return torch.cuda.is_initialized()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def get_rng_state(self, device: int | str = "cuda") -> Tensor:
        """The generator state of `device` (an index; "cuda": the current one), a CPU
        ByteTensor."""
        return torch.cuda.get_rng_state(device)

    def set_rng_state(self, state: Tensor, device: int | str = "cuda") -> None:
        torch.cuda.set_rng_state(state, device)

    def manual_seed(self, seed: int) -> None:
        """Seed the current device's generator."""
        torch.cuda.manual_seed(seed)

    def get_rng_state_all(self) -> list[Tensor]:
        return torch.cuda.get_rng_state_all()

    def set_rng_state_all(self, states: Sequence[Tensor]) -> None:
        torch.cuda.set_rng_state_all(states)

    def pin(self, t: Tensor) -> Tensor:
        """`t` (on the CPU) in page-locked memory."""
        return t.pin_memory()

    def event(self, *, timing: bool = False) -> Any:
        """A CUDA event (`record`, `query`, `synchronize`, `elapsed_time`)."""
        return torch.cuda.Event(enable_timing=timing)


_runtime = Cuda()
_standin: str | None = None   # the device type standing in for CUDA (a dry run's), or None


def cuda() -> Cuda:
    """The CUDA runtime: torch.cuda, or a dry run's fake while `standing_in`."""
    return _runtime


def is_cuda(where: torch.device | Tensor, *, branch: str) -> bool:
    """Whether `where` (a device, or a tensor's) is a CUDA device, or a dry run's stand-in
    for one: the switch of the CUDA-only branch `branch` (one of `BRANCHES`)."""
    kind = where.device.type if isinstance(where, Tensor) else where.type
    if kind != "cuda" and (_standin is None or kind != _standin):
        return False
    _runtime.reached(branch)
    return True


def has_cuda(*, branch: str, started: bool = False) -> bool:
    """Whether this process has CUDA (`started`: and has initialized it), or is a dry run:
    the switch of branch `branch`, which keeps the CUDA generator's state with the CPU's."""
    yes = _runtime.initialized() if started else _runtime.available()
    if yes:
        _runtime.reached(branch)
    return yes


def pinned(device: torch.device, *tensors: Any) -> tuple[Any, ...]:
    """`tensors` (a CPU batch; a tuple of tensors is one, pinned tensor by tensor) pinned when
    bound for a CUDA `device`, so that their copies to it overlap compute (`non_blocking`);
    as they are otherwise."""
    if not is_cuda(device, branch="pinned batch"):
        return tensors
    return tuple(tuple(_runtime.pin(u) for u in t) if isinstance(t, tuple) else _runtime.pin(t)
                 for t in tensors)


@contextlib.contextmanager
def standing_in(device_type: str, runtime: Cuda) -> Iterator[Cuda]:
    """Meanwhile `device_type` counts as CUDA and `runtime` is `cuda()` (a dry run's)."""
    global _runtime, _standin
    saved = _runtime, _standin
    _runtime, _standin = runtime, device_type
    try:
        yield runtime
    finally:
        _runtime, _standin = saved
