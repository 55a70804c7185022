"""What the parallel layers share: the tp group they are sharded over, tags kept on Parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.sharded.mappings import group_rank, group_size
from hybridpar.tensor_parallel.functional import check_parallel_dim
from hybridpar.topology import default_tp_group

__all__ = ["GroupRef", "ParallelLayer", "convert_children"]


class GroupRef:
    """Holds a process group; deep copies share it (a ProcessGroup cannot be copied)."""

    __slots__ = ("group",)

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict[int, Any]) -> GroupRef:
        return self


class ParallelLayer(nn.Module):
    """What the parallel layers share: the group, tags kept on their Parameters."""

    tp_sharded_layer = True   # `sharded.attrs.is_sharded_layer`
    dim: int | None
    _group_ref: GroupRef

    def _setup_group(self, dim: int | None, group: ProcessGroup | None, what: str) -> None:
        check_parallel_dim(dim, what)
        self.dim = dim
        if dim is not None and group is None:
            group = default_tp_group()  # RuntimeError before hybridpar.init
        self._group_ref = GroupRef(group if dim is not None else None)

    @property
    def group(self) -> ProcessGroup | None:
        """The tp group the weight is sharded over (None when dim is None)."""
        return self._group_ref.group

    @property
    def tp_size(self) -> int:
        return group_size(self.group)

    @property
    def tp_rank(self) -> int:
        return group_rank(self.group)

    def _tag_parameters(self) -> None:
        raise NotImplementedError

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._tag_parameters()  # deepcopy / pickle build new Parameters without attributes

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        out = super()._apply(fn, recurse)
        self._tag_parameters()  # to_empty / to may swap in new Parameter objects
        return out


def convert_children(module: nn.Module, convert: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """Replace every child of `module` that `convert` turns into another module; `module`."""
    for name, child in module.named_children():
        new = convert(child)
        if new is not child:
            setattr(module, name, new)
    return module
