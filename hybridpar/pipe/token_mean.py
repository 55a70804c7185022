"""A step's loss as the mean over every token it counts: all micro-batches, all replicas.

`HybridPipe` weights each micro-batch's loss by its share of the rows and averages gradients
over dp. With labels some of which are ignored (a loss mask, padding) a micro-batch's mean
is over its own counted tokens, so that would be a mean of means. Inside
``TokenMean.over(targets)`` each micro-batch's loss is rescaled so that the step's loss and
every gradient are the sum over the counted tokens of the whole global batch divided by
their number, as Hugging Face's Trainer with ``average_tokens_across_devices=True``:

    micro-batch i of replica r returns   sum_ri / N * dp * rows / rows_i
    the pipe weights it by               rows_i / rows, adds over i, averages over r
    so the step's loss is                sum over r, i of sum_ri / N
                                         N = the counted tokens of every replica (all-reduced)

`loss_sum(output, target)` must return the SUM of the per-token losses over the tokens whose
target is not `ignore_index` (0 when there is none); ``gpt_loss(..., reduction="sum")`` and
``next_token_loss(..., reduction="sum")`` do. Outside `over` the loss is the micro-batch's
own token mean. An MoE model's aux loss ((logits, aux), `hybridpar.moe.split_aux`) is added
to each micro-batch's share unscaled: per micro-batch, as gradient accumulation adds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar.moe import split_aux

__all__ = ["TokenMean"]


class TokenMean:
    """``loss_fn`` for `HybridPipe` whose step loss is the global token mean (see above)."""

    def __init__(self, loss_sum: Callable[[Tensor, Tensor], Tensor], *,
                 ignore_index: int = -100) -> None:
        self.loss_sum, self.ignore_index = loss_sum, ignore_index
        self._step: tuple[int, Tensor, int] | None = None      # rows, N, dp

    def counted(self, target: Tensor) -> Tensor:
        """The tokens of `target` the loss counts: a 0-dim int64 tensor on its device."""
        return (target != self.ignore_index).sum()

    def __call__(self, output: Tensor | tuple[Tensor, Tensor], target: Tensor) -> Tensor:
        logits, aux = split_aux(output)   # an MoE model's aux loss: a micro-batch's own
        total = self.loss_sum(logits, target)
        if self._step is None:
            mean = total / self.counted(target).to(total.device, total.dtype).clamp(min=1)
        else:
            rows, tokens, replicas = self._step
            mean = total / tokens.to(total.device, total.dtype) * (
                replicas * rows / target.shape[0])
        return mean if aux is None else mean + aux.sum().to(mean.dtype)

    @contextmanager
    def over(self, targets: Tensor, *, group: ProcessGroup | None = None,
             device: torch.device | None = None) -> Iterator[TokenMean]:
        """Inside: micro-batch losses that add up to the token mean of the global batch.

        `targets`: this replica's whole batch of targets, as passed to ``train_step``.
        `group`: the dp group, on the ranks that compute the loss (every rank of a dp group
        holds the same stage, so all or none of them pass it): their counts are summed over
        it, on `device` (the pipe's: NCCL reduces device tensors). Elsewhere no loss is
        computed and nothing is exchanged.
        """
        tokens = self.counted(targets).to(device or targets.device)
        replicas = 1
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(tokens, group=group)
            replicas = dist.get_world_size(group)
        previous = self._step
        self._step = (targets.shape[0], tokens.clamp(min=1), replicas)
        try:
            yield self
        finally:
            self._step = previous
