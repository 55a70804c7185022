"""ModelParallelismWrapper: one module per tp rank, with rank-dependent initial parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from hybridpar.sharded.mappings import group_rank, group_size
from hybridpar.tensor_parallel.base import GroupRef
from hybridpar.topology import default_tp_group

__all__ = ["ModelParallelismWrapper"]

_MIX = 0x9E3779B97F4A7C15  # an odd 64-bit constant: rank seeds spread far apart
_SEED_BOUND = 2**62


class ModelParallelismWrapper(nn.Module):
    """Build ``module_fn()`` on every tp rank, each rank's parameters its own (xlstm-jax's).

    The parameters are not slices of one tensor: each tp rank holds a different module of
    the same shape (a "stacked" parameter over the tp axis), and the wrapper forwards to it.

        option                    rank r builds module_fn() with the RNG ...
        split_rngs=True           seeded from one draw of the current stream and r:
                                  different on every rank, reproducible under a seed
        split_rngs=False          as it is: the same on every rank given the same seed
        mask_except_model_idx=k   then zeroes every parameter unless r == k

    With split_rngs the current stream advances by exactly one draw on every rank (so it
    stays the same across ranks) and the CPU and current CUDA generators are restored after
    the build. `collect_state_dict` does not stack these parameters: save them per rank.
    """

    def __init__(self, module_fn: Callable[[], nn.Module], *, split_rngs: bool = True,
                 mask_except_model_idx: int | None = None,
                 group: ProcessGroup | None = None) -> None:
        super().__init__()
        if not callable(module_fn):
            raise TypeError(f"module_fn must be a callable returning an nn.Module, got "
                            f"{type(module_fn).__name__}")
        group = group if group is not None else default_tp_group()
        self._group_ref = GroupRef(group)
        n, rank = group_size(group), group_rank(group)
        if mask_except_model_idx is not None and not (
                isinstance(mask_except_model_idx, int) and 0 <= mask_except_model_idx < n):
            raise ValueError(
                f"mask_except_model_idx={mask_except_model_idx!r} is not a rank of the tp "
                f"group of {n}; give an index in [0, {n - 1}] (or None: no masking)"
            )
        self.split_rngs, self.mask_except_model_idx = split_rngs, mask_except_model_idx
        module = self._build(module_fn, rank) if split_rngs else module_fn()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module_fn must return an nn.Module, got {type(module).__name__}")
        if mask_except_model_idx is not None and rank != mask_except_model_idx:
            with torch.no_grad():
                for p in module.parameters():
                    p.zero_()
        self.module = module

    @staticmethod
    def _build(module_fn: Callable[[], nn.Module], rank: int) -> Any:
        base = int(torch.randint(_SEED_BOUND, (1,)))  # the same draw on every rank
        seed = (base + rank * _MIX) % _SEED_BOUND
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda):
            torch.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.manual_seed(seed)
            return module_fn()

    @property
    def group(self) -> ProcessGroup | None:
        """The tp group the module is replicated (with distinct values) over."""
        return self._group_ref.group

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def extra_repr(self) -> str:
        return (f"split_rngs={self.split_rngs}, "
                f"mask_except_model_idx={self.mask_except_model_idx}")
