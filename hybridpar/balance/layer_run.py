"""One run of one layer for the profiler: fresh inputs, a forward whose errors name the layer.

Each run feeds the layer fresh copies of its input, detached (floating tensors require grad,
as a stage's input does) and cloned (so an in-place first op such as ``ReLU(inplace=True)``
is allowed and the sample itself is never modified). `@skippable` layers run inside a
`ProfileSkipTracker` that keeps stashed tensors (detached) for the layers that pop them, and
pops without removing them, so repeated runs work; each run's backward covers the layer's
outputs and the tensors it stashed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchgpipe.microbatch import Batch
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.tracker import SkipTracker

__all__ = ["ProfileSkipTracker", "check_sample", "describe", "feed", "run_backward",
           "run_forward", "sync"]


def check_sample(sample: object, what: str = "sample") -> tuple[Tensor, ...]:
    """`sample` as a tuple of tensors, or a TypeError saying what is expected."""
    if isinstance(sample, Tensor):
        return (sample,)
    if isinstance(sample, tuple) and sample and all(isinstance(t, Tensor) for t in sample):
        return sample
    raise TypeError(f"{what} must be a Tensor or a tuple of Tensors, got "
                    f"{type(sample).__name__}; pass an example mini-batch such as "
                    "torch.randn(batch, features)")


def describe(xs: tuple[Tensor, ...]) -> str:
    """The shapes and dtypes of `xs`, for messages: ``(8, 16) float32``."""
    shapes = [f"{tuple(x.shape)} {str(x.dtype).replace('torch.', '')}" for x in xs]
    return shapes[0] if len(shapes) == 1 else "(" + ", ".join(shapes) + ")"


def feed(x: Tensor, grad: bool) -> Tensor:
    """A fresh non-leaf copy of `x`: detached, requiring grad when floating and `grad`."""
    leaf = x.detach()
    if grad and leaf.is_floating_point():
        return leaf.requires_grad_(True).clone()
    return leaf.clone()


class ProfileSkipTracker(SkipTracker):
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
        return None if tensor is None else feed(tensor, True)


def run_forward(layer: nn.Module, index: int, name: str, x: tuple[Tensor, ...],
                inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """`layer` on `inputs` (fresh copies of `x`); errors name the layer and the shape."""
    try:
        out = layer(inputs[0] if len(inputs) == 1 else inputs)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        raise ValueError(
            f"layer {index} ('{name}', {type(layer).__name__}) failed on an input of shape "
            f"{describe(x)}: {type(exc).__name__}: {exc}; check that the sample has the shape "
            "and dtype the model's first layer expects"
        ) from exc
    return check_sample(out, f"the output of layer {index} ('{name}')")


def run_backward(outputs: tuple[Tensor, ...], tracker: ProfileSkipTracker) -> None:
    """Backward from the outputs and the tensors stashed since the last run (ones as
    gradients)."""
    roots = [t for t in (*outputs, *tracker.fresh) if t.requires_grad]
    tracker.fresh.clear()
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])


def sync(device: torch.device) -> None:
    """Wait for the device's queued kernels (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
