"""Forward hooks that keep, restore or resolve the parallel-dim tag around sharded layers.

    hook                  on                          does
    TagShardedInput       a row-parallel layer        tags an untagged input of width in / tp
    SplitFullInput        a TPDense layer             keeps this rank's slice of a full input
    TagNarrowInput        a module between two links  tags an untagged input of the shard width
    KeepTag               a module between two links  tags an output as wide as a sharded input
    GatherOutput          a layer with a shard output all-gathers it (full, untagged)
    RefuseLabels          a model with sharded logits refuses ``labels=`` (its loss is wrong)
    ExpectShardedOutput   a model with sharded logits raises if an op dropped their tag

They are module-level classes, so ``copy.deepcopy`` and pickle keep them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from hybridpar.sharded.attrs import get_parallel_dim, register_parallel_dim
from hybridpar.sharded.mappings import gather_from_group, group_size, scatter_to_group
from hybridpar.tensor_parallel.layers import ParallelLinear

__all__ = ["ExpectShardedOutput", "GatherOutput", "KeepTag", "RefuseLabels", "SplitFullInput",
           "TagNarrowInput", "TagShardedInput"]


class TagShardedInput:
    """Forward pre-hook of a row-parallel layer: an untagged input of width in / tp is a shard."""

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if isinstance(x, Tensor) and x.dim() > 0 and get_parallel_dim(x) is None and \
                isinstance(module, ParallelLinear) and module.tp_size > 1 and \
                x.shape[-1] == module.in_features // module.tp_size:
            register_parallel_dim(x, -1)


class SplitFullInput:
    """Forward pre-hook of a TPDense layer: a full-width input becomes this rank's slice.

    Its gradient is all-gathered back (`scatter_to_group`); an input of width in / tp (a shard,
    tagged or not) is tagged and used as it is.
    """

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        x = args[0] if args else None
        group = getattr(module, "group", None)
        n_in = getattr(module, "in_features", None)
        if not isinstance(x, Tensor) or x.dim() == 0 or group_size(group) == 1:
            return None
        if x.shape[-1] == n_in:
            shard = scatter_to_group(x, group, dim=-1)                 # (*, in / tp)
            register_parallel_dim(shard, -1)
            return (shard, *args[1:])
        if get_parallel_dim(x) is None and isinstance(n_in, int) and \
                x.shape[-1] * group_size(group) == n_in:
            register_parallel_dim(x, -1)
        return None


class TagNarrowInput:
    """Forward pre-hook between linked layers: an untagged input of the shard's width is tagged."""

    def __init__(self, width: int) -> None:
        self.width = width

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if isinstance(x, Tensor) and x.dim() > 0 and get_parallel_dim(x) is None and \
                x.shape[-1] == self.width:
            register_parallel_dim(x, -1)


class KeepTag:
    """Forward hook: an output as wide as a sharded input is sharded the same way."""

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        x = args[0] if args else None
        if isinstance(x, Tensor) and isinstance(output, Tensor) and output.dim() > 0 and \
                x.dim() > 0 and get_parallel_dim(x) in (-1, 1) and \
                get_parallel_dim(output) is None and output.shape[-1] == x.shape[-1]:
            register_parallel_dim(output, get_parallel_dim(x))


class GatherOutput:
    """Forward hook of a layer whose output must be full: all-gather a sharded output.

    HF's colwise_gather_output, a shard strategy's column that no row layer follows, a
    TPDense whose shard no layer reads. An untagged output is left as it is.
    """

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not isinstance(output, Tensor) or get_parallel_dim(output) not in (-1, 1):
            return None
        full = gather_from_group(output, getattr(module, "group", None), dim=-1)  # (*, out)
        register_parallel_dim(full, None)
        return full


class RefuseLabels:
    """Forward pre-hook (with kwargs) of a model with class-sharded logits: no labels= loss."""

    def __init__(self, layer: str) -> None:
        self.layer = layer

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> None:
        if kwargs.get("labels") is not None:
            raise ValueError(
                f"tp_plan made '{self.layer}' column-parallel: the logits hold only this "
                f"rank's classes, so a loss the model computes from labels= would be wrong; "
                f"call the model without labels and give its logits (shifted as the model "
                f"would) to hybridpar's ParallelCrossEntropyLoss, or mark '{self.layer}' "
                f"'replicate' in a dict plan")


class ExpectShardedOutput:
    """Forward hook guarding "auto"'s class-sharded logits: the output must still be tagged."""

    def __init__(self, layer: str) -> None:
        self.layer = layer

    def __call__(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not isinstance(output, Tensor) and isinstance(getattr(output, "logits", None),
                                                         Tensor):
            output = output.logits  # a Hugging Face ModelOutput
        if isinstance(output, Tensor) and get_parallel_dim(output) not in (-1, 1):
            raise RuntimeError(
                f"tp_plan 'auto' made the final Linear '{self.layer}' column-parallel "
                f"(class-sharded logits, tagged -1), but {type(module).__name__} returned an "
                f"untagged tensor: an op after '{self.layer}' dropped the tag and got only this "
                f"rank's classes. Give a dict plan with '{self.layer}': 'replicate', or end "
                f"the model with the Linear and use ParallelCrossEntropyLoss")
