"""ParallelLinear, ParallelConv1D, RegisterParallelDim: torchshard's linear layers, same numbers.

`ParallelEmbedding` lives in `embedding` and is re-exported here. Each layer holds this rank's
shard of the full weight:

    layer               dim      weight (local)      bias (local)    output
    ParallelLinear      None     (out, in)           (out,)          (*, out)
                        1 / -1   (out / tp, in)      (out / tp,)     (*, out / tp), tag -1
                        0        (out, in / tp)      (out,) full     (*, out)
    ParallelEmbedding   None     (V, D)              -               (*, D)
                        0        (V_r, D)            -               (*, D)
                        1 / -1   (V, D_r)            -               (*, D)

Same numbers as one device: a layer built under a seed initializes the FULL tensors exactly
as `nn.Linear` / `nn.Embedding` would (a temporary full layer consumes the RNG the same way)
and keeps its slice, so with the same `torch.manual_seed` on every rank the shards together
are the plain layer's tensors, and the RNG stream afterwards is the same too. On the meta
device nothing is initialized and no random number is drawn; after ``to_empty``, call
``reset_parameters()`` under the seed (or load a state dict).

Parameters carry their tags (`attrs`) and full shape (`state.FULL_SHAPE_ATTR`), which
`state.collect_state_dict` / `relocate_state_dict` and `init.shard_init_helper_` read. The
tags are restored after ``copy.deepcopy`` and ``module.to_empty`` / ``.to`` (which may
replace the Parameter objects).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.sharded.attrs import register_parallel_attribute, register_parallel_dim
from hybridpar.tensor_parallel.base import ParallelLayer, convert_children
from hybridpar.tensor_parallel.embedding import ParallelEmbedding
from hybridpar.tensor_parallel.functional import check_parallel_dim, parallel_linear
from hybridpar.tensor_parallel.fused import (
    FUSED_ATTR,
    Fused,
    fused_shard_of,
    part_count,
    part_sizes,
)
from hybridpar.tensor_parallel.sliced_init import init_from_full
from hybridpar.tensor_parallel.state import (
    register_ddp_parameters_to_ignore,
    register_full_shape,
    shard_of,
)

__all__ = ["ParallelConv1D", "ParallelEmbedding", "ParallelLinear", "RegisterParallelDim"]


def _splits(fused: Fused, length: int, tp: int) -> bool:
    """Whether `fused` cuts a dim of `length` into parts that tp divides."""
    try:
        return all(n % tp == 0 for n in part_sizes(fused, length))
    except (ValueError, TypeError):
        return False


class ParallelLinear(ParallelLayer):
    """`nn.Linear` whose weight is split over the tp group by output (dim=1 / -1) or input (0).

    dim=None is a plain `nn.Linear`. Column-parallel (dim=1 / -1): rows of the weight and
    the bias; the output holds ``out_features / tp`` features, tagged parallel dim -1.
    Row-parallel (dim=0): columns of the weight, the full bias added after the all-reduce;
    the input may be full (split here) or tagged -1 (used as is); the output is full.
    The sharded features must divide by tp.

    ``fused=k`` (column only): the output is k equal parts (q | k | v), each split over tp;
    the rank keeps its slice of every part, in order (`fused`): its output is
    ``[q_r | k_r | v_r]``, so code that splits the output in k parts works on the shard.
    ``fused=(n_0, n_1, ...)``: parts of those widths (q | k | v under grouped queries).
    """

    _transposed = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dim: int | None = None, *, fused: Fused = 1,
                 group: ProcessGroup | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self._setup_group(dim, group, "ParallelLinear")
        self.in_features = in_features
        self.out_features = out_features
        self.fused = fused
        tp = self.tp_size
        if fused != 1 and (dim not in (1, -1) or not _splits(fused, out_features, tp)):
            raise ValueError(
                f"ParallelLinear(out_features={out_features}, dim={dim}, fused={fused}): a "
                f"fused layer is column-parallel (dim=-1) with out_features made of k equal "
                f"parts (fused=k) or of parts of the widths given (adding up to it), each a "
                f"multiple of tp={tp}")
        sharded = {None: None, 0: ("in_features", in_features),
                   1: ("out_features", out_features), -1: ("out_features", out_features)}[dim]
        if sharded is not None and sharded[1] % tp != 0:
            raise ValueError(
                f"ParallelLinear(in_features={in_features}, out_features={out_features}, "
                f"dim={dim}): {sharded[0]}={sharded[1]} is not divisible by the tp size {tp}; "
                f"choose {sharded[0]} as a multiple of {tp}, or change tp or dim"
            )
        column = dim in (1, -1)
        w_shape = ((out_features // tp, in_features) if column else
                   (out_features, in_features // tp) if dim == 0 else
                   (out_features, in_features))
        if self._transposed:  # stored (in, out), as HF's Conv1D
            w_shape = (w_shape[1], w_shape[0])
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(w_shape, **kw))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // tp if column else
                                                 out_features, **kw))
        else:
            self.register_parameter("bias", None)
        self._tag_parameters()
        self.reset_parameters()

    def _tag_parameters(self) -> None:
        # order type 0: the weight (out, in) is read reversed, as (in, out)
        column = self.dim in (1, -1)
        w_dim = -1 if column else self.dim
        register_parallel_attribute(self.weight, w_dim, 0)
        register_full_shape(self.weight, (self.out_features, self.in_features))
        if self.bias is not None:
            register_parallel_attribute(self.bias, -1 if column else None, 0)
            register_full_shape(self.bias, (self.out_features,))
        self._tag_fused()

    def _tag_fused(self) -> None:
        fused = getattr(self, "fused", 1)
        for p in (self.weight, self.bias):
            if p is not None and part_count(fused) > 1:
                setattr(p, FUSED_ATTR, part_sizes(fused, self.out_features))

    def reset_parameters(self) -> None:
        """Re-initialize as `nn.Linear` would the full layer, keeping this rank's slice."""
        if self.weight.is_meta:
            return
        full = nn.Linear(self.in_features, self.out_features, self.bias is not None,
                         device="meta", dtype=self.weight.dtype)
        init_from_full(self, full, nn.Linear.reset_parameters, group=self.group)

    def _load_full(self, weight: Tensor, bias: Tensor | None) -> None:
        slice_of = fused_shard_of if part_count(self.fused) > 1 else shard_of
        with torch.no_grad():
            self.weight.copy_(slice_of(weight, self.weight, self.group))
            if self.bias is not None and bias is not None:
                self.bias.copy_(slice_of(bias, self.bias, self.group))

    #: sequence parallelism's mode of this layer (`parallel_linear`'s `sequence`); None: off
    sequence: str | None = None

    def forward(self, x: Tensor) -> Tensor:
        return parallel_linear(x, self.weight, self.bias, self.dim, group=self.group,
                               sequence=self.sequence)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dim={self.dim}"
                + (f", fused={self.fused}" if part_count(self.fused) > 1 else ""))

    @classmethod
    def from_module(cls, module: nn.Module, dim: int | None, *, fused: Fused = 1,
                    group: ProcessGroup | None = None) -> ParallelLinear:
        """A layer of this class holding its slice of `module`'s values (no random number)."""
        old_w, old_b = module.weight, module.bias
        assert isinstance(old_w, Tensor)
        n_in, n_out = cls._sizes(module)
        new = cls._on_meta(n_in, n_out, isinstance(old_b, Tensor), dim, fused=fused,
                           group=group, dtype=old_w.dtype)
        if not old_w.is_meta:
            new.to_empty(device=old_w.device)
            new._load_full(old_w, old_b if isinstance(old_b, Tensor) else None)
        new.weight.requires_grad_(old_w.requires_grad)
        if new.bias is not None and isinstance(old_b, Tensor):
            new.bias.requires_grad_(old_b.requires_grad)
        new.train(module.training)
        return new

    @staticmethod
    def _sizes(module: nn.Module) -> tuple[int, int]:
        return int(module.in_features), int(module.out_features)  # type: ignore[arg-type]

    @classmethod
    def _on_meta(cls, n_in: int, n_out: int, bias: bool, dim: int | None, *, fused: Fused,
                 group: ProcessGroup | None, dtype: torch.dtype) -> ParallelLinear:
        """An empty layer of this class on `meta` (its constructor's argument order)."""
        return cls(n_in, n_out, bias, dim, fused=fused, group=group, device="meta", dtype=dtype)

    def reset_params(self) -> None:
        """torchshard's name for `reset_parameters`."""
        self.reset_parameters()

    def slice_params(self) -> None:
        """torchshard's second construction step; here the layer holds its slice from the
        start, so there is nothing left to slice (kept so torchshard code runs)."""

    @classmethod
    def convert_parallel_linear(cls, module: nn.Module, dim: int | None = None, *,
                                group: ProcessGroup | None = None) -> nn.Module:
        """Replace every `nn.Linear` in `module` (recursively) by a `ParallelLinear` slice of it.

        Values are kept (each new layer holds its slice of the old weight and bias; with
        ``dim=None`` the old Parameters themselves) and no random number is drawn. The
        sharded parameters are registered for DDP to ignore
        (`register_ddp_parameters_to_ignore`). Returns `module`, or a new layer when `module`
        is itself an `nn.Linear`. The children of `nn.MultiheadAttention` are left alone (it
        reads its ``out_proj`` weight directly instead of calling it).
        """
        converted: nn.Module
        if isinstance(module, nn.Linear):
            converted = cls.from_module(module, dim, group=group)
            if dim is None:   # nothing sharded: the layer keeps the very same Parameters
                converted.register_parameter("weight", module._parameters["weight"])
                converted.register_parameter("bias", module._parameters["bias"])
        elif isinstance(module, nn.MultiheadAttention):
            return module
        else:
            converted = convert_children(
                module, lambda child: cls.convert_parallel_linear(child, dim, group=group))
        # DDP must neither broadcast the shards from rank 0 nor average their gradients
        # over the tp ranks (torchshard's conversions register them the same way)
        register_ddp_parameters_to_ignore(converted)
        return converted


