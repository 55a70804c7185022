"""A mini-batch as micro-batches: split on dim 0, weighted by rows, moved to the device.

    input (7 rows), chunks=4   ->   micro-batches of 2, 2, 2, 1 rows   (as torch.chunk)
    weights                         2/7, 2/7, 2/7, 1/7   (each loss's share of the batch)

The first stage moves inputs to its device, the last one targets (`non_blocking`: a copy
that overlaps compute when the batch is pinned). A step's *signature* (the micro-batches'
shapes and dtypes) is what its messages depend on (`comm.SpecBook`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["TensorOrTensors", "rows", "signature", "split_batch", "to_device"]

TensorOrTensors = Tensor | tuple[Tensor, ...]


def split_batch(x: Any, chunks: int, what: str) -> list[Any]:
    """Split a Tensor or tuple of Tensors on dim 0 into at most `chunks` micro-batches."""
    if isinstance(x, Tensor):
        if x.dim() == 0 or x.shape[0] == 0:
            raise ValueError(f"{what} has no rows (shape {tuple(x.shape)}); pass a batch "
                             "with at least one row on dim 0")
        return list(x.chunk(chunks))
    if isinstance(x, tuple) and x and all(isinstance(t, Tensor) for t in x):
        parts = [split_batch(t, chunks, what) for t in x]
        if len({len(p) for p in parts}) != 1 or len({t.shape[0] for t in x}) != 1:
            raise ValueError(f"the tensors of {what} have different batch sizes "
                             f"{[t.shape[0] for t in x]}; they must agree on dim 0")
        return [tuple(p[i] for p in parts) for i in range(len(parts[0]))]
    raise TypeError(f"{what} must be a Tensor or a tuple of Tensors, got {type(x).__name__}")


def rows(x: TensorOrTensors) -> int:
    """The batch size (dim 0) of a Tensor or tuple of Tensors."""
    return (x[0] if isinstance(x, tuple) else x).shape[0]


def signature(inputs: Sequence[Any]) -> tuple[Any, ...]:
    """The shapes and dtypes of a step's input micro-batches: what its messages depend on."""
    return tuple(tuple((tuple(t.shape), str(t.dtype)) for t in (x if isinstance(x, tuple)
                                                                   else (x,)))
                 for x in inputs)


def to_device(x: Any, device: torch.device) -> Any:
    """A micro-batch on `device` (a copy that overlaps compute when `x` is pinned)."""
    if isinstance(x, Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, tuple):
        return tuple(to_device(t, device) for t in x)
    return x
