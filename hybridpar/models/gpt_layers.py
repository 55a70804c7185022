"""The layers of `gpt`: embeddings, attention, MLP, block, head (pictured in `models.gpt`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.moe import MoE, empty_stats
from hybridpar.moe.carry import head_output, join_carry, split_carry
from hybridpar.packing import document_mask, split_positions
from hybridpar.recompute import recompute_core
from hybridpar.sharded.attrs import (
    SEQUENCE,
    get_parallel_dim,
    register_parallel_dim,
    register_partial_grad,
)
from hybridpar.sharded.mappings import (
    copy_to_group,
    gather_grad_scatter,
    group_rank,
    group_size,
    reduce_scatter_group,
    shard_range,
)
from hybridpar.tensor_parallel.functional import parallel_embedding
from hybridpar.tensor_parallel.layers import ParallelEmbedding, ParallelLinear, RegisterParallelDim
from hybridpar.tensor_parallel.random import ParallelDropout
from hybridpar.topology import default_tp_group

__all__ = [
    "MLP",
    "Block",
    "CausalSelfAttention",
    "Embeddings",
    "Head",
    "SequenceLayerNorm",
]


def _dims(tp: int | None) -> tuple[int | None, int | None, int | None]:
    """(column dim, row dim, vocab dim) of the layers: -1, 0, 0 when sharded, else None."""
    return (-1, 0, 0) if tp is not None and tp > 1 else (None, None, None)



class Embeddings(nn.Module):
    """Token (vocab-parallel) plus learned position embeddings, then dropout: ids -> (B, T, C).

    (ids, positions) -> ((B, T, C), positions): packed documents, positions given."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, *, dropout: float = 0.0,
                 tp: int | None = None, group: ProcessGroup | None = None,
                 sequence_parallel: bool = False, n_experts: int = 0) -> None:
        super().__init__()
        self.block_size, self.n_experts = block_size, n_experts
        self.tok = ParallelEmbedding(vocab_size, n_embd, dim=_dims(tp)[2], group=group)
        self.pos = nn.Embedding(block_size, n_embd)   # replicated: small, read by every rank
        self.drop = ParallelDropout(dropout, group=group)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:   # each rank looks up its own positions: a part of the gradient
            register_partial_grad(self.pos.weight)

    def forward(self, idx: Tensor | tuple[Tensor, Tensor]) -> Tensor | tuple[Tensor, ...]:
        ids, positions = split_positions(idx)
        x = self._embed(ids, positions)
        if not self.n_experts:
            return x if positions is None else (x, positions)
        stats = empty_stats(self.n_experts, device=ids.device)   # the routing sums start
        return join_carry(x, positions, stats)

    def _embed(self, ids: Tensor, positions: Tensor | None) -> Tensor:
        T = ids.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size "
                             f"{self.block_size}; crop the input to its last "
                             f"{self.block_size} tokens or build gpt(block_size={T})")
        if positions is not None:                                # packed: (B, T), restarting
            if self.sequence_parallel:
                raise ValueError("gpt(sequence_parallel=True) does not take packed documents "
                                 "(ids, positions) yet; turn sequence parallelism off for them")
            return self.drop(self.tok(ids) + self.pos(positions))
        if self.sequence_parallel:
            return self.drop(self._sequence_shard(ids))          # (B, T / tp, C)
        pos = torch.arange(T, device=ids.device)                 # (T,)
        x = self.tok(ids) + self.pos(pos)                        # (B, T, C)
        return self.drop(x)

    def _sequence_shard(self, ids: Tensor) -> Tensor:
        """This rank's tokens of the embedding, (B, T / tp, C) tagged `SEQUENCE`."""
        group = self.tok.group if self.tok.group is not None else default_tp_group()
        tp, T = group_size(group), ids.shape[1]
        if T % tp:
            raise ValueError(f"sequence parallelism splits the {T} tokens of a sequence over "
                             f"tp={tp} ranks; use a sequence length divisible by {tp}")
        x = parallel_embedding(ids, self.tok.weight, num_embeddings=self.tok.num_embeddings,
                               dim=0, group=group, sequence=True)            # (B, T / tp, C)
        start, stop = shard_range(T, tp, group_rank(group))
        x = x + self.pos(torch.arange(start, stop, device=ids.device))       # this rank's
        register_parallel_dim(x, SEQUENCE)
        return x


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention; each tp rank owns ``n_head / tp`` whole heads."""

    def __init__(self, n_embd: int, n_head: int, *, dropout: float = 0.0,
                 tp: int | None = None, group: ProcessGroup | None = None,
                 bias: bool = True, sequence_parallel: bool = False) -> None:
        super().__init__()
        col, row, _ = _dims(tp)
        self.sharded = col is not None
        self.sequence_parallel = sequence_parallel
        self.heads = n_head // (tp or 1)                         # heads on this rank
        self.head_dim = n_embd // n_head
        self.q = ParallelLinear(n_embd, n_embd, bias, dim=col, group=group)
        self.k = ParallelLinear(n_embd, n_embd, bias, dim=col, group=group)
        self.v = ParallelLinear(n_embd, n_embd, bias, dim=col, group=group)
        self.proj = ParallelLinear(n_embd, n_embd, bias, dim=row, group=group)
        self.attn_drop = ParallelDropout(dropout, group=group)
        self.resid_drop = ParallelDropout(dropout, group=group)

    def _heads(self, x: Tensor, B: int, T: int) -> Tensor:
        return x.view(B, T, self.heads, self.head_dim).transpose(1, 2)   # (B, h, T, hd)

    def _drop_attention(self, att: Tensor) -> Tensor:
        """Dropout on the probabilities with the one-device mask of the full (B, H, T, T).

        The heads are the sharded dim; `ParallelDropout` slices its mask on the last dim, so
        the heads go last (contiguous, on one device too, so both draw the same layout).
        """
        att = att.permute(0, 2, 3, 1).contiguous()              # (B, T, T, h)
        if self.sharded:
            register_parallel_dim(att, -1)
        att = self.attn_drop(att)
        return att.permute(0, 3, 1, 2)                          # (B, h, T, T)

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v (B, T, C / tp): column-parallel, sharing one copy of the input.

        Each column-parallel layer would all-reduce its input gradient in backward; one copy
        for the three makes that a single all-reduce of their summed gradient (Megatron's
        fused qkv), with the same numbers.
        """
        if not self.sharded:
            return self.q(x), self.k(x), self.v(x)
        group = self.q.group if self.q.group is not None else default_tp_group()
        if self.sequence_parallel:                              # (B, T / tp, C) -> (B, T, C)
            x = gather_grad_scatter(x, group, dim=-2)           # backward: reduce-scatter
        else:
            x = copy_to_group(x, group)                         # backward: one all-reduce
        q, k, v = (F.linear(x, m.weight, m.bias) for m in (self.q, self.k, self.v))
        return q, k, v

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """`mask`: None (causal), or (B, 1, T, T) bool, True where a query may attend a key.
        Sequence parallel: x and the output are (B, T / tp, C) tagged `SEQUENCE`."""
        q, k, v = self._qkv(x)                                   # (B, T, C / tp) each
        B, T, _ = q.shape
        q, k, v = (self._heads(t, B, T) for t in (q, k, v))      # (B, h, T, hd), h = H / tp
        # checkpoint = "selective": the explicit core (attention dropout: it keeps the
        # (B, h, T, T) probabilities) recomputed in backward, q, k, v kept; the fused one
        # keeps no probabilities, nothing to gain
        explicit = self.training and self.attn_drop.p > 0
        y = recompute_core(self._core, q, k, v, mask) if explicit else \
            self._core(q, k, v, mask)                            # (B, h, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.heads * self.head_dim)   # (B, T, C / tp)
        if self.sequence_parallel:
            return self.resid_drop(_row_to_sequence(y, self.proj))       # (B, T / tp, C)
        if self.sharded:
            register_parallel_dim(y, -1)                        # this rank's heads' columns
        return self.resid_drop(self.proj(y))                    # (B, T, C)

    def _core(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """softmax(q kᵀ / √hd) v with the attention dropout: (B, h, T, hd) each."""
        T = q.shape[2]
        if self.training and self.attn_drop.p > 0:
            # explicit: scaled_dot_product_attention's dropout cannot reproduce the masks
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))  # (B, h, T, T)
            allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril() \
                if mask is None else mask
            att = att.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
            return self._drop_attention(att) @ v                # (B, h, T, hd)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class MLP(nn.Module):
    """Column-parallel (C -> 4C) -> GELU -> row-parallel (4C -> C) -> dropout."""

    def __init__(self, n_embd: int, *, dropout: float = 0.0, tp: int | None = None,
                 group: ProcessGroup | None = None, bias: bool = True,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        col, row, _ = _dims(tp)
        self.fc = ParallelLinear(n_embd, 4 * n_embd, bias, dim=col, group=group)
        self.act = nn.GELU()
        self.tag = RegisterParallelDim(col)                     # GELU drops the tag
        self.proj = ParallelLinear(4 * n_embd, n_embd, bias, dim=row, group=group)
        self.drop = ParallelDropout(dropout, group=group)
        self.sequence_parallel = sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:                              # (B, T / tp, C) in and out
            group = self.fc.group if self.fc.group is not None else default_tp_group()
            x = gather_grad_scatter(x, group, dim=-2)           # (B, T, C)
            h = self.act(F.linear(x, self.fc.weight, self.fc.bias))      # (B, T, 4C / tp)
            return self.drop(_row_to_sequence(h, self.proj))    # (B, T / tp, C)
        h = self.tag(self.act(self.fc(x)))                      # (B, T, 4C / tp)
        return self.drop(self.proj(h))                          # (B, T, C)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``.

    Given (x, positions) (packed documents) it attends inside each document and returns
    (x, positions), or x alone when `keep_positions` is False (the model's last block)."""

    keep_positions: bool = True

    def __init__(self, n_embd: int, n_head: int, *, dropout: float = 0.0,
                 tp: int | None = None, group: ProcessGroup | None = None,
                 bias: bool = True, sequence_parallel: bool = False,
                 moe: MoE | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout=dropout, tp=tp, group=group,
                                        bias=bias, sequence_parallel=sequence_parallel)
        self.ln2 = nn.LayerNorm(n_embd, bias=bias)
        dense = None if moe is not None else MLP(n_embd, dropout=dropout, tp=tp, group=group,
                                                 bias=bias, sequence_parallel=sequence_parallel)
        self.mlp: nn.Module = dense or moe or nn.Identity()   # one of the two is given
        self.moe = moe is not None
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:   # the norms and the row-parallel biases see this rank's
            # tokens only: partial gradients, summed over tp
            assert dense is not None                            # gpt refuses sp with experts
            biases = [b for b in (self.attn.proj.bias, dense.proj.bias) if b is not None]
            for p in (*self.ln1.parameters(), *self.ln2.parameters(), *biases):
                register_partial_grad(p)

    def forward(self, x: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        h, positions, stats = split_carry(x, self.moe)
        if positions is not None and self.sequence_parallel:
            raise ValueError("gpt(sequence_parallel=True) does not take packed documents yet")
        mask = None if positions is None else document_mask(positions)   # packed documents
        h = h + self.attn(self.ln1(h), mask)                    # (B, T, C)
        if self.moe:                                            # + this layer's routing sums
            out, stats = self.mlp(self.ln2(h), stats)
            h = h + out                                         # (B, T, C)
        else:
            h = h + self.mlp(self.ln2(h))                       # (B, T, C)
        if self.sequence_parallel:                              # (B, T / tp, C): the sum
            register_parallel_dim(h, SEQUENCE)                  # lost the tag
        return join_carry(h, positions if self.keep_positions else None, stats)


class Head(nn.Module):
    """The language-model head: (B, T, C) -> logits (B, T, V / tp), tagged -1 when sharded."""

    def __init__(self, n_embd: int, vocab_size: int, *, tp: int | None = None,
                 group: ProcessGroup | None = None, sequence_parallel: bool = False,
                 balance_coef: float = 0.0, z_loss_coef: float = 0.0) -> None:
        super().__init__()
        self.proj = ParallelLinear(n_embd, vocab_size, False, dim=_dims(tp)[0], group=group)
        self.sequence_parallel, self.balance_coef = sequence_parallel, balance_coef
        self.z_loss_coef = z_loss_coef

    def forward(self, x: Tensor | tuple[Tensor, Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        """(B, T, C) -> logits; (x, stats) of an MoE GPT -> (logits, aux) in training."""
        if isinstance(x, tuple):
            return head_output(self._logits(x[0]), x[1], self.balance_coef, self.training,
                               z_coef=self.z_loss_coef)
        return self._logits(x)

    def _logits(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:                              # (B, T / tp, C) -> (B, T, C)
            group = self.proj.group if self.proj.group is not None else default_tp_group()
            logits = F.linear(gather_grad_scatter(x, group, dim=-2), self.proj.weight)
            register_parallel_dim(logits, -1)
            return logits                                       # (B, T, V / tp)
        return self.proj(x)                                     # (B, T, V / tp)


class SequenceLayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` whose output keeps the input's parallel tag (a sequence shard stays
    one across a stage boundary)."""

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        register_parallel_dim(out, get_parallel_dim(x))
        return out


def _row_to_sequence(x: Tensor, layer: ParallelLinear) -> Tensor:
    """A row-parallel `layer` on this rank's features `x` (B, T, in / tp): the partial
    products reduce-scattered along T, then the full bias: (B, T / tp, out) tagged
    `SEQUENCE` (the all-reduce of `parallel_linear`, split in two)."""
    group = layer.group if layer.group is not None else default_tp_group()
    out = reduce_scatter_group(F.linear(x, layer.weight), group, dim=-2)
    if layer.bias is not None:
        out = out + layer.bias
    register_parallel_dim(out, SEQUENCE)
    return out