class ParallelConv1D(ParallelLinear):
    """Hugging Face's `Conv1D` (GPT-2), sharded: a Linear whose weight is stored transposed.

    ``ParallelConv1D(nf, nx, dim=None)`` takes Conv1D's arguments (out, in); the weight is
    (in, out) as Conv1D's, y = x W + b. Column (dim=-1): weight (in, out / tp), sharded on
    its last tensor dim; row (dim=0): (in / tp, out); ``fused=k`` as `ParallelLinear`. State
    dict keys and full shapes are Conv1D's. Built under a seed, it initializes the full
    tensors as Conv1D does (weight N(0, 0.02), bias zero) and keeps its slice.
    """

    _transposed = True

    def __init__(self, nf: int, nx: int, bias: bool = True, dim: int | None = None, *,
                 fused: Fused = 1, group: ProcessGroup | None = None,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__(nx, nf, bias, dim, fused=fused, group=group, device=device,
                         dtype=dtype)

    @property
    def nf(self) -> int:
        return self.out_features

    @property
    def nx(self) -> int:
        return self.in_features

    @staticmethod
    def _sizes(module: nn.Module) -> tuple[int, int]:
        return int(module.nx), int(module.nf)  # type: ignore[arg-type]

    @classmethod
    def _on_meta(cls, n_in: int, n_out: int, bias: bool, dim: int | None, *, fused: Fused,
                 group: ProcessGroup | None, dtype: torch.dtype) -> ParallelLinear:
        return cls(n_out, n_in, bias, dim, fused=fused, group=group, device="meta", dtype=dtype)

    def _tag_parameters(self) -> None:
        # order type 1: the weight (in, out) is read as is; -1 = out (column), 0 = in (row)
        column = self.dim in (1, -1)
        register_parallel_attribute(self.weight, -1 if column else self.dim, 1)
        register_full_shape(self.weight, (self.in_features, self.out_features))
        if self.bias is not None:
            register_parallel_attribute(self.bias, -1 if column else None, 0)
            register_full_shape(self.bias, (self.out_features,))
        self._tag_fused()

    def reset_parameters(self) -> None:
        """Re-initialize as Conv1D would the full layer, keeping this rank's slice."""
        if self.weight.is_meta:
            return
        full = nn.Module()
        full.weight = nn.Parameter(torch.empty(self.in_features, self.out_features,
                                               device="meta", dtype=self.weight.dtype))
        full.bias = nn.Parameter(torch.empty(self.out_features, device="meta",
                                             dtype=self.weight.dtype))
        init_from_full(self, full, _conv1d_init, group=self.group)

    #: sequence parallelism's mode of this layer (`parallel_linear`'s `sequence`); None: off
    sequence: str | None = None

    def forward(self, x: Tensor) -> Tensor:
        return parallel_linear(x, self.weight.t(), self.bias, self.dim, group=self.group,
                               sequence=self.sequence)


def _conv1d_init(conv: Any) -> None:
    """Hugging Face's Conv1D initialization: weight N(0, 0.02), bias zero."""
    nn.init.normal_(conv.weight, std=0.02)
    nn.init.zeros_(conv.bias)


class RegisterParallelDim(nn.Module):
    """Tag its input as sharded on `dim` (None, 0, 1, -1) and return the same tensor object.

    Elementwise ops drop the tag; put this after them, e.g. between a column-parallel and a
    row-parallel `ParallelLinear`: ``Linear(dim=-1), ReLU(), RegisterParallelDim(-1),
    Linear(dim=0)``.
    """

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        check_parallel_dim(dim, "RegisterParallelDim")
        self.dim = dim

    def forward(self, x: Any) -> Any:
        """`x` (a Tensor, or a tuple / list of them: each tagged) returned as it is."""
        for t in (x if isinstance(x, (tuple, list)) else (x,)):
            if isinstance(t, Tensor):
                register_parallel_dim(t, self.dim)
        return x

    def extra_repr(self) -> str:
        return f"dim={self.dim}"
