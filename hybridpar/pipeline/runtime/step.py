"""One step of one stage, as data: its spec, its micro-batches and its state, and the small
helpers the executor and its failure handling share.

    StageSpec    what never changes: the stage, its partition, routes, groups, options
    StepState    one `StageExecutor.run`: inputs, agreed specs, micro-batches, sends, progress
    MicroBatch   one micro-batch on this stage: its tensors, pending receives, RNG state
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torchgpipe.skip.namespace import Namespace

from hybridpar.comm import p2p as comm
from hybridpar.pipeline.activations.checkpoint import RNGReplay
from hybridpar.pipeline.activations.split_backward import WeightGrads
from hybridpar.pipeline.runtime.skip import SkipRoute
from hybridpar.sharded.attrs import get_parallel_dim, register_parallel_dim

__all__ = ["Handed", "MicroBatch", "Once", "Posted", "SpecKey", "StageSpec", "StepResult",
           "StepState", "as_tuple", "current_microbatch", "describe_spec", "floating",
           "grad_or_zeros", "microbatch_context", "nbytes", "scalar_loss"]

TensorOrTensors = Tensor | tuple[Tensor, ...]
SkipKey = tuple[Namespace, str]


class Handed:
    """A message from another virtual stage of this rank: its tensors, detached (a receiver
    of the wire gets copies the same way: leaves, requiring grad when floating in
    training, with their parallel-dim tags)."""

    def __init__(self, tensors: Sequence[Tensor | None], src: int, *, grads: bool,
                 single: bool = False) -> None:
        self.src, self.single = src, single   # src: the global rank (this one)
        self.tensors = tuple(None if t is None else _leaf(t, grads) for t in tensors)

    def finish(self, timeout: object = None) -> tuple[Tensor | None, ...]:
        """The tensors (nothing to wait for)."""
        return self.tensors


def _leaf(t: Tensor, grads: bool) -> Tensor:
    leaf = t.detach()
    tag = get_parallel_dim(t)
    if tag is not None:
        register_parallel_dim(leaf, tag)
    return leaf.requires_grad_(grads and t.is_floating_point())


Posted = comm.Incoming | Handed   # a receive of the step: over the wire, or handed over


class Once:
    """Calls `task` the first time it is called, then nothing (one task shared by the
    executors of a rank's virtual stages: whichever waits first runs it)."""

    def __init__(self, task: Callable[[], None]) -> None:
        self.task: Callable[[], None] | None = task

    def __call__(self) -> None:
        task, self.task = self.task, None
        if task is not None:
            task()


_local = threading.local()


def current_microbatch() -> Tensor | None:
    """A tensor that identifies the micro-batch being computed on this stage (None outside).

    The same object during the first forward and the recomputation of a micro-batch, so it
    can key a dict or a weak reference, as torchgpipe's `current_microbatch`.
    """
    return getattr(_local, "microbatch", None)


@contextmanager
def microbatch_context(key: Tensor) -> Iterator[None]:
    before = getattr(_local, "microbatch", None)
    _local.microbatch = key
    try:
        yield
    finally:
        _local.microbatch = before


@dataclass
class StageSpec:
    """What an executor needs to know about its stage."""

    stage: int
    num_stages: int
    partition: nn.Sequential
    routes: Sequence[SkipRoute]
    rank_of_stage: Callable[[int], int]
    tp_group: ProcessGroup | None
    timeout: datetime.timedelta
    checkpoint: str = "except_last"
    replay: RNGReplay = field(default_factory=RNGReplay)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    p2p_tags: bool = False
    watchdog: datetime.timedelta | None = None   # report a step stuck this long (NCCL)
    local_stages: frozenset[int] = frozenset()   # the other virtual stages of this rank
    listen: bool = True                          # gloo: a listener for peers' failures


@dataclass
class MicroBatch:
    key: Tensor
    inputs: TensorOrTensors | None = None
    outputs: TensorOrTensors | None = None
    loss: Tensor | None = None
    skips_in: dict[SkipKey, Tensor | None] = field(default_factory=dict)   # None: absent
    skips_out: dict[SkipKey, Tensor | None] = field(default_factory=dict)
    rng: Any = None
    input_grads: tuple[Tensor, ...] = ()
    skip_grads: dict[int, tuple[Tensor, ...]] = field(default_factory=dict)
    recv_f: Posted | None = None
    recv_b: Posted | None = None
    recv_skip: dict[int, Posted] = field(default_factory=dict)
    recv_skip_grad: dict[int, Posted] = field(default_factory=dict)
    weight_grads: WeightGrads | None = None   # split backward: what its W computes


def as_tuple(x: TensorOrTensors) -> tuple[Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def floating(tensors: Sequence[Tensor | None]) -> list[Tensor]:
    """The floating tensors of a message (what its gradient message carries; None: absent)."""
    return [t for t in tensors if t is not None and t.is_floating_point()]


@dataclass
class StepResult:
    """What a step leaves on this stage: the weighted loss sum (last stage) and outputs."""

    loss: Tensor | None
    outputs: list[TensorOrTensors]


SpecKey = tuple[int, int, int]   # (channel, peer stage, micro-batch) of a forward message


@dataclass
class StepState:
    """Everything one step of a stage holds: what it runs on, and where it is.

    A new one per `StageExecutor.run` (an idle one between steps); the watchdog thread reads
    `at` and `waiting` of the current one.
    """

    train: bool = False
    inputs: Sequence[TensorOrTensors] | None = None      # first stage: the micro-batches
    targets: Sequence[Any] | None = None                 # last stage
    loss_fn: Callable[..., Tensor] | None = None
    weights: Sequence[float] = ()                        # each micro-batch's share
    m: int = 0                                           # micro-batches
    signature: int = 0                                   # hash of (train, shapes)
    agreed: dict[SpecKey, comm.MessageSpec] | None = None   # None: this step learns them
    learned: dict[SpecKey, comm.MessageSpec] = field(default_factory=dict)
    mbs: list[MicroBatch] = field(default_factory=list)
    what: str = "step"                                   # "train_step", "eval_step", ...
    actions: list[Any] = field(default_factory=list)
    sends: list[tuple[list[Any], str, int]] = field(default_factory=list)  # works, what, peer
    incoming: list[comm.Incoming] = field(default_factory=list)   # receives being queued
    issued: list[tuple[bool, str, int, list[Any]]] = field(default_factory=list)
    issued_upto: int = 0                                 # actions before it are issued
    prefetched: set[int] = field(default_factory=set)    # receive actions posted ahead (gloo)
    loss_sum: Tensor | None = None
    outputs: list[TensorOrTensors] = field(default_factory=list)
    at: int = 0                                          # the action being run
    waiting: str = ""                                    # what the host waits for in it
    last_done: Any = None                                # the last completed action
    split: bool = False                                  # the schedule has W: split backward
    when_idle: Callable[[], None] | None = None          # run before the step's first wait


def describe_spec(spec: comm.MessageSpec | None) -> str:
    if spec is None:
        return "nothing"
    return ", ".join("None" if t.absent else f"{t.shape} {t.dtype}"
                     + ("" if t.tag is None else f" tag {t.tag}")
                     for t in spec.tensors) or "no tensors"


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def scalar_loss(loss: Any) -> Tensor:
    """`loss_fn`'s value as a 0-d tensor, or a `TypeError` that says what it must return."""
    if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
        got = (f"a {loss.dtype} tensor of shape {tuple(loss.shape)}"
               if isinstance(loss, Tensor) else type(loss).__name__)
        raise TypeError(f"loss_fn returned {got}; it must return the mean loss of the "
                        "micro-batch as a floating scalar tensor (e.g. F.cross_entropy(out, y) "
                        "with reduction='mean')")
    return loss.reshape(())


def grad_or_zeros(t: Tensor) -> Tensor:
    """The gradient of a received tensor, sharded like it (so it never travels scattered)."""
    grad = t.grad if t.grad is not None else torch.zeros_like(t)
    tag = get_parallel_dim(t)
    if tag is not None:
        register_parallel_dim(grad, tag)
    return grad
