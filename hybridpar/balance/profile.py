"""Per-layer profiling of an nn.Sequential: time (forward + backward) and memory, no trace left.

Layers are profiled one at a time, in order; the sample flows through them, each layer's
input being the previous layer's output, detached (floating tensors require grad, as a
stage's input does) and cloned (so an in-place first op such as ``ReLU(inplace=True)`` is
allowed and the sample itself is never modified):

    for each layer i            time pass (the whole sample)     size pass (one micro-batch)
      materialize if meta       a warm-up, then forward +        forward under saved-tensor
      (one layer at a time)     backward for timeout / n s       hooks (CPU) or CUDA
                                (>= 2 runs); the lower median    memory_allocated delta
      restore                   grads, modes, buffers and scalar attributes of the layer

The torch RNG state (CPU and CUDA) is restored at the end. The parts, in `hybridpar.balance`:

    module          owns
    layer_run       one run of a layer: fresh inputs, forward, backward, `@skippable` stashes
    profile_time    the time pass
    profile_size    the size pass, and what counts as an activation byte
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torchgpipe.skip.tracker import use_skip_tracker
from tqdm import tqdm

from hybridpar.balance.layer_run import ProfileSkipTracker, check_sample, describe
from hybridpar.balance.profile_size import size_layer
from hybridpar.balance.profile_time import time_layer
from hybridpar.balance.tp import shard_estimate
from hybridpar.pipeline.parameters.partition import materialize

__all__ = ["DEFAULT_BANDWIDTH", "LayerProfile", "TensorOrTensors", "boundary_ms", "check_module",
           "check_sample", "layer_names", "link_bandwidth", "profile_layers"]

TensorOrTensors = Tensor | tuple[Tensor, ...]

# Assumed link speeds in bytes/s when none is given: gloo between local CPU processes, and
# NCCL between GPUs of one node (PCIe / NVLink vary; pass p2p_bandwidth to be precise).
DEFAULT_BANDWIDTH = {"cpu": 1e9, "cuda": 2.5e10}


@dataclass
class LayerProfile:
    """What one layer costs (its tp shard's cost when tp > 1)."""

    index: int
    name: str  # the layer's key in the nn.Sequential
    kind: str  # its class name
    params: int  # parameter count
    param_bytes: int
    buffer_bytes: int
    time_ms: float = 0.0  # forward + backward, plus comm_ms
    activation_bytes: int = 0  # kept alive until backward, one micro-batch
    output_bytes: int = 0  # the layer's output on the whole sample (sent to the next stage)
    comm_ms: float = 0.0  # estimated tp collectives (already in time_ms)

    def memory(self, param_scale: float = 2.0) -> float:
        """Bytes a stage holds for this layer: params * param_scale + buffers + activations."""
        return self.param_bytes * param_scale + self.buffer_bytes + self.activation_bytes


def boundary_ms(profiles: list[LayerProfile], bandwidth: float) -> list[float]:
    """Cost of a stage boundary after each layer: its output forward, its gradient back.

    ``boundary[i] = 2 * output_bytes[i] / bandwidth`` in ms; the solver adds it to a stage
    that ends at layer i (never to the last stage).
    """
    if not bandwidth > 0:
        raise ValueError(f"p2p_bandwidth must be positive bytes/s, got {bandwidth!r}")
    return [2 * p.output_bytes / bandwidth * 1000 for p in profiles]


def layer_names(module: nn.Sequential) -> list[str]:
    """The keys of the layers of `module`, in order."""
    return list(module._modules.keys())


# -- leaving no trace -------------------------------------------------------------------------

_Scalar = (int, float, bool, str, type(None))


@contextmanager
def _sandbox(layer: nn.Module, device: torch.device,
             init_fn: Callable[[nn.Module], None] | None = None) -> Iterator[nn.Module]:
    """`layer` ready to profile on `device`, in train mode; afterwards as it was before."""
    tensors = [*layer.parameters(), *layer.buffers()]
    if any(t.is_meta for t in tensors):  # built on meta: a materialized copy, then dropped
        real = copy.deepcopy(layer)
        materialize(real, device, init_fn=init_fn)
        yield real.train()
        return
    if any(t.device != device for t in tensors):  # elsewhere: a copy on `device`
        yield copy.deepcopy(layer).to(device).train()
        return
    mods = list(layer.modules())
    grads = [(p, p.grad) for p in layer.parameters()]
    modes = [(m, m.training) for m in mods]
    buffers = [(m, k, b, b.detach().clone()) for m in mods for k, b in m._buffers.items()
               if b is not None]
    scalars = [(m, {k: v for k, v in vars(m).items() if isinstance(v, _Scalar)}) for m in mods]
    for p, _ in grads:
        p.grad = None
    try:
        yield layer.train()
    finally:
        for p, g in grads:
            p.grad = g
        with torch.no_grad():
            for m, k, b, saved in buffers:
                m._buffers[k] = b
                b.copy_(saved)
        for m, attrs in scalars:
            m.__dict__.update(attrs)
        for m, mode in modes:
            m.training = mode


@contextmanager
def _rng_kept() -> Iterator[None]:
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


# -- the profiler -----------------------------------------------------------------------------


def _device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "meta":
        raise ValueError("cannot profile on the meta device; give device='cpu' or 'cuda' (a "
                         "meta-built model is materialized there one layer at a time)")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def link_bandwidth(value: float | None, device: torch.device, what: str) -> float:
    """`value`, checked, or the assumed link speed of `device` (DEFAULT_BANDWIDTH)."""
    if value is None:
        return DEFAULT_BANDWIDTH.get(device.type, DEFAULT_BANDWIDTH["cpu"])
    if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{what} must be positive bytes/s (math.inf to ignore), got {value!r}")
    return float(value)


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def check_module(module: object) -> nn.Sequential:
    """`module` if it is a non-empty nn.Sequential, else a TypeError / ValueError."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"balancing needs an nn.Sequential, got {type(module).__name__}; "
                        "express the model as nn.Sequential(layer, layer, ...)")
    if len(module) == 0:
        raise ValueError("the model is an empty nn.Sequential; give it at least one layer")
    return module


def profile_layers(module: nn.Sequential, sample: TensorOrTensors, *, timeout: float = 1.0,
                   chunks: int = 1, device: torch.device | str = "cpu", tp: int = 1,
                   tp_bandwidth: float | None = None, measure_time: bool = True,
                   measure_size: bool = True, progress: bool = False,
                   init_fn: Callable[[nn.Module], None] | None = None) -> list[LayerProfile]:
    """Profile every layer of `module` on `sample` (see the module docstring).

    Layers built on `meta` are profiled on a materialized copy (`init_fn`: as `HybridPipe`'s).

    Time: forward + backward on the whole `sample`, about ``timeout / len(module)`` seconds
    per layer. Size: activations kept for backward by the first micro-batch of
    ``ceil(batch / chunks)`` rows. With tp > 1, layers profiled whole are scaled to their
    shard (`hybridpar.balance.tp`); `tp_bandwidth` (bytes/s) prices their all-reduces.
    """
    check_module(module)
    xs = check_sample(sample)
    for value, what in ((chunks, "chunks"), (tp, "tp")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive int, got {value!r}")
    if not (isinstance(timeout, (int, float)) and timeout >= 0):
        raise ValueError(f"timeout must be a non-negative number of seconds, got {timeout!r}")
    dev = _device(device)
    bandwidth = link_bandwidth(tp_bandwidth, dev, "tp_bandwidth")
    x = tuple(t.detach().to(dev) for t in xs)
    xm = x
    if measure_size:
        if any(t.dim() == 0 for t in x):
            raise ValueError(f"the sample {describe(x)} has no batch dimension to split into "
                             f"{chunks} micro-batches; give a batch of shape (batch, ...)")
        rows = math.ceil(x[0].size(0) / chunks)
        xm = tuple(t[:rows] for t in x)
    grad = any(t.requires_grad for t in xs)  # later layers: every floating input
    names = layer_names(module)
    budget = timeout / len(module)
    trackers = (ProfileSkipTracker(), ProfileSkipTracker())
    kept: set[int] = set()
    profiles: list[LayerProfile] = []
    bar = tqdm(total=len(module), desc="profiling layers", unit="layer", disable=not progress)
    with torch.enable_grad(), _rng_kept(), bar:
        for index, (name, layer) in enumerate(zip(names, module.children())):
            est = shard_estimate(layer, tp)
            prof = LayerProfile(index, name, type(layer).__name__, est.params, est.param_bytes,
                                _nbytes(layer.buffers()))
            with _sandbox(layer, dev, init_fn) as live:
                if measure_time:
                    with use_skip_tracker(trackers[0]):
                        sec, x = time_layer(live, index, name, x, grad, trackers[0], budget,
                                            dev)
                    prof.output_bytes = _nbytes(x)
                    prof.comm_ms = est.comm_ms(prof.output_bytes, tp, bandwidth)
                    prof.time_ms = sec * 1000 * est.compute_scale + prof.comm_ms
                if measure_size:
                    with use_skip_tracker(trackers[1]):
                        used, xm, kept = size_layer(live, index, name, xm, grad, trackers[1],
                                                    dev, kept)
                    prof.activation_bytes = round(used * est.compute_scale)
            profiles.append(prof)
            grad = True
            bar.update()
    return profiles
