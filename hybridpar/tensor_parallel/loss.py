"""Vocab-parallel cross-entropy: the loss of class-sharded logits, never gathering them."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed import ProcessGroup
from torch.nn import _reduction

from hybridpar.sharded.attrs import get_parallel_dim
from hybridpar.sharded.mappings import group_rank, group_size
from hybridpar.topology import default_tp_group
from hybridpar.trace import collective

__all__ = ["CausalLMLoss", "ParallelCrossEntropyLoss", "parallel_cross_entropy"]

_REDUCTIONS = ("none", "mean", "sum")


def _is_class_sharded(input: Tensor) -> bool:
    """Whether `input` is tagged as sharded on its last (class) dim: parallel dim -1 or 1."""
    return get_parallel_dim(input) in (-1, 1)


def _classes_last(input: Tensor, target: Tensor) -> bool:
    """Whether untagged `input` (*, C) with class-index `target` (*) is what torch would refuse.

    ``F.cross_entropy`` wants the classes on dim 1 (target ``(N, d1, ...)``); logits of a
    sequence model are ``(B, T, C)`` with target ``(B, T)``, as a class-sharded head leaves
    them at tp > 1. When the shapes fit torch's reading too (C equal to the dim after N), it
    wins: a plain `nn.CrossEntropyLoss` call keeps its meaning.
    """
    return (input.dim() >= 3 and not target.is_floating_point()
            and target.shape == input.shape[:-1]
            and target.shape != (input.shape[0], *input.shape[2:]))


# The sharded algorithm, per row r of logits x (classes c split in contiguous rank-ordered
# slices [start, stop) of width Cl = stop - start; every rank holds the same target row):
#
#   step                                   local work                 communication
#   1  m_r = max_c x_rc                    max of the slice           all-reduce MAX  (R + tp)
#      (fused: each rank's width Cl, so every rank learns C and its start)
#   2  s = x - m                           (R, Cl)                    -
#   3  S_r = Σ_c exp(s_rc)                 sum of the slice ┐
#      z_r = s_r,target                    owner picks it, 0 else ├   all-reduce SUM  (R, 2|3)
#      u_r = Σ_c w_c s_rc  (smoothing)     sum of the slice ┘
#   4  log p_target = z - log S,  nll_r = -w_target · log p_target
#      smooth_r = -Σ_c w_c log p_c = -u_r + log S_r · Σ_c w_c            (torch's definition)
#      loss_r = (1 - ε) nll_r + ε / C · smooth_r,   0 on ignored rows
#
# 'mean' divides Σ_r loss_r by D = Σ_r w_target over the rows not ignored (the row count
# without weights), as torch does for both the nll and the smoothing term. The backward needs
# no communication: with p = exp(s) / S kept from forward,
#
#   ∂loss_r / ∂x_rc = (1 - ε) w_target (p_rc - [c = target]) + ε / C (p_rc Σ_c' w_c' - w_c)
#
# scaled by the incoming gradient (divided by D for 'mean'), and 0 on ignored rows.


def _row_max_and_classes(x: Tensor, n: int, rank: int, group: ProcessGroup | None
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """Step 1: each row's max over all classes, C and this rank's first class, in one MAX
    all-reduce (each rank adds its width); C and the start stay 0-d tensors on the device
    (reading them would synchronise the host)."""
    rows, width = x.shape
    head = x.new_zeros(rows + n)
    if width > 0:
        head[:rows] = x.amax(dim=-1)
    else:  # a rank may hold no class at all (3 classes over 4 ranks)
        head[:rows] = float("-inf")
    head[rows + rank] = width
    if n > 1:
        with collective("all_reduce", head.numel() * head.element_size()):
            dist.all_reduce(head, op=dist.ReduceOp.MAX, group=group)
    widths = head[rows:].round().long()                              # (n,)
    return head[:rows], widths.sum(), widths[:rank].sum()            # (R,), C, start


def _check_targets(t: Tensor, ignored: Tensor, classes: Tensor, ignore_index: int) -> None:
    """A target outside [0, C) that is not ignored: an IndexError on the CPU, a device assert
    on a GPU (no host sync)."""
    if is_fake(t):               # a dry run (`hybridpar check`): no values to look at
        return
    bad = ~ignored & ((t < 0) | (t >= classes))
    if t.device.type == "cpu":   # a clear error where it costs nothing
        if bool(bad.any()):
            raise IndexError(f"Target {int(t[bad][0])} is out of bounds for "
                             f"{int(classes)} classes (ignore_index={ignore_index})")
    else:                        # on a GPU: checked on the device, no host sync
        torch._assert_async(~bad.any(), "a target is out of bounds for the classes of "
                                        "the sharded logits")


def _class_weights(weight: Tensor | None, t: Tensor, ignored: Tensor, classes: Tensor,
                   start: Tensor, width: int, dtype: torch.dtype, device: torch.device
                   ) -> tuple[Tensor, Tensor | None, Tensor]:
    """(w_target (R,), this rank's slice of the class weights (Cl,) or None, their sum)."""
    if weight is None:
        return (~ignored).to(dtype), None, classes.to(dtype)
    if weight.dim() != 1 or (weight.device.type == "cpu" and weight.shape[0] != int(classes)):
        raise ValueError(
            f"weight has shape {tuple(weight.shape)} but the sharded logits have "
            f"{int(classes)} classes in all; give the full ({int(classes)},) class weight on "
            "every rank")
    weight = weight.detach().to(device=device, dtype=dtype)
    w_target = weight[t.masked_fill(ignored, 0)].masked_fill(ignored, 0.0)   # (R,)
    return w_target, weight.narrow(0, start, width), weight.sum()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of logits sharded on the last dim; backward is local."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, weight: Tensor | None,
                ignore_index: int, reduction: str, label_smoothing: float,
                group: ProcessGroup | None) -> Tensor:
        n, rank = group_size(group), group_rank(group)
        width = logits.shape[-1]
        # Half precision is computed in float32 (torch's log_softmax accumulates in float too).
        dtype = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        rows = math.prod(logits.shape[:-1])
        x = logits.detach().reshape(rows, width).to(dtype)          # (R, Cl)
        t = target.reshape(rows).long()                              # (R,)

        row_max, classes, start = _row_max_and_classes(x, n, rank, group)       # 1.
        ignored = t == ignore_index                                  # (R,)
        _check_targets(t, ignored, classes, ignore_index)
        w_target, w_local, w_total = _class_weights(weight, t, ignored, classes, start,
                                                    width, dtype, x.device)

        # 2-3. shifted logits, local sums, the owner's target logit: one SUM all-reduce.
        shifted = x - row_max.unsqueeze(-1)                          # (R, Cl)
        exp = shifted.exp()
        local_t = t - start
        owns = ~ignored & (local_t >= 0) & (local_t < width)
        index = torch.where(owns, local_t, 0).unsqueeze(-1)          # (R, 1)
        picked = shifted.gather(-1, index).squeeze(-1) if width > 0 else x.new_zeros(rows)
        columns = [exp.sum(dim=-1), torch.where(owns, picked, 0.0)]
        if label_smoothing > 0:
            weighted = shifted if w_local is None else shifted * w_local
            columns.append(weighted.sum(dim=-1))
        stats = torch.stack(columns, dim=-1)                         # (R, 2 or 3)
        if n > 1:
            with collective("all_reduce", stats.numel() * stats.element_size()):
                dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        log_sum = stats[:, 0].log()                                  # (R,)

        # 4. the loss of each row, then the reduction.
        loss = -(stats[:, 1] - log_sum) * w_target
        if label_smoothing > 0:
            smooth = -stats[:, 2] + log_sum * w_total
            loss = (1.0 - label_smoothing) * loss + (label_smoothing / classes) * smooth
        loss = torch.where(ignored, 0.0, loss)
        denominator = w_target.sum()
        if reduction == "none":
            out = loss.reshape(target.shape)
        elif reduction == "sum":
            out = loss.sum()
        else:
            out = loss.sum() / denominator

        softmax = exp.div_(stats[:, :1])                             # (R, Cl), in place
        ctx.save_for_backward(softmax, index, owns, ignored, w_target, denominator,
                              w_total, w_local if w_local is not None else x.new_ones(()))
        ctx.smoothing, ctx.classes, ctx.reduction = label_smoothing, classes, reduction
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        # under autocast the loss stays in fp32, as autocast keeps F.cross_entropy's
        return out if torch.is_autocast_enabled(logits.device.type) else out.to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        softmax, index, owns, ignored, w_target, denominator, w_total, w_local = ctx.saved_tensors
        eps, classes = ctx.smoothing, ctx.classes
        rows = softmax.shape[0]
        grad = grad.to(softmax.dtype)
        if ctx.reduction == "none":
            scale = grad.reshape(rows)                               # (R,)
        elif ctx.reduction == "sum":
            scale = grad.expand(rows)
        else:
            scale = (grad / denominator).expand(rows)

        nll = (1.0 - eps) * w_target                                 # (R,)
        # p_c · ((1 - ε) w_target + ε / C · Σ w), minus (1 - ε) w_target at the owned target
        out = softmax * (nll + (eps / classes) * w_total).unsqueeze(-1)
        if softmax.shape[1] > 0:
            out.scatter_add_(-1, index, -(nll * owns).unsqueeze(-1))
        if eps > 0:
            out -= (eps / classes) * w_local                        # w_local is 1 unweighted
        out *= scale.unsqueeze(-1)
        out = torch.where(ignored.unsqueeze(-1), 0.0, out)           # also hides 0 / 0 of D = 0
        return out.reshape(ctx.shape).to(ctx.dtype), None, None, None, None, None, None


