"""GPT as an nn.Sequential of tensor-parallel layers (nanoGPT's model, Megatron's sharding).

    layer          tp=None (one device)           tp = n (each rank)
    Embeddings     tok (V, C) + pos (L, C)         tok rows V / n (vocab parallel), pos full
    Block          q, k, v (C, C), proj (C, C)     q, k, v columns C / n: n_head / n whole heads;
                   fc (C, 4C), proj (4C, C)        proj rows C / n, all-reduced (row parallel);
                                                   fc columns 4C / n, proj rows 4C / n
    LayerNorm      (C,)                            (C,) replicated
    Head           (V, C)                          columns V / n: logits (B, T, V / n) tagged -1

(the layers: `hybridpar.models.gpt_layers`; this module assembles and checks them.)

Built under the same ``torch.manual_seed``, ``gpt(tp=n)`` holds on every rank exactly the
slices of ``gpt()``: the parallel layers initialize the full tensors and keep their shard.
Dropout masks are the one-device masks too (`ParallelDropout`, parity=True), so outputs,
losses and gradients match one device in train mode as well. `gpt_loss` takes the sharded
logits without gathering them; `generate` (`hybridpar.models.sampling`) samples from any
callable giving full logits.

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

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.keyed import keyed
from hybridpar.models.gpt_layers import Block, Embeddings, Head, SequenceLayerNorm
from hybridpar.models.gpt_moe import StatsLayerNorm, gpt_moe
from hybridpar.moe import split_aux
from hybridpar.moe.block import check_capacity
from hybridpar.sharded.attrs import get_parallel_dim, register_parallel_dim, register_partial_grad
from hybridpar.sharded.mappings import group_size
from hybridpar.tensor_parallel.loss import ParallelCrossEntropyLoss
from hybridpar.topology import default_ep_group, default_tp_group

__all__ = ["check_gpt_config", "gpt", "gpt_loss"]


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



def _ep_group(ep: int | None, group: ProcessGroup | None, n_experts: int
              ) -> ProcessGroup | None:
    """The ep group the experts shard over (None: unsharded), `ep` checked against it."""
    if ep is None or ep == 1:
        if group is not None:
            raise ValueError("ep_group= is given without ep=; pass ep=<size of the group>")
        return None
    if not n_experts:
        raise ValueError(f"gpt: ep={ep} shards experts, but n_experts=0 (a dense MLP); give "
                         "n_experts or drop ep")
    if n_experts % ep:
        raise ValueError(f"gpt: ep={ep} does not divide n_experts={n_experts}: each ep rank "
                         f"holds n_experts / ep experts; choose ep among "
                         f"{[d for d in _divisors(n_experts) if d > 1]}")
    group = group if group is not None else default_ep_group()
    size = group_size(group)
    if size != ep:
        raise ValueError(f"ep={ep} but the expert-parallel group has {size} ranks; pass "
                         f"ep={size}, or hybridpar.init(ep={ep})")
    return group


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


ROUTERS = ("softmax", "sigmoid")


def check_gpt_config(*, vocab_size: int, block_size: int, n_layer: int, n_head: int,
                     n_embd: int, dropout: float, tp: int | None, n_experts: int = 0,
                     top_k: int = 2, router: str = "softmax", z_loss_coef: float = 0.0,
                     bias_update_rate: float = 0.0, capacity_factor: float | None = None,
                     drop_policy: str = "position") -> None:
    """Raise `ValueError` naming the numbers (and the valid tp sizes) for a bad config."""
    for name, value in (("vocab_size", vocab_size), ("block_size", block_size),
                        ("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"gpt: {name} must be a positive integer, got {value!r}")
    if not isinstance(n_experts, int) or isinstance(n_experts, bool) or n_experts < 0:
        raise ValueError(f"gpt: n_experts must be 0 (a dense MLP) or a positive integer, got "
                         f"{n_experts!r}")
    if n_experts and not 1 <= top_k <= n_experts:
        raise ValueError(f"gpt: top_k={top_k} must be between 1 and n_experts={n_experts}: "
                         "each token goes to top_k distinct experts")
    if router not in ROUTERS:
        raise ValueError(f"gpt: router={router!r} is not one of {', '.join(ROUTERS)}")
    if not z_loss_coef >= 0 or not bias_update_rate >= 0:
        raise ValueError(f"gpt: z_loss_coef={z_loss_coef} and bias_update_rate="
                         f"{bias_update_rate} must be >= 0")
    try:
        check_capacity(capacity_factor, drop_policy)
    except ValueError as e:
        raise ValueError(f"gpt: {e}") from None
    if bias_update_rate and router != "sigmoid":
        raise ValueError(f"gpt: bias_update_rate={bias_update_rate} moves the correction bias "
                         "of the sigmoid router (DeepSeek-V3's aux-loss-free balancing): set "
                         "router = 'sigmoid'")
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
        sequence_parallel: bool = False, n_experts: int = 0, top_k: int = 2,
        expert_hidden: int | None = None, balance_coef: float = 0.01, ep: int | None = None,
        ep_group: ProcessGroup | None = None, router: str = "softmax", z_loss_coef: float = 0.0,
        bias_update_rate: float = 0.0, capacity_factor: float | None = None,
        drop_policy: str = "position") -> nn.Sequential:
    """A GPT as ``nn.Sequential(Embeddings, Block × n_layer, LayerNorm, Head)``.

    Input (B, T) int64 token ids with T <= block_size; output logits (B, T, V), or
    (B, T, V / tp) tagged parallel dim -1 when `tp` > 1. `tp=None` (or 1) builds plain layers
    and needs no `hybridpar.init`; with `tp`, layers shard over `group` (default: the tp group
    of `hybridpar.init`), whose size must be `tp`. A pipeline may split it at any layer.
    With `n_experts` > 0 every block's MLP is a mixture of experts (`models.gpt_moe`: top_k
    of n_experts SwiGLU experts of `expert_hidden` features) and in training the output is
    (logits, the load-balancing loss × `balance_coef` + the router z-loss × `z_loss_coef`),
    which `gpt_loss` adds. `router`: "softmax" (renormalized top-k, Mixtral's) or "sigmoid"
    (DeepSeek-V3's scores with a correction bias, moved by `bias_update_rate` a step:
    `hybridpar.moe.ExpertBiasUpdate`). `capacity_factor`: each expert keeps at most
    ceil(factor · tokens · top_k / n_experts) copies, dropping by `drop_policy` ("position"
    or "probs"; None: dropless). With `ep` > 1 each rank holds n_experts / ep of them,
    over `ep_group` (default: the ep group of `hybridpar.init(ep=...)`).
    """
    check_gpt_config(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer,
                     n_head=n_head, n_embd=n_embd, dropout=dropout, tp=tp,
                     n_experts=n_experts, top_k=top_k, router=router,
                     z_loss_coef=z_loss_coef, bias_update_rate=bias_update_rate,
                     capacity_factor=capacity_factor, drop_policy=drop_policy)
    if sequence_parallel and n_experts:
        raise ValueError("gpt(sequence_parallel=True) does not take experts yet (each tp "
                         "rank would route a part of the tokens); turn one of them off")
    tp = _tp_size(tp, group)
    experts = _ep_group(ep, ep_group, n_experts)
    if sequence_parallel and tp is None:
        raise ValueError("gpt(sequence_parallel=True) shards the sequence over the tp group: "
                         "it needs tp > 1 (or drop sequence_parallel)")
    sp = {"sequence_parallel": sequence_parallel}
    layers: list[nn.Module] = [Embeddings(vocab_size, block_size, n_embd, dropout=dropout,
                                          tp=tp, group=group, n_experts=n_experts, **sp)]
    layers += [Block(n_embd, n_head, dropout=dropout, tp=tp, group=group, bias=bias, **sp,
                     moe=gpt_moe(n_embd, n_experts, top_k, expert_hidden, group=experts,
                                 router=router, bias_rate=bias_update_rate,
                                 capacity_factor=capacity_factor, drop_policy=drop_policy)
                     if n_experts else None)
               for _ in range(n_layer)]
    norm_cls = SequenceLayerNorm if sequence_parallel else \
        StatsLayerNorm if n_experts else nn.LayerNorm
    norm = norm_cls(n_embd, bias=bias)
    if sequence_parallel:
        for p in norm.parameters():
            register_partial_grad(p)
    layers.append(norm)
    layers.append(Head(n_embd, vocab_size, tp=tp, group=group, **sp,
                       balance_coef=balance_coef, z_loss_coef=z_loss_coef))
    return keyed(torch.initial_seed(), nn.Sequential(*layers))


def gpt_loss(output: Tensor | tuple[Tensor, Tensor], targets: Tensor, *,
             group: ProcessGroup | None = None, reduction: str = "mean") -> Tensor:
    """Mean (or with ``reduction="sum"``, summed) cross-entropy of logits (B, T, V) or
    (B, T, V / tp) tagged -1 and targets (B, T); targets of -100 are not counted. Given an
    MoE GPT's (logits, aux), plus the aux loss (already scaled by its coefficient).

    Sharded logits are never gathered (`ParallelCrossEntropyLoss`; `group` defaults to the
    tp group of `hybridpar.init`). Usable as ``HybridPipe(..., loss_fn=gpt_loss)``.
    """
    logits, aux = split_aux(output)
    loss = _cross_entropy(logits, targets, group=group, reduction=reduction)
    return loss if aux is None else loss + aux.sum().to(loss.dtype)


def _cross_entropy(logits: Tensor, targets: Tensor, *, group: ProcessGroup | None,
                   reduction: str) -> Tensor:
    tag = get_parallel_dim(logits)
    flat = logits.reshape(-1, logits.shape[-1])                 # (B * T, V / tp)
    if tag is not None:
        register_parallel_dim(flat, tag)                        # reshape drops the tag
    return ParallelCrossEntropyLoss(group=group, reduction=reduction)(
        flat, targets.reshape(-1))                              # (B * T,) ids

