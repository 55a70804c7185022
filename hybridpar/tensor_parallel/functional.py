"""Functional tensor-parallel linear and embedding (torchshard's `nn.functional` forms).

The weights passed in are already this rank's shards; these functions only move activations.

    function            dim       weight (local)        input            output
    parallel_linear     None      (out, in)             (*, in)          (*, out)
                        1 / -1    (out / tp, in)        (*, in)          (*, out / tp)  tag -1
                        0         (out, in / tp)        (*, in)  or      (*, out)       full
                                                        (*, in / tp) tagged -1
    parallel_embedding  None      (V, D)                ids              (*, D)
                        0         (V_r, D)  rows r      ids              (*, D)         full
                        1 / -1    (V, D_r)  columns r   ids              (*, D)         full

V_r / D_r: this rank's share of V / D, uneven allowed (`mappings.shard_sizes`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar.sharded.attrs import SEQUENCE, get_parallel_dim, register_parallel_dim
from hybridpar.sharded.mappings import (
    copy_to_group,
    gather_from_group,
    gather_grad_scatter,
    group_rank,
    group_size,
    reduce_from_group,
    reduce_scatter_group,
    scatter_to_group,
    shard_range,
)
from hybridpar.topology import default_tp_group

__all__ = ["SEQUENCE_MODES", "check_parallel_dim", "parallel_embedding", "parallel_linear"]

_COLUMN = (1, -1)


def check_parallel_dim(dim: int | None, what: str) -> None:
    """Raise `ValueError` unless `dim` is one of None, 0, 1, -1."""
    if dim not in (None, 0, 1, -1):
        raise ValueError(
            f"{what} supports dim=None (not parallel), dim=0 (row / vocab parallel) or "
            f"dim=1 / -1 (column / feature parallel), got dim={dim!r}"
        )


def _group(dim: int | None, group: ProcessGroup | None) -> ProcessGroup | None:
    """The group a parallel op runs over: `group`, else the default tp group (None: no dim)."""
    if dim is None:
        return None
    return group if group is not None else default_tp_group()


# linear -------------------------------------------------------------------------------------

SEQUENCE_MODES = (None, "gathered", "gather", "scatter")


def parallel_linear(input: Tensor, weight: Tensor, bias: Tensor | None = None,
                    dim: int | None = None, *, group: ProcessGroup | None = None,
                    sequence: str | None = None) -> Tensor:
    """`F.linear` with a column- (dim=1 / -1) or row-parallel (dim=0) weight shard.

    Column: the input is used whole (its gradient is all-reduced); the output holds this
    rank's ``out / tp`` features and is tagged parallel dim -1. Row: an input tagged -1 / 1
    is taken as this rank's ``in / tp`` features, an untagged one of width ``in`` is split
    first; partial products are all-reduced and the full bias is added once, after the sum.

    `sequence` (sequence parallelism, input / output ``(*, T, C)``):

        sequence     layer    input                           output
        "gathered"   column   (*, T, in), all-gathered by     as without
                              its region (whose backward
                              reduce-scatters the gradient)
        "gather"     column   (*, T / tp, in): all-gathered   as without
                              along T here
        "scatter"    row      as without                      (*, T / tp, out) tagged SEQUENCE:
                                                              reduce-scattered along T, + bias
    """
    check_parallel_dim(dim, "parallel_linear")
    if sequence not in SEQUENCE_MODES or (sequence is not None and (dim in _COLUMN) != (
            sequence in ("gathered", "gather"))):
        raise ValueError(f"parallel_linear(sequence={sequence!r}) with dim={dim}: 'gathered' "
                         "and 'gather' are column modes (dim=-1), 'scatter' a row mode (dim=0)")
    if weight.dim() != 2:
        raise ValueError(f"weight must be two-dimensional, got a {weight.dim()}D tensor")
    if dim is None:
        return F.linear(input, weight, bias)
    g = _group(dim, group)
    tp = group_size(g)
    tag = get_parallel_dim(input)
    width = input.shape[-1] if input.dim() > 0 else 0
    if dim in _COLUMN:
        if sequence == "gather":
            width = input.shape[-1]
        if width != weight.shape[1]:
            hint = (" (the input is tagged as sharded on its last dim: a column-parallel layer "
                    "needs the full features; use dim=0 to consume a sharded input)"
                    if tag in _COLUMN else "")
            raise ValueError(f"column-parallel linear expects input width (in_features) "
                             f"{weight.shape[1]}, got {width}{hint}")
        if sequence == "gather":                                     # (*, T / tp, in)
            input = gather_grad_scatter(input, g, dim=-2)            # (*, T, in)
        elif sequence is None:
            input = copy_to_group(input, g)                          # backward: all-reduce
        output = F.linear(input, weight, bias)                       # (*, out / tp)
        register_parallel_dim(output, -1)
        return output
    # row-parallel: y = sum over ranks of x_r @ W_r^T, then + b
    if tag in _COLUMN:
        if width != weight.shape[1]:
            raise ValueError(f"row-parallel linear expects an input tagged as sharded of width "
                             f"in_features / tp = {weight.shape[1]}, got {width}")
        local = input                                                # (*, in / tp)
    else:
        if width != weight.shape[1] * tp:
            raise ValueError(f"row-parallel linear expects an untagged input of width "
                             f"in_features = {weight.shape[1] * tp} (or one tagged as sharded "
                             f"of width {weight.shape[1]}), got {width}")
        local = scatter_to_group(input, g, dim=-1)                   # (*, in / tp)
    if sequence == "scatter":                                        # (*, T / tp, out)
        output = reduce_scatter_group(F.linear(local, weight), g, dim=-2)
    else:
        output = reduce_from_group(F.linear(local, weight), g)       # (*, out)
    if bias is not None:
        output = output + bias
    register_parallel_dim(output, SEQUENCE if sequence == "scatter" else None)
    return output


# embedding ----------------------------------------------------------------------------------

class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by `scale` (broadcast) in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: Tensor) -> Tensor:
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (scale,) = ctx.saved_tensors
        return grad * scale, None


def _vocab_parallel_embedding(input: Tensor, weight: Tensor, padding_idx: int | None,
                              max_norm: float | None, norm_type: float,
                              scale_grad_by_freq: bool, sparse: bool,
                              num_embeddings: int | None, group: ProcessGroup | None, *,
                              sequence: bool = False) -> Tensor:
    """Rows [start, stop) of the table live here; every rank sees all ids.

        ids     3  7  0  9        (vocabulary 10 over 4 ranks: rows 0-2 | 3-5 | 6-7 | 8-9)
        rank 1  3  .  .  .   ->  look up id - 3 where owned, zero elsewhere
        sum     e3 e7 e0 e9  <-  all-reduce: exactly one rank contributes to each position

    Everything torch does to a row (max_norm, padding_idx, scale_grad_by_freq) is applied
    by the owning rank only, with the counts of the full ids, so the result is the one-device
    result exactly.
    """
    tp, rank = group_size(group), group_rank(group)
    if num_embeddings is None:
        if tp > 1:
            raise ValueError("vocab-parallel embedding (dim=0) needs num_embeddings= (the full "
                             "vocabulary size) to know which rows this rank holds")
        num_embeddings = weight.shape[0]
    start, stop = shard_range(num_embeddings, tp, rank)
    if weight.shape[0] != stop - start:
        raise ValueError(f"rank {rank} of {tp} holds rows [{start}, {stop}) of a vocabulary of "
                         f"{num_embeddings}, but its weight has {weight.shape[0]} rows; pass the "
                         f"full vocabulary size as num_embeddings=")
    if padding_idx is not None and padding_idx < 0:
        padding_idx += num_embeddings
    local_pad = padding_idx - start if padding_idx is not None and \
        start <= padding_idx < stop else None
    owned = (input >= start) & (input < stop)                        # (*) bool
    local_ids = torch.where(owned, input - start, torch.zeros_like(input))
    if max_norm is not None:  # as F.embedding does, but only for the rows really looked up
        with torch.no_grad():
            torch.embedding_renorm_(weight, local_ids[owned].contiguous(), max_norm, norm_type)
    output = F.embedding(local_ids, weight, local_pad, None, norm_type, False, sparse)
    if scale_grad_by_freq:  # 1 / count of each id in the whole input, as torch's backward
        _, inverse, counts = torch.unique(input, return_inverse=True, return_counts=True)
        scale = (1.0 / counts.to(output.dtype))[inverse].unsqueeze(-1)  # (*, 1)
        output = _ScaleGrad.apply(output, scale)
    output = output.masked_fill(~owned.unsqueeze(-1), 0.0)          # (*, D) this rank's part
    if sequence:                                                    # (*, T / tp, D) summed
        return reduce_scatter_group(output, group, dim=-2)
    return reduce_from_group(output, group)                         # (*, D) full


@torch.no_grad()
def _renorm_feature_shard(weight: Tensor, input: Tensor, max_norm: float, norm_type: float,
                          group: ProcessGroup | None) -> None:
    """`torch.embedding_renorm_` on a table sharded by features: each looked-up row whose
    full norm (its shards' p-norms combined over tp) exceeds `max_norm` is scaled in place."""
    rows = torch.unique(input.reshape(-1))
    partial = weight[rows].abs().pow(norm_type).sum(dim=-1)            # (R,) this shard's
    _all_reduce_sum(partial, group)
    norms = partial.pow(1.0 / norm_type)
    scale = torch.where(norms > max_norm, max_norm / (norms + 1e-7), torch.ones_like(norms))
    weight[rows] *= scale.unsqueeze(-1).to(weight.dtype)


def _all_reduce_sum(x: Tensor, group: ProcessGroup | None) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)