def _check_sharded_target(input: Tensor, target: Tensor) -> None:
    if target.is_floating_point():
        raise TypeError(
            "class-sharded logits take class-index targets (an integer tensor); probability "
            "targets are supported only for untagged (replicated) logits"
        )
    if target.shape != input.shape[:-1]:
        raise ValueError(
            f"class-sharded logits of shape {tuple(input.shape)} (classes last, (*, C / tp)) "
            f"need a target of shape {tuple(input.shape[:-1])}, got {tuple(target.shape)}"
        )


def parallel_cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None,
                           size_average: bool | None = None, ignore_index: int = -100,
                           reduce: bool | None = None, reduction: str = "mean",
                           label_smoothing: float = 0.0, *,
                           group: ProcessGroup | None = None) -> Tensor:
    """`F.cross_entropy` that also takes logits sharded over the classes of a tp group.

    Untagged logits: exactly ``F.cross_entropy`` (classes on dim 1, probability targets, any
    shape torch takes); no `hybridpar.init` needed. Untagged ``(*, C)`` logits with a class
    index target ``(*)`` of a shape torch refuses (``(B, T, C)`` and ``(B, T)``) take the
    classes on the LAST dim, as sharded logits do, so the same loss runs at tp=1 with a plain
    head and at tp > 1 with a column-parallel one. Logits tagged with parallel dim -1 (or 1),
    as a column-parallel layer leaves them, are ``(*, C / tp)`` with the classes LAST, each rank
    holding a contiguous slice of the C classes in rank order (uneven slices allowed); the
    target holds class indices of shape ``(*)``, equal on every rank. The result equals
    ``F.cross_entropy(full.reshape(-1, C), target.reshape(-1), ...)`` (reshaped back for
    ``reduction='none'``), and so does the gradient slice; the logits are never gathered.
    `weight` is the full ``(C,)`` class weight on every rank. `group` defaults to the tensor
    parallel group of `hybridpar.init`.
    """
    if not _is_class_sharded(input):
        if not _classes_last(input, target):
            return F.cross_entropy(input, target, weight, size_average, ignore_index, reduce,
                                   reduction, label_smoothing)
        if size_average is not None or reduce is not None:
            reduction = _reduction.legacy_get_string(size_average, reduce)
        out = F.cross_entropy(input.reshape(-1, input.shape[-1]), target.reshape(-1), weight,
                              ignore_index=ignore_index, reduction=reduction,
                              label_smoothing=label_smoothing)            # (R, C) rows
        return out.reshape(target.shape) if reduction == "none" else out
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{reduction} is not a valid value for reduction; "
                         f"use one of {', '.join(_REDUCTIONS)}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
    if input.dim() < 1:
        raise ValueError("class-sharded logits need at least one dim (the classes, last)")
    _check_sharded_target(input, target)
    if group is None:
        group = default_tp_group()
    return _VocabParallelCrossEntropy.apply(input, target, weight, ignore_index, reduction,
                                            float(label_smoothing), group)


