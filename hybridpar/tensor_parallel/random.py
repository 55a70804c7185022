"""Dropout RNG for tensor parallelism: shared masks when replicated, named streams for shards.

Two streams, as in Megatron, on CPU and (when available) CUDA:

    stream                    seed                     same on tp ranks   used for
    default generator         seed                     yes                replicated activations;
                                                                          sharded ones, parity=True
    tracker 'model-parallel'  seed + 2718 + tp_rank    no                 sharded ones, parity=False

A sharded activation with ``parity=True`` draws the mask of the FULL tensor from the default
stream and keeps its slice, so every mask equals the one-device model's mask under the same
seed (and the default stream stays in step with it). ``parity=False`` draws only the local
mask from the tracker stream: less work, masks independent across ranks, no one-device parity.
`get_rng_state_all` / `set_rng_state_all` capture and restore both, for recomputation: the
CPU generator and the CUDA generator of the rank's own device only (every checkpointed
micro-batch captures one; reading every visible GPU's would be a call into each device for
states nothing replays).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed import ProcessGroup

from hybridpar.device import cuda, has_cuda, is_cuda
from hybridpar.sharded.attrs import (
    ORDER_TYPE_ATTR,
    SEQUENCE,
    get_order_type,
    get_parallel_dim,
    register_parallel_attribute,
    register_parallel_dim,
)
from hybridpar.sharded.mappings import group_rank, group_size
from hybridpar.topology import default_tp_group

__all__ = [
    "MODEL_PARALLEL_RNG",
    "ParallelDropout",
    "RNGStatesTracker",
    "as_parallel_dropout",
    "get_rng_state_all",
    "get_rng_tracker",
    "model_parallel_manual_seed",
    "set_rng_state_all",
]

MODEL_PARALLEL_RNG = "model-parallel"
_MODEL_PARALLEL_SEED_OFFSET = 2718

# One stream's state: {"cpu": ByteTensor} plus {"cuda": ByteTensor} when CUDA is available
# (the current device's generator). Plain dicts of tensors, so `torch.load(weights_only=True)`
# reads them back from a checkpoint.
RNGState = dict[str, Tensor]


def _cuda(branch: str = "rng streams") -> bool:
    return has_cuda(branch=branch)   # torch.cuda.is_available(), or a dry run's fake GPU


def _capture() -> RNGState:
    state = {"cpu": torch.get_rng_state()}
    if _cuda():
        state["cuda"] = cuda().get_rng_state()
    return state


def _restore(state: RNGState) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and _cuda():
        cuda().set_rng_state(state["cuda"])


class RNGStatesTracker:
    """Named RNG streams; `fork(name)` runs a block with the default generator on that stream.

    ``with tracker.fork(name):`` swaps the default generator's state (CPU, and CUDA's current
    device when available) for the named one, and on exit saves the advanced named state and
    puts the default state back, so draws inside the block leave the default stream untouched.
    """

    def __init__(self) -> None:
        self._states: dict[str, RNGState] = {}

    def reset(self) -> None:
        """Forget every stream."""
        self._states = {}

    def __contains__(self, name: object) -> bool:
        return name in self._states

    def names(self) -> list[str]:
        """The names of the streams, in the order they were added."""
        return list(self._states)

    def add(self, name: str, seed: int) -> None:
        """Add stream `name` seeded with `seed` (as ``torch.manual_seed(seed)`` would)."""
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists; call reset() first")
        state = {"cpu": torch.Generator().manual_seed(seed).get_state()}
        if _cuda():
            saved = cuda().get_rng_state()
            cuda().manual_seed(seed)
            state["cuda"] = cuda().get_rng_state()
            cuda().set_rng_state(saved)
        self._states[name] = state

    def get_states(self) -> dict[str, RNGState]:
        """A copy of every stream's state (for checkpoints and recomputation)."""
        return {name: {k: v.clone() for k, v in s.items()} for name, s in self._states.items()}

    def set_states(self, states: dict[str, RNGState]) -> None:
        """Replace every stream's state with `states` (as returned by `get_states`)."""
        self._states = {name: {k: v.clone() for k, v in s.items()} for name, s in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with the default generator on stream `name`, then switch back."""
        if name not in self._states:
            raise KeyError(
                f"RNG stream {name!r} is not in the tracker (it has {self.names()}); call "
                "hybridpar's model_parallel_manual_seed(seed) after hybridpar.init, or add it"
            )
        saved = _capture()
        _restore(self._states[name])
        try:
            yield
        finally:
            self._states[name] = _capture()
            _restore(saved)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker used by `ParallelDropout(parity=False)`."""
    return _TRACKER


def model_parallel_manual_seed(seed: int, *, group: ProcessGroup | None = None) -> None:
    """Seed the default generator with `seed` and the tracker's 'model-parallel' stream.

    Call it with the same `seed` on every tp rank: the default stream is then identical across
    the group (replicated regions and parity masks agree), while the 'model-parallel' stream
    is seeded with ``seed + 2718 + tp_rank`` (distinct per rank). `group` defaults to the tp
    group of `hybridpar.init`. The tracker is reset first.
    """
    if group is None:
        group = default_tp_group()
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_SEED_OFFSET + group_rank(group))


def _cuda_index(device: torch.device | str | None) -> int | None:
    """The CUDA generator that belongs to `device`: its index for a CUDA device, the current
    device's for None when CUDA is available (`hybridpar.init` sets the rank's), else None."""
    if device is None:
        return cuda().current_device() if _cuda("recompute rng") else None
    device = torch.device(device)
    if not is_cuda(device, branch="recompute rng"):
        return None
    return device.index if device.index is not None else cuda().current_device()


