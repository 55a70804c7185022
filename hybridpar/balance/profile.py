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

`@skippable` layers run inside a skip tracker that keeps stashed tensors (detached) for
the layers that pop them, and pops without removing them, so repeated runs work. Each run's
backward covers the layer's outputs and the tensors it stashed. The torch RNG state (CPU and
CUDA) is restored at the end.

Activation bytes (CPU): the unique storages the layer's forward keeps alive until backward,
excluding its parameters and buffers: those saved for backward (saved-tensor hooks) and
every tensor the forward made that is still referenced after it (a leaf of the graph, a
tensor the module stores; a dispatch mode tracks them), its output only if it saved it. An
input the previous layer already saved (its output, kept by both) counts once, toward the
earlier layer. On a GPU: the growth of `torch.cuda.memory_allocated`.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torchgpipe.microbatch import Batch
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.tracker import SkipTracker, use_skip_tracker
from tqdm import tqdm

from hybridpar.balance.tp import collective_group, shard_estimate
from hybridpar.pipeline.partition import materialize

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


def check_sample(sample: object, what: str = "sample") -> tuple[Tensor, ...]:
    """`sample` as a tuple of tensors, or a TypeError saying what is expected."""
    if isinstance(sample, Tensor):
        return (sample,)
    if isinstance(sample, tuple) and sample and all(isinstance(t, Tensor) for t in sample):
        return sample
    raise TypeError(f"{what} must be a Tensor or a tuple of Tensors, got "
                    f"{type(sample).__name__}; pass an example mini-batch such as "
                    "torch.randn(batch, features)")


def _describe(xs: tuple[Tensor, ...]) -> str:
    shapes = [f"{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}" for x in xs]
    return shapes[0] if len(shapes) == 1 else "(" + ", ".join(shapes) + ")"


def _feed(x: Tensor, grad: bool) -> Tensor:
    """A fresh non-leaf copy of `x`: detached, requiring grad when floating and `grad`."""
    leaf = x.detach()
    if grad and leaf.is_floating_point():
        return leaf.requires_grad_(True).clone()
    return leaf.clone()


class _ProfileSkipTracker(SkipTracker):
    """Keeps stashed tensors (detached) for later layers; records them for the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.fresh: list[Tensor] = []

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Tensor | None) -> None:
        if tensor is not None and tensor.requires_grad:
            self.fresh.append(tensor)
        self.tensors[(ns, name)] = None if tensor is None else tensor.detach()

    def load(self, batch: Batch, ns: Namespace, name: str) -> Tensor | None:
        tensor = self.tensors[(ns, name)]  # not popped: the layer may run again
        return None if tensor is None else _feed(tensor, True)


def _forward(layer: nn.Module, index: int, name: str, x: tuple[Tensor, ...],
             inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """`layer` on `inputs` (fresh copies of `x`); errors name the layer and the shape."""
    try:
        out = layer(inputs[0] if len(inputs) == 1 else inputs)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        raise ValueError(
            f"layer {index} ('{name}', {type(layer).__name__}) failed on an input of shape "
            f"{_describe(x)}: {type(exc).__name__}: {exc}; check that the sample has the shape "
            "and dtype the model's first layer expects"
        ) from exc
    return check_sample(out, f"the output of layer {index} ('{name}')")


def _backward(outputs: tuple[Tensor, ...], tracker: _ProfileSkipTracker) -> None:
    roots = [t for t in (*outputs, *tracker.fresh) if t.requires_grad]
    tracker.fresh.clear()
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])


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


# -- measuring --------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_layer(layer: nn.Module, index: int, name: str, x: tuple[Tensor, ...], grad: bool,
                tracker: _ProfileSkipTracker, budget: float,
                device: torch.device) -> tuple[float, tuple[Tensor, ...]]:
    """Lower-median forward + backward seconds of runs filling `budget` s, after a warm-up.

    The warm-up (not counted) absorbs one-off costs: allocator growth, lazy initialization,
    the first autograd call of the process. At least two runs are timed, so that one late
    wake-up or preemption cannot decide a layer's time on its own.
    """
    runs: list[float] = []
    out = _forward(layer, index, name, x, tuple(_feed(t, grad) for t in x))
    _backward(out, tracker)
    began = time.perf_counter()
    group = collective_group(layer)

    def more() -> bool:
        want = len(runs) < 2 or time.perf_counter() - began < budget
        if group is None:
            return want
        # a sharded layer runs collectives: every rank repeats while any rank wants to
        flag = torch.tensor([int(want)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    while more():
        inputs = tuple(_feed(t, grad) for t in x)  # copied outside the timed region
        _sync(device)
        tick = time.perf_counter()
        out = _forward(layer, index, name, x, inputs)
        _backward(out, tracker)
        _sync(device)
        runs.append(time.perf_counter() - tick)
    # the lower median: noise (preemption, late wake-ups) only ever adds time
    return statistics.median_low(runs), tuple(t.detach() for t in out)


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


def _size_layer(layer: nn.Module, index: int, name: str, x: tuple[Tensor, ...], grad: bool,
                tracker: _ProfileSkipTracker, device: torch.device,
                kept: set[int]) -> tuple[int, tuple[Tensor, ...], set[int]]:
    """Activation bytes saved by one forward of `layer` on the micro-batch `x`.

    `kept`: storages of `x` that the previous layer already saved. Returns the bytes, the
    output, and which of the output's storages this layer saved (for the next layer).
    """
    inputs = tuple(_feed(t, grad) for t in x)
    if device.type == "cuda":
        # what the forward allocates and keeps: saved tensors and the output (not tested on CI)
        _sync(device)
        before = torch.cuda.memory_allocated(device)
        out = _forward(layer, index, name, x, inputs)
        _sync(device)
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
        out = _forward(layer, index, name, x, inputs)
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
            raise ValueError(f"the sample {_describe(x)} has no batch dimension to split into "
                             f"{chunks} micro-batches; give a batch of shape (batch, ...)")
        rows = math.ceil(x[0].size(0) / chunks)
        xm = tuple(t[:rows] for t in x)
    grad = any(t.requires_grad for t in xs)  # later layers: every floating input
    names = layer_names(module)
    budget = timeout / len(module)
    trackers = (_ProfileSkipTracker(), _ProfileSkipTracker())
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
                        sec, x = _time_layer(live, index, name, x, grad, trackers[0], budget,
                                             dev)
                    prof.output_bytes = _nbytes(x)
                    prof.comm_ms = est.comm_ms(prof.output_bytes, tp, bandwidth)
                    prof.time_ms = sec * 1000 * est.compute_scale + prof.comm_ms
                if measure_size:
                    with use_skip_tracker(trackers[1]):
                        used, xm, kept = _size_layer(live, index, name, xm, grad, trackers[1],
                                                     dev, kept)
                    prof.activation_bytes = round(used * est.compute_scale)
            profiles.append(prof)
            grad = True
            bar.update()
    return profiles