class ParallelCrossEntropyLoss(nn.CrossEntropyLoss):
    """`nn.CrossEntropyLoss` that also takes class-sharded logits (see `parallel_cross_entropy`).

    Same arguments as ``nn.CrossEntropyLoss``, plus the keyword-only tp `group` (default: the
    group of `hybridpar.init`, read only when the logits are class-sharded).
    """

    def __init__(self, weight: Tensor | None = None, size_average: bool | None = None,
                 ignore_index: int = -100, reduce: bool | None = None,
                 reduction: str = "mean", label_smoothing: float = 0.0, *,
                 group: ProcessGroup | None = None) -> None:
        super().__init__(weight, size_average, ignore_index, reduce, reduction, label_smoothing)
        self.group = group

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return parallel_cross_entropy(input, target, self.weight, ignore_index=self.ignore_index,
                                      reduction=self.reduction,
                                      label_smoothing=self.label_smoothing, group=self.group)


class CausalLMLoss(nn.Module):
    """Next-token cross-entropy of a causal LM, the same module at every tp size.

    ``loss_fn(logits, labels)``: `logits` ``(B, T, V)``, full or class-sharded ``(B, T, V / tp)``
    (tagged parallel dim -1 by a column-parallel head; never gathered); `labels` ``(B, T)``
    aligned with the input ids as in Hugging Face (``labels=input_ids``): the loss shifts them
    inside, so position t is scored against ``labels[:, t + 1]`` and the last position against
    nothing. Returns the mean over the tokens whose label is not `ignore_index` (0, not NaN,
    when there is none). Half-precision logits are scored in float32. `group`: the tp group
    of sharded logits (default: that of `hybridpar.init`).

    Micro-batches: `HybridPipe` weights each micro-batch's mean by its share of the ROWS, so
    with ignored labels the step's loss (and gradient) equals the token mean of the whole batch
    only when every micro-batch counts the same number of scored tokens. For the exact token
    mean, run the step inside ``loss_fn.token_mean_over(labels)``: each micro-batch then
    returns its token sum divided by the batch's token count (scaled back by its row share),
    and the step's loss is the batch's token mean. With dp > 1 each replica passes its own
    labels, so the result is the mean over replicas of each replica's token mean.
    """

    def __init__(self, ignore_index: int = -100, *, group: ProcessGroup | None = None) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.group = group
        self._batch: tuple[int, Tensor] | None = None        # (rows, scored tokens) of a step

    def forward(self, logits: Tensor, labels: Tensor) -> Tensor:
        if labels.is_floating_point() or labels.dim() < 1 or labels.shape != logits.shape[:-1]:
            raise ValueError(
                f"CausalLMLoss takes logits (B, T, V) and integer labels (B, T) aligned with the "
                f"input ids (it shifts them); got logits {tuple(logits.shape)} and labels "
                f"{labels.dtype} {tuple(labels.shape)}")
        # the target of position t is labels[t + 1]; the last position has none
        target = F.pad(labels[..., 1:], (0, 1), value=self.ignore_index)        # (B, T)
        if _is_class_sharded(logits):
            total = parallel_cross_entropy(logits, target, ignore_index=self.ignore_index,
                                           reduction="sum", group=self.group)
        else:
            x = logits.reshape(-1, logits.shape[-1])                           # (B * T, V)
            if x.dtype in (torch.float16, torch.bfloat16):
                x = x.float()
            total = F.cross_entropy(x, target.reshape(-1), ignore_index=self.ignore_index,
                                    reduction="sum")
        if self._batch is None:
            tokens = (target != self.ignore_index).sum().clamp(min=1)
            return total / tokens
        rows, batch_tokens = self._batch
        # the pipe multiplies by rows_mb / rows: what is left is total / batch_tokens
        return total / batch_tokens.to(total.device).clamp(min=1) * (rows / labels.shape[0])

    @contextmanager
    def token_mean_over(self, labels: Tensor) -> Iterator[CausalLMLoss]:
        """Inside: micro-batch losses that add up to the exact token mean of `labels`' batch.

        `labels` is the whole mini-batch this rank passes to ``train_step`` (``(B, T)``).
        """
        scored = (labels[..., 1:] != self.ignore_index).sum()
        previous, self._batch = self._batch, (labels.shape[0], scored)
        try:
            yield self
        finally:
            self._batch = previous

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}"
