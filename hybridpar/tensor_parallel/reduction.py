"""A module's reductions over features that tp shards, summed over the tp group: a distributed
norm.

OLMo 2 normalizes q and k over the whole projection (an RMSNorm of n_heads * head_dim
features); with q_proj column-sharded, a rank holds F / tp of them, and the mean of squares
needs all F:

    one device          mean(x ** 2, -1)                       over the F features
    rank r of tp        all_reduce(sum(x_r ** 2, -1)) / F      x_r: its F / tp features

`reduce_over_tp(module, group)` makes every ``mean`` / ``sum`` over the last dim inside
`module`'s forward so: a TorchFunctionMode entered by a forward pre-hook and left by a forward
hook that runs even when the forward fails. The sum's backward is an all-reduce too: every
rank's output depends on every rank's features, so the gradient of the sum is the sum of the
ranks' gradients. `plans.flow` chooses the modules (their reductions over the last dim all
take a column's shard) and `plans.plan` installs it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode

from hybridpar.sharded.mappings import copy_to_group, group_size, reduce_from_group
from hybridpar.tensor_parallel.base import GroupRef

__all__ = ["REDUCED_ATTR", "reduce_over_tp"]

REDUCED_ATTR = "_hybridpar_reduced_over_tp"   # set on a module whose reductions it sums
_REDUCTIONS = ("mean", "sum")


def _over_last_dim(x: Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if isinstance(dim, (tuple, list)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and x.dim() > 0 and dim % x.dim() == x.dim() - 1


class _SumOverTp(TorchFunctionMode):
    """`mean` / `sum` over the last dim: the sum over every rank's features."""

    def __init__(self, group: ProcessGroup | None) -> None:
        super().__init__()
        self.group = group

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        x = args[0] if args else None
        if name not in _REDUCTIONS or not isinstance(x, Tensor) or \
                not _over_last_dim(x, tuple(args), kwargs):
            return func(*args, **kwargs)
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        total = torch.sum(x, dim=-1, keepdim=keepdim, dtype=kwargs.get("dtype"))
        total = reduce_from_group(copy_to_group(total, self.group), self.group)
        return total / (x.shape[-1] * group_size(self.group)) if name == "mean" else total


class _Enter:
    """The forward pre-hook: enters the mode (a stack: a module may run inside itself)."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.ref = GroupRef(group)
        self.modes: list[_SumOverTp] = []

    def __call__(self, module: nn.Module, args: Any) -> None:
        mode = _SumOverTp(self.ref.group)
        mode.__enter__()
        self.modes.append(mode)


class _Leave:
    """The forward hook (run even when the forward raised): leaves the mode."""

    def __init__(self, enter: _Enter) -> None:
        self.enter = enter

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.enter.modes:
            self.enter.modes.pop().__exit__(None, None, None)


def reduce_over_tp(module: nn.Module, group: ProcessGroup | None) -> None:
    """Sum `module`'s reductions over the last dim over the tp `group` (module docstring)."""
    if getattr(module, REDUCED_ATTR, False):
        return
    enter = _Enter(group)
    module.register_forward_pre_hook(enter)
    module.register_forward_hook(_Leave(enter), always_call=True)
    setattr(module, REDUCED_ATTR, True)