def parallel_embedding(input: Tensor, weight: Tensor, padding_idx: int | None = None,
                       max_norm: float | None = None, norm_type: float = 2.0,
                       scale_grad_by_freq: bool = False, sparse: bool = False,
                       num_embeddings: int | None = None, dim: int | None = None, *,
                       embedding_dim: int | None = None,
                       group: ProcessGroup | None = None, sequence: bool = False) -> Tensor:
    """`F.embedding` over a vocab-sharded (dim=0) or feature-sharded (dim=1 / -1) table.

    dim=0: `weight` holds rows ``shard_range(num_embeddings, tp, rank)`` of the full table;
    `num_embeddings` is the full vocabulary (required when tp > 1). With `sequence` (dim=0,
    ids (*, T)) the ranks' parts are reduce-scattered along T instead of all-reduced: this
    rank's (*, T / tp, D) tokens, tagged `SEQUENCE` (sequence parallelism). dim=1 / -1: `weight`
    holds this rank's columns; the output is all-gathered to the full ``embedding_dim``
    (pass `embedding_dim` when it does not divide evenly over tp). Ids outside the
    vocabulary are not checked in the vocab-parallel mode (they embed to zeros).
    """
    check_parallel_dim(dim, "parallel_embedding")
    if weight.dim() != 2:
        raise ValueError(f"weight must be two-dimensional, got a {weight.dim()}D tensor")
    if dim is None:
        return F.embedding(input, weight, padding_idx, max_norm, norm_type,
                           scale_grad_by_freq, sparse)
    g = _group(dim, group)
    if sequence and dim != 0:
        raise ValueError(f"parallel_embedding(sequence=True) needs the vocab-parallel table "
                         f"(dim=0), got dim={dim}")
    if dim == 0:
        output = _vocab_parallel_embedding(input, weight, padding_idx, max_norm, norm_type,
                                           scale_grad_by_freq, sparse, num_embeddings, g,
                                           sequence=sequence)
        if sequence:
            register_parallel_dim(output, SEQUENCE)
            return output
    else:
        if max_norm is not None:   # renormalize by the rows' full norms, as F.embedding
            _renorm_feature_shard(weight, input, max_norm, norm_type, g)
        output = F.embedding(input, weight, padding_idx, None, norm_type,
                             scale_grad_by_freq, sparse)             # (*, D_r)
        output = gather_from_group(output, g, dim=-1, length=embedding_dim)  # (*, D)
    register_parallel_dim(output, None)
    return output
