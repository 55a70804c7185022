"""ParallelEmbedding: torchshard's embedding, its table split by vocabulary or by features."""

from __future__ import annotations

import struct

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.sharded.attrs import (
    get_parallel_dim,
    register_parallel_attribute,
    register_parallel_dim,
)
from hybridpar.sharded.mappings import group_size, shard_sizes
from hybridpar.tensor_parallel.base import ParallelLayer, convert_children
from hybridpar.tensor_parallel.functional import parallel_embedding
from hybridpar.tensor_parallel.sliced_init import init_from_full
from hybridpar.tensor_parallel.state import (
    register_ddp_parameters_to_ignore,
    register_full_shape,
    shard_of,
)
from hybridpar.topology import default_tp_group

__all__ = ["ParallelEmbedding", "carried_forward", "check_sequence_length",
           "sequence_length_problem"]


def carried_forward(module: nn.Module) -> str | None:
    """Why `module` (an nn.Embedding or subclass) cannot become a `ParallelEmbedding` without
    losing what its forward does, or None. A subclass whose forward scales the lookup by its
    ``embed_scale`` (Gemma's ``*TextScaledWordEmbedding``: ``lookup * sqrt(D)``) is carried:
    the parallel layer keeps the scale (`ParallelEmbedding.output_scale`)."""
    if type(module).forward is nn.Embedding.forward or _scale_of(module) is not None:
        return None
    return (f"its class {type(module).__name__} overrides nn.Embedding's forward, which a "
            "ParallelEmbedding would not do")


def rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` (to nearest, ties to even), on the host: what HF's buffer of
    that dtype holds. bfloat16 is rounded from the float32 value (a tie of the two roundings
    could differ from one rounding by one bfloat16 step; sqrt(D) for D < 2^24 never ties)."""
    if dtype == torch.float32 or dtype == torch.bfloat16:
        single = struct.unpack("<f", struct.pack("<f", value))[0]
        if dtype == torch.float32:
            return single
        bits = struct.unpack("<I", struct.pack("<f", single))[0]
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return struct.unpack("<f", struct.pack("<I", bits))[0]
    if dtype == torch.float16:
        return struct.unpack("<e", struct.pack("<e", value))[0]
    return value


def _scale_of(module: nn.Module) -> float | None:
    """The output scale of a scaled-lookup subclass: the value its ``embed_scale`` buffer
    holds (a model built in float32 then cast keeps the float32-rounded value), or, on
    `meta`, the number HF's ``_init_weights`` will fill it with."""
    buffer = getattr(module, "embed_scale", None)
    if isinstance(buffer, Tensor) and not buffer.is_meta:
        return float(buffer.item())
    scale = getattr(module, "scalar_embed_scale", None)
    return None if scale is None else float(scale)


def sequence_length_problem(length: int, tp: int) -> str | None:
    """Why sequence parallelism cannot split sequences of `length` tokens over `tp` ranks
    (each rank takes T / tp of them), with what to do; None when tp divides it. The config
    check (``data.seq_len``) and every tp rank's first layer (before any collective) ask it."""
    if tp <= 1 or length % tp == 0:
        return None
    return (f"parallel.sequence_parallel splits each sequence of {length} tokens over tp={tp} "
            f"ranks; use a data.seq_len divisible by {tp} (the tokens of each sequence)")


def check_sequence_length(x: Tensor, group: ProcessGroup | None) -> None:
    """A ValueError on every tp rank (all hold the same batch) before the split of `x`'s
    tokens (dim -2 of the embedding's output) when tp does not divide them."""
    problem = sequence_length_problem(x.shape[-2], group_size(group))
    if problem is not None:
        raise ValueError(problem)


class ParallelEmbedding(ParallelLayer):
    """`nn.Embedding` whose table is split over the tp group by vocabulary (0) or features.

    dim=None is a plain `nn.Embedding`. Vocab-parallel (dim=0): each rank holds rows
    ``shard_range(num_embeddings, tp, rank)`` (uneven allowed) and looks up the ids it owns;
    the partial outputs are all-reduced. Feature-parallel (dim=1 / -1): each rank holds
    columns ``shard_range(embedding_dim, tp, rank)``; the output is all-gathered. Both give
    full, untagged outputs. `max_norm` works with dim None and 0 only.
    """

    #: a scaled lookup's factor (Gemma: sqrt(D)), applied as its Hugging Face class does
    #: (the value rounded to the table's dtype, then multiplied); None: a plain lookup
    output_scale: float | None = None

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 max_norm: float | None = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False,
                 _weight: Tensor | None = None, dim: int | None = None, *,
                 _freeze: bool = False, group: ProcessGroup | None = None,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self._setup_group(dim, group, "ParallelEmbedding")
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx={padding_idx} must be within the vocabulary "
                                 f"[-{num_embeddings}, {num_embeddings})")
            padding_idx %= num_embeddings
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scale_grad_by_freq = scale_grad_by_freq
        self.sparse = sparse
        tp, rank = self.tp_size, self.tp_rank
        shape = [num_embeddings, embedding_dim]
        if dim is not None:
            shape[0 if dim == 0 else 1] = shard_sizes(shape[0 if dim == 0 else 1], tp)[rank]
        if _weight is None:
            self.weight = nn.Parameter(torch.empty(shape, device=device, dtype=dtype),
                                       requires_grad=not _freeze)
            self._tag_parameters()
            self.reset_parameters()
        else:
            if tuple(_weight.shape) != (num_embeddings, embedding_dim):
                raise ValueError(f"_weight has shape {tuple(_weight.shape)}, expected the full "
                                 f"table ({num_embeddings}, {embedding_dim})")
            # as nn.Embedding: dim=None uses the given tensor itself; shards are copies
            weight = _weight if dim is None else torch.empty(
                shape, device=_weight.device, dtype=_weight.dtype)
            self.weight = nn.Parameter(weight, requires_grad=not _freeze)
            self._tag_parameters()
            if dim is not None:
                with torch.no_grad():
                    self.weight.copy_(shard_of(_weight, self.weight, self.group))

    def _tag_parameters(self) -> None:
        # order type 1: the table (V, D) is read as is; dim 0 = vocabulary, -1 = features
        register_parallel_attribute(self.weight, -1 if self.dim == 1 else self.dim, 1)
        register_full_shape(self.weight, (self.num_embeddings, self.embedding_dim))

    def reset_parameters(self) -> None:
        """Re-initialize as `nn.Embedding` would (N(0, 1), padding row zero), keep the slice."""
        if self.weight.is_meta:
            return
        full = nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx,
                            device="meta", dtype=self.weight.dtype)
        init_from_full(self, full, nn.Embedding.reset_parameters, group=self.group)

    def slice_parameters(self) -> None:
        """torchshard's second construction step; the table is sliced from the start here."""

    @classmethod
    def from_module(cls, module: nn.Embedding, dim: int, *,
                    group: ProcessGroup) -> ParallelEmbedding:
        """A layer (dim 0: vocab, -1: features) holding this rank's slice of `module` (and
        its output scale, `carried_forward`; a ValueError for a forward it cannot carry)."""
        why = carried_forward(module)
        if why is not None:
            raise ValueError(f"cannot shard the embedding: {why}; mark it 'replicate'")
        w = module.weight
        new = cls(module.num_embeddings, module.embedding_dim, module.padding_idx,
                  module.max_norm, module.norm_type, module.scale_grad_by_freq, module.sparse,
                  dim=dim, group=group, device="meta", dtype=w.dtype)
        if not w.is_meta:  # no random number is drawn: the slice of the old values
            new.to_empty(device=w.device)
            new.weight.data.copy_(shard_of(w.detach(), new.weight, group))
        new.weight.requires_grad_(w.requires_grad)
        new.output_scale = _scale_of(module)
        new.train(module.training)
        return new

    @classmethod
    def convert_parallel_embedding(cls, module: nn.Module, dim: int | None = None, *,
                                   group: ProcessGroup | None = None) -> nn.Module:
        """Replace every `nn.Embedding` in `module` (recursively) by a `ParallelEmbedding`
        holding its slice (dim 0: vocab, 1 / -1: features; None: the same Parameter), no
        random number drawn; the shards are registered for DDP to ignore. Returns `module`,
        or the new layer when `module` is itself an `nn.Embedding`."""
        converted: nn.Module
        if isinstance(module, nn.Embedding):
            if dim is None:
                converted = cls(module.num_embeddings, module.embedding_dim, module.padding_idx,
                                module.max_norm, module.norm_type, module.scale_grad_by_freq,
                                module.sparse, dim=None, group=group, device="meta")
                converted.register_parameter("weight", module._parameters["weight"])
            else:
                converted = cls.from_module(
                    module, dim, group=group if group is not None else default_tp_group())
        else:
            converted = convert_children(
                module, lambda child: cls.convert_parallel_embedding(child, dim, group=group))
        register_ddp_parameters_to_ignore(converted)
        return converted

    #: sequence parallelism: the vocab-parallel parts reduce-scattered along T (dim=0 only)
    sequence: bool = False

    def forward(self, x: Tensor) -> Tensor:
        if self.sequence:   # (B, T) ids: T split over tp, refused here when uneven
            check_sequence_length(x.unsqueeze(-1), self.group)
        out = parallel_embedding(
            x, self.weight, self.padding_idx, self.max_norm, self.norm_type,
            self.scale_grad_by_freq, self.sparse, num_embeddings=self.num_embeddings,
            dim=self.dim, embedding_dim=self.embedding_dim, group=self.group,
            sequence=self.sequence)
        if self.output_scale is None:
            return out
        dim = get_parallel_dim(out)              # a sequence shard stays one
        out = out * rounded(self.output_scale, self.weight.dtype)   # a host number: no copy
        if dim is not None:
            register_parallel_dim(out, dim)
        return out

    def extra_repr(self) -> str:
        s = f"{self.num_embeddings}, {self.embedding_dim}"
        if self.padding_idx is not None:
            s += f", padding_idx={self.padding_idx}"
        if self.max_norm is not None:
            s += f", max_norm={self.max_norm}"
        if self.norm_type != 2.0:
            s += f", norm_type={self.norm_type}"
        if self.scale_grad_by_freq:
            s += ", scale_grad_by_freq=True"
        if self.sparse:
            s += ", sparse=True"
        if self.output_scale is not None:
            s += f", output_scale={self.output_scale:g}"
        return s + f", dim={self.dim}"
