"""Initializers for sharded tensors (torchshard's `nn.init`) and xlstm-jax's `scale_init`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from hybridpar.tensor_parallel.init import shard_init_helper_

__all__ = ["scale_init", "shard_init_helper_"]


def scale_init(init_fn: Callable[..., Any], scale_factor: float = 1.0) -> Callable[..., Tensor]:
    """An initializer that runs ``init_fn(tensor, ...)`` then multiplies `tensor` by the factor.

    `init_fn` is an in-place initializer such as ``torch.nn.init.kaiming_uniform_``; the
    wrapped one takes the same arguments, draws the same random numbers and returns the
    tensor, so it also works as the `init_method` of `shard_init_helper_`:

        >>> init = scale_init(torch.nn.init.normal_, 0.5)   # N(0, 1) * 0.5
        >>> init(torch.empty(3, 4), mean=0.0, std=1.0)
    """
    if not callable(init_fn):
        raise TypeError(f"scale_init takes an initializer function, got {type(init_fn).__name__}")
    factor = float(scale_factor)

    def scaled(tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        init_fn(tensor, *args, **kwargs)
        with torch.no_grad():
            tensor.mul_(factor)
        return tensor

    scaled.__name__ = f"scaled_{getattr(init_fn, '__name__', 'init')}"
    scaled.__doc__ = f"{getattr(init_fn, '__name__', 'init_fn')} times {factor:g}."
    return scaled
