"""GPT as an nn.Sequential of tensor-parallel layers (nanoGPT's model, Megatron's sharding).

    layer          tp=None (one device)           tp = n (each rank)
    Embeddings     tok (V, C) + pos (L, C)         tok rows V / n (vocab parallel), pos full
    Block          q, k, v (C, C), proj (C, C)     q, k, v columns C / n: n_head / n whole heads;
                   fc (C, 4C), proj (4C, C)        proj rows C / n, all-reduced (row parallel);
                                                   fc columns 4C / n, proj rows 4C / n
    LayerNorm      (C,)                            (C,) replicated
    Head           (V, C)                          columns V / n: logits (B, T, V / n) tagged -1

Built under the same ``torch.manual_seed``, ``gpt(tp=n)`` holds on every rank exactly the
slices of ``gpt()``: the parallel layers initialize the full tensors and keep their shard.
Dropout masks are the one-device masks too (`ParallelDropout`, parity=True), so outputs,
losses and gradients match one device in train mode as well. `gpt_loss` takes the sharded
logits without gathering them; `generate` samples from any callable giving full logits.

With ``sequence_parallel=True`` (tp > 1, Megatron's sequence parallelism) the activations
between the blocks' tensor-parallel regions are sharded on the sequence, (B, T / tp, C)
tagged `SEQUENCE`: the LayerNorms, dropouts and residual adds run on 1 / tp of the tokens,
each column-parallel input is all-gathered along T (its gradient reduce-scattered) and each
row-parallel output reduce-scattered along T (its gradient all-gathered) instead of
all-reduced; the embedding reduce-scatters its vocab-parallel parts and the head gathers
before its column-parallel projection. The LayerNorm weights, the row-parallel biases and the
position table see 1 / tp of the tokens on each rank: their gradients are summed over tp
(`register_partial_grad`).

Packed documents (`hybridpar.packing`): given (ids, positions) instead of ids, `Embeddings`
reads the positions from there and returns (x, positions), each `Block` attends inside each
document (block-diagonal causal mask) and passes (x, positions) on, but the last one
(``keep_positions = False``, set by `hybridpar.models.packing.pack_documents`) returns x
alone for the final LayerNorm and the head. Given ids alone, every layer is as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.keyed import keyed
from hybridpar.packing import document_mask, split_positions
from hybridpar.recompute import recompute_core
from hybridpar.sharded.attrs import (
    SEQUENCE,
    get_parallel_dim,
    register_parallel_dim,
    register_partial_grad,
)
from hybridpar.sharded.mappings import (
    all_gather_along,
    copy_to_group,
    gather_grad_scatter,
    group_rank,
    group_size,
    reduce_scatter_group,
    shard_range,
)
from hybridpar.tensor_parallel.functional import parallel_embedding
from hybridpar.tensor_parallel.layers import ParallelEmbedding, ParallelLinear, RegisterParallelDim
from hybridpar.tensor_parallel.loss import ParallelCrossEntropyLoss
from hybridpar.tensor_parallel.random import ParallelDropout
from hybridpar.topology import default_tp_group

__all__ = [
    "MLP",
    "Block",
    "CausalSelfAttention",
    "Embeddings",
    "Head",
    "SequenceLayerNorm",
    "check_gpt_config",
    "generate",
    "gpt",
    "gpt_loss",
]


def _dims(tp: int | None) -> tuple[int | None, int | None, int | None]:
    """(column dim, row dim, vocab dim) of the layers: -1, 0, 0 when sharded, else None."""
    return (-1, 0, 0) if tp is not None and tp > 1 else (None, None, None)


def _tp_size(tp: int | None, group: ProcessGroup | None) -> int | None:
    """`tp` checked against `group` (default: hybridpar.init's); None when not sharded."""
    if tp is None:
        if group is not None:
            raise ValueError("group= is given without tp=; pass tp=<size of the group> "
                             "to shard the model, or drop group= for a one-device model")
        return None
    if tp == 1:
        return None
    size = group_size(group if group is not None else default_tp_group())
    if size != tp:
        raise ValueError(f"tp={tp} but the tensor-parallel group has {size} ranks; pass "
                         f"tp={size}, or hybridpar.init(tp={tp}) / a group of {tp} ranks")
    return tp


class Embeddings(nn.Module):
    """Token (vocab-parallel) plus learned position embeddings, then dropout: ids -> (B, T, C).

    (ids, positions) -> ((B, T, C), positions): packed documents, positions given."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, *, dropout: float = 0.0,
                 tp: int | None = None, group: ProcessGroup | None = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        self.block_size = block_size
        self.tok = ParallelEmbedding(vocab_size, n_embd, dim=_dims(tp)[2], group=group)
        self.pos = nn.Embedding(block_size, n_embd)   # replicated: small, read by every rank
        self.drop = ParallelDropout(dropout, group=group)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:   # each rank looks up its own positions: a part of the gradient
            register_partial_grad(self.pos.weight)

    def forward(self, idx: Tensor | tuple[Tensor, Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        ids, positions = split_positions(idx)
        T = ids.shape[1]
        if T > self.block_size:
            raise ValueError(f"sequence of length {T} is longer than block_size "
                             f"{self.block_size}; crop the input to its last "
                             f"{self.block_size} tokens or build gpt(block_size={T})")
        if positions is not None:                                # packed: (B, T), restarting
            if self.sequence_parallel:
                raise ValueError("gpt(sequence_parallel=True) does not take packed documents "
                                 "(ids, positions) yet; turn sequence parallelism off for them")
            return self.drop(self.tok(ids) + self.pos(positions)), positions
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
                 bias: bool = True, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout=dropout, tp=tp, group=group,
                                        bias=bias, sequence_parallel=sequence_parallel)
        self.ln2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout=dropout, tp=tp, group=group, bias=bias,
                       sequence_parallel=sequence_parallel)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:   # the norms and the row-parallel biases see this rank's
            # tokens only: partial gradients, summed over tp
            biases = [b for b in (self.attn.proj.bias, self.mlp.proj.bias) if b is not None]
            for p in (*self.ln1.parameters(), *self.ln2.parameters(), *biases):
                register_partial_grad(p)

    def forward(self, x: Tensor | tuple[Tensor, Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        h, positions = split_positions(x)
        if positions is not None and self.sequence_parallel:
            raise ValueError("gpt(sequence_parallel=True) does not take packed documents yet")
        if positions is not None:                               # packed documents
            h = h + self.attn(self.ln1(h), document_mask(positions))    # (B, T, C)
            h = h + self.mlp(self.ln2(h))                       # (B, T, C)
            return (h, positions) if self.keep_positions else h
        h = h + self.attn(self.ln1(h))                          # (B, T, C)
        h = h + self.mlp(self.ln2(h))                           # (B, T, C)
        if self.sequence_parallel:                              # (B, T / tp, C): the sum
            register_parallel_dim(h, SEQUENCE)                  # lost the tag
        return h


class Head(nn.Module):
    """The language-model head: (B, T, C) -> logits (B, T, V / tp), tagged -1 when sharded."""

    def __init__(self, n_embd: int, vocab_size: int, *, tp: int | None = None,
                 group: ProcessGroup | None = None, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.proj = ParallelLinear(n_embd, vocab_size, False, dim=_dims(tp)[0], group=group)
        self.sequence_parallel = sequence_parallel

    def forward(self, x: Tensor) -> Tensor:
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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_gpt_config(*, vocab_size: int, block_size: int, n_layer: int, n_head: int,
                     n_embd: int, dropout: float, tp: int | None) -> None:
    """Raise `ValueError` naming the numbers (and the valid tp sizes) for a bad config."""
    for name, value in (("vocab_size", vocab_size), ("block_size", block_size),
                        ("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"gpt: {name} must be a positive integer, got {value!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"gpt: dropout must be in [0, 1), got {dropout}")
    if n_embd % n_head != 0:
        raise ValueError(f"gpt: n_embd={n_embd} is not divisible by n_head={n_head}; choose "
                         f"n_head among {_divisors(n_embd)}")
    if tp is not None and (not isinstance(tp, int) or isinstance(tp, bool) or tp < 1):
        raise ValueError(f"gpt: tp must be a positive integer or None, got {tp!r}")
    if tp is None or tp == 1:
        return
    valid = [d for d in _divisors(n_head) if (4 * n_embd) % d == 0 and vocab_size % d == 0]
    for name, value in (("n_head", n_head), ("4 * n_embd", 4 * n_embd),
                        ("vocab_size", vocab_size)):
        if value % tp != 0:
            raise ValueError(
                f"gpt: {name}={value} is not divisible by tp={tp} (each rank holds whole "
                f"heads, 4 * n_embd / tp MLP features and vocab_size / tp logits); valid tp "
                f"sizes for n_head={n_head}, n_embd={n_embd}, vocab_size={vocab_size} are "
                f"{valid}")


def gpt(*, vocab_size: int = 256, block_size: int = 64, n_layer: int = 4, n_head: int = 4,
        n_embd: int = 64, dropout: float = 0.0, tp: int | None = None,
        group: ProcessGroup | None = None, bias: bool = True,
        sequence_parallel: bool = False) -> nn.Sequential:
    """A GPT as ``nn.Sequential(Embeddings, Block × n_layer, LayerNorm, Head)``.

    Input (B, T) int64 token ids with T <= block_size; output logits (B, T, V), or
    (B, T, V / tp) tagged parallel dim -1 when `tp` > 1. `tp=None` (or 1) builds plain layers
    and needs no `hybridpar.init`; with `tp`, layers shard over `group` (default: the tp group
    of `hybridpar.init`), whose size must be `tp`. A pipeline may split it at any layer.
    """
    check_gpt_config(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer,
                     n_head=n_head, n_embd=n_embd, dropout=dropout, tp=tp)
    tp = _tp_size(tp, group)
    if sequence_parallel and tp is None:
        raise ValueError("gpt(sequence_parallel=True) shards the sequence over the tp group: "
                         "it needs tp > 1 (or drop sequence_parallel)")
    sp = {"sequence_parallel": sequence_parallel}
    layers: list[nn.Module] = [Embeddings(vocab_size, block_size, n_embd, dropout=dropout,
                                          tp=tp, group=group, **sp)]
    layers += [Block(n_embd, n_head, dropout=dropout, tp=tp, group=group, bias=bias, **sp)
               for _ in range(n_layer)]
    norm = (SequenceLayerNorm if sequence_parallel else nn.LayerNorm)(n_embd, bias=bias)
    if sequence_parallel:
        for p in norm.parameters():
            register_partial_grad(p)
    layers.append(norm)
    layers.append(Head(n_embd, vocab_size, tp=tp, group=group, **sp))
    return keyed(torch.initial_seed(), nn.Sequential(*layers))


def gpt_loss(logits: Tensor, targets: Tensor, *, group: ProcessGroup | None = None) -> Tensor:
    """Mean cross-entropy of logits (B, T, V) or (B, T, V / tp) tagged -1 and targets (B, T).

    Sharded logits are never gathered (`ParallelCrossEntropyLoss`; `group` defaults to the
    tp group of `hybridpar.init`). Usable as ``HybridPipe(..., loss_fn=gpt_loss)``.
    """
    tag = get_parallel_dim(logits)
    flat = logits.reshape(-1, logits.shape[-1])                 # (B * T, V / tp)
    if tag is not None:
        register_parallel_dim(flat, tag)                        # reshape drops the tag
    return ParallelCrossEntropyLoss(group=group)(flat, targets.reshape(-1))   # (B * T,) ids


def _block_size_of(model: Callable[[Tensor], Tensor]) -> int | None:
    if isinstance(model, nn.Module):
        for sub in model.modules():
            if isinstance(sub, Embeddings):
                return sub.block_size
    return None


@torch.no_grad()
def generate(model: Callable[[Tensor], Tensor], idx: Tensor, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None, block_size: int | None = None,
             group: ProcessGroup | None = None) -> Tensor:
    """Sample `max_new_tokens` tokens after `idx` (B, T); returns (B, T + max_new_tokens).

    `model` is any callable mapping ids (B, t) to logits (B, t, V): a `gpt`, or a
    `HybridPipe`'s forward (full logits on every rank). Logits tagged as vocab-sharded are
    gathered over `group` first. The context is cropped to its last `block_size` tokens
    (default: the model's `Embeddings.block_size` when it holds one, else no crop).
    `temperature` 0 picks the most likely token; `top_k` keeps the k most likely. Given the
    same `generator` state, the same logits give the same tokens (on every rank). The model's
    train / eval mode is left as it is: call ``model.eval()`` to sample without dropout.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be a positive integer or None, got {top_k}")
    if block_size is None:
        block_size = _block_size_of(model)
    for _ in range(max_new_tokens):
        context = idx if block_size is None else idx[:, -block_size:]   # (B, t)
        logits = model(context)                                 # (B, t, V) or (B, t, V / tp)
        if get_parallel_dim(logits) in (-1, 1):
            logits = all_gather_along(logits, -1, group if group is not None
                                      else default_tp_group())  # (B, t, V)
        logits = logits[:, -1, :].float()                       # (B, V)
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)           # (B, 1)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = logits.softmax(dim=-1)                      # (B, V)
            if generator is not None:
                probs = probs.to(generator.device)              # sample where it draws
            nxt = torch.multinomial(probs, 1, generator=generator).to(idx.device)  # (B, 1)
        idx = torch.cat([idx, nxt.to(idx.dtype)], dim=1)        # (B, t + 1)
    return idx
