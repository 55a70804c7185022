"""An MLP classifier as an nn.Sequential of column -> row tensor-parallel blocks.

    layer        tp=None (one device)             tp = n (each rank)
    Block 0      fc1 (in, H), fc2 (H, H)           fc1 columns H / n (tag -1), fc2 rows H / n
    Block i      fc1 (H, H),  fc2 (H, H)           the same
    Classifier   (H, out)                          (H, out) replicated

Every block's output is full (fc2 all-reduces), so a pipeline may split it anywhere and the
loss is plain `F.cross_entropy`. Built under the same seed, ``mlp(tp=n)`` holds the slices of
``mlp()``; dropout inside a block acts on the sharded hidden with the one-device mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.keyed import keyed
from hybridpar.sharded.mappings import group_size
from hybridpar.tensor_parallel.layers import ParallelLinear, RegisterParallelDim
from hybridpar.tensor_parallel.random import ParallelDropout
from hybridpar.topology import default_tp_group

__all__ = ["MLPBlock", "mlp", "mlp_loss"]


class MLPBlock(nn.Module):
    """fc1 (column) -> GELU -> re-tag -> dropout -> fc2 (row) -> GELU: (N, in) -> (N, H)."""

    def __init__(self, in_features: int, hidden: int, *, dropout: float = 0.0,
                 tp: int | None = None, group: ProcessGroup | None = None) -> None:
        super().__init__()
        sharded = tp is not None and tp > 1
        self.fc1 = ParallelLinear(in_features, hidden, dim=-1 if sharded else None, group=group)
        self.tag = RegisterParallelDim(-1 if sharded else None)   # GELU drops the tag
        self.drop = ParallelDropout(dropout, group=group)
        self.fc2 = ParallelLinear(hidden, hidden, dim=0 if sharded else None, group=group)

    def forward(self, x: Tensor) -> Tensor:
        h = self.drop(self.tag(F.gelu(self.fc1(x))))               # (N, H / tp)
        return F.gelu(self.fc2(h))                                  # (N, H)


def mlp(*, in_features: int = 32, hidden: int = 64, out_features: int = 10, n_layer: int = 4,
        dropout: float = 0.0, tp: int | None = None,
        group: ProcessGroup | None = None) -> nn.Sequential:
    """``nn.Sequential(MLPBlock × n_layer, Linear(hidden, out_features))``: (N, in) -> (N, out).

    `tp=None` (or 1) builds plain layers; with `tp` the blocks shard over `group` (default:
    the tp group of `hybridpar.init`, whose size must be `tp`) and `hidden` must divide by it.
    """
    for name, value in (("in_features", in_features), ("hidden", hidden),
                        ("out_features", out_features), ("n_layer", n_layer)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"mlp: {name} must be a positive integer, got {value!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"mlp: dropout must be in [0, 1), got {dropout}")
    if tp is None and group is not None:
        raise ValueError("mlp: group= is given without tp=; pass tp=<size of the group>")
    if tp is not None:
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"mlp: tp must be a positive integer or None, got {tp!r}")
        if hidden % tp != 0:
            valid = [d for d in range(1, hidden + 1) if hidden % d == 0]
            raise ValueError(f"mlp: hidden={hidden} is not divisible by tp={tp}; valid tp "
                             f"sizes for hidden={hidden} are {valid}")
        if tp > 1:
            size = group_size(group if group is not None else default_tp_group())
            if size != tp:
                raise ValueError(f"mlp: tp={tp} but the tensor-parallel group has {size} "
                                 f"ranks; pass tp={size} or a group of {tp} ranks")
    layers: list[nn.Module] = [
        MLPBlock(in_features if i == 0 else hidden, hidden, dropout=dropout, tp=tp, group=group)
        for i in range(n_layer)]
    layers.append(nn.Linear(hidden, out_features))                  # replicated classifier
    return keyed(torch.initial_seed(), nn.Sequential(*layers))


def mlp_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy of logits (N, out) and class ids (N,)."""
    return F.cross_entropy(logits, target)
