"""Deferred BatchNorm: running statistics of the whole mini-batch, committed once per step.

torchgpipe's `DeferredBatchNorm` is the base; three things differ so that the statistics
equal those of `nn.BatchNorm` run on the whole mini-batch on one device:

    torchgpipe 0.0.7                          here
    commits the biased variance               commits the unbiased one (as nn.BatchNorm)
    commits after exactly `chunks` forwards   the pipe commits at the end of every step
    `sum`, `sum_squares` in the state dict    not persistent: same keys as nn.BatchNorm
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torchgpipe.batchnorm import DeferredBatchNorm as _TorchgpipeDeferredBatchNorm

__all__ = ["DeferredBatchNorm", "commit_deferred_batch_norms", "convert_deferred_batch_norm"]

M = TypeVar("M", bound=nn.Module)


class DeferredBatchNorm(_TorchgpipeDeferredBatchNorm):
    """Tracks every micro-batch of a step; `commit` updates the running statistics once."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, chunks: int = 1) -> None:
        super().__init__(num_features, eps, momentum, affine, chunks)
        sums, squares = self.sum, self.sum_squares
        del self.sum, self.sum_squares
        self.register_buffer("sum", sums, persistent=False)
        self.register_buffer("sum_squares", squares, persistent=False)

    def reset_running_stats(self) -> None:
        """nn.BatchNorm's reset, and the tracked sums of the step (a `meta` build's init)."""
        super().reset_running_stats()
        if hasattr(self, "sum_squares"):   # nn.BatchNorm.__init__ calls this before they exist
            self.sum.zero_()
            self.sum_squares.zero_()
            self.counter = self.tracked = 0

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _track(self, input: Tensor) -> bool:
        super()._track(input)
        return False  # never commit by counting: `commit` is called once per step

    def commit(self) -> None:
        """Fold the tracked micro-batches into the running statistics (no-op if none)."""
        if self.counter == 0:
            return
        n = self.counter
        mean = self.sum / n
        var = (self.sum_squares / n - mean**2) * (n / max(n - 1, 1))  # unbiased, as nn.BatchNorm
        assert self.num_batches_tracked is not None
        assert self.running_mean is not None and self.running_var is not None
        self.num_batches_tracked += 1
        m = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        with torch.no_grad():
            self.running_mean.mul_(1 - m).add_(mean * m)
            self.running_var.mul_(1 - m).add_(var * m)
        self.sum.zero_()
        self.sum_squares.zero_()
        self.counter = 0
        self.tracked = 0


def convert_deferred_batch_norm(module: M, chunks: int = 1) -> M:
    """Replace every BatchNorm that tracks running stats by a `DeferredBatchNorm` sharing its
    parameters and buffers (a BatchNorm module itself is returned converted)."""
    if isinstance(module, _BatchNorm) and module.track_running_stats \
            and not isinstance(module, DeferredBatchNorm):
        converted = DeferredBatchNorm(module.num_features, module.eps, module.momentum,
                                      module.affine, chunks)
        if module.affine:
            converted.register_parameter("weight", module.weight)
            converted.register_parameter("bias", module.bias)
        converted.register_buffer("running_mean", module.running_mean)
        converted.register_buffer("running_var", module.running_var)
        converted.register_buffer("num_batches_tracked", module.num_batches_tracked)
        assert module.running_mean is not None
        for name in ("sum", "sum_squares"):   # tracked in the statistics' own dtype (float64)
            converted.register_buffer(name, torch.zeros_like(module.running_mean),
                                      persistent=False)
        converted.train(module.training)
        return converted  # type: ignore[return-value]
    for name, child in module.named_children():
        module.add_module(name, convert_deferred_batch_norm(child, chunks))
    return module


def commit_deferred_batch_norms(module: nn.Module) -> None:
    """Commit every `DeferredBatchNorm` inside `module`."""
    for sub in module.modules():
        if isinstance(sub, DeferredBatchNorm):
            sub.commit()