def get_rng_state_all(device: torch.device | str | None = None) -> dict[str, Any]:
    """The default CPU RNG, the CUDA RNG of `device` and the tracker streams.

    `device` is the rank's device (`topology.device`): a CPU device adds no CUDA state, None
    the current CUDA device's when CUDA is available. The CUDA state is keyed by its device
    index, ``{"cpu": ..., "cuda": {"1": ...}, "tracker": ...}``, so `set_rng_state_all` puts
    it back on that device; no other GPU is read.
    """
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "tracker": _TRACKER.get_states()}
    index = _cuda_index(device)
    if index is not None:
        state["cuda"] = {str(index): cuda().get_rng_state(index)}
    return state


def set_rng_state_all(state: dict[str, Any]) -> None:
    """Restore what `get_rng_state_all` captured, so the same dropout masks are drawn again."""
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and _cuda("recompute rng"):
        for index, generator in state["cuda"].items():
            cuda().set_rng_state(generator, int(index))
    _TRACKER.set_states(state["tracker"])


def _sharded_layout(width: int, group: ProcessGroup, device: torch.device) -> tuple[int, int]:
    """(full width, start of this rank's slice): each rank's width, summed in one all-reduce."""
    widths = torch.zeros(group_size(group), dtype=torch.int64, device=device)
    widths[group_rank(group)] = width
    dist.all_reduce(widths, group=group)
    if is_fake(widths):   # a dry run (`hybridpar check`): no values exist; shards taken equal
        return width * group_size(group), width * group_rank(group)
    sizes = widths.tolist()
    return sum(sizes), sum(sizes[: group_rank(group)])


def _retag(out: Tensor, like: Tensor) -> Tensor:
    if out is not like:
        if hasattr(like, ORDER_TYPE_ATTR):
            register_parallel_attribute(out, get_parallel_dim(like), get_order_type(like))
        else:
            register_parallel_dim(out, get_parallel_dim(like))
    return out


class ParallelDropout(nn.Dropout):
    """`nn.Dropout` that draws the same masks as the one-device model under tensor parallelism.

    Untagged (replicated) input: plain dropout on the default stream, so every tp rank draws
    the same mask (given `model_parallel_manual_seed`). Input tagged sharded on its last dim
    (parallel dim -1 or 1), shape ``(*, C / tp)``, or on its sequence (-2, sequence
    parallelism), shape ``(*, T / tp, C)``:

        parity  mask                                             communication
        True    full (*, C) / (*, T, C) mask from the default     all-reduce of the widths
                stream, this rank's [start, stop) slice of the    (C or T and start; uneven
                sharded dim kept                                  ok)
        False   local mask in get_rng_tracker().fork()            none
                (Megatron; distinct per rank)

    The output keeps the input's tag. In eval mode (or p=0) the input is returned as is.
    Parity assumes the one-device activation is contiguous (on CUDA, the fused kernel assigns
    random numbers by memory layout) and the default stream in step on every tp rank.
    `group` defaults to the tp group of `hybridpar.init` (read only for sharded input).
    """

    def __init__(self, p: float = 0.5, inplace: bool = False, *, parity: bool = True,
                 group: ProcessGroup | None = None) -> None:
        super().__init__(p, inplace)
        self.parity = parity
        self.group = group
        # (sharded dim, local width, group) -> (full width, start): read on the host once per
        # layer, not in every forward (where it would synchronise a GPU per micro-batch)
        self._layouts: dict[tuple[int, int, str], tuple[int, int]] = {}

    def extra_repr(self) -> str:
        return f"p={self.p}, inplace={self.inplace}, parity={self.parity}"

    def forward(self, input: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return input
        tag = get_parallel_dim(input)
        if tag not in (-1, 1, SEQUENCE):
            return F.dropout(input, self.p, True, self.inplace)
        if not self.parity:
            with _TRACKER.fork():
                return _retag(F.dropout(input, self.p, True, self.inplace), input)
        group = self.group if self.group is not None else default_tp_group()
        if group_size(group) == 1:
            return _retag(F.dropout(input, self.p, True, self.inplace), input)
        dim = -2 if tag == SEQUENCE else -1           # the sharded dim of the activation
        width = input.shape[dim]
        key = (dim, width, str(group.group_name))
        if key not in self._layouts:
            self._layouts[key] = _sharded_layout(width, group, input.device)
        full, start = self._layouts[key]
        # F.dropout of ones is exactly its scaled mask (0 or 1 / (1 - p)), drawn by the same
        # kernel and the same amount of randomness as F.dropout of the full activation.
        shape = list(input.shape)
        shape[dim] = full
        mask = F.dropout(input.new_ones(shape), self.p, True)       # (*, C) or (*, T, C)
        mask = mask.narrow(dim, start, width)                       # this rank's slice
        if input.dtype in (torch.float16, torch.bfloat16) and self.p < 1 and \
                is_cuda(input, branch="dropout scale"):
            # CUDA's fused kernel scales half inputs in float32, rounding once:
            # half(x * keep * (1 / (1 - p))); a half mask would round the scale first.
            scale = float(torch.tensor(1.0 - self.p, dtype=torch.float32).reciprocal())
            scaled = (input.float() * mask.ne(0) * scale).to(input.dtype)
            out = input.copy_(scaled) if self.inplace else scaled
        else:
            out = input.mul_(mask) if self.inplace else input * mask
        return _retag(out, input)


def as_parallel_dropout(m: nn.Dropout, group: ProcessGroup | None) -> ParallelDropout:
    """`m` as a `ParallelDropout(parity=True)` of `group`: same p, inplace and mode."""
    new = ParallelDropout(m.p, m.inplace, parity=True, group=group)
    new.train(m.training)
    return new
