"""Cost of a layer's tensor-parallel shard, estimated when the layer was profiled whole.

With tp > 1 a stage runs the tp-shard of each layer. A layer already built sharded (it holds
a `ParallelLinear` / `ParallelEmbedding` with a dim over a group of more than one rank) is
profiled as it is: its weights are the shard and its collectives ran for real. A layer
profiled whole on one process is scaled by this table:

    the layer holds                      compute time   param bytes        activations   + comm
    already-sharded parallel layers      as measured    as measured        as measured   -
    nn.Linear, nn.Embedding,             / tp           those modules'     / tp          see below
    ParallelLinear / ParallelEmbedding                  params / tp, the
    (dim set, a one-rank group)                         rest as measured
    anything else (elementwise, norms)   as measured    as measured        as measured   -

    comm_ms = pairs * 2 * allreduce_ms(output bytes)    (one all-reduce forward, one backward)
    pairs   = ceil(linears / 2) + embeddings            (Megatron: column + row Linear = 1 pair)
    allreduce_ms(b) = 2 (tp - 1) / tp * b / tp_bandwidth * 1000        (ring all-reduce)

The estimate is coarse on purpose (a transformer block's softmax does not shrink with tp,
its LayerNorm is not sharded); it only has to rank layers well enough to split them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn
from torch.distributed import ProcessGroup

from hybridpar.tensor_parallel.layers import ParallelEmbedding, ParallelLinear

__all__ = ["ShardEstimate", "allreduce_ms", "collective_group", "shard_estimate"]


@dataclass(frozen=True)
class ShardEstimate:
    """How to turn a whole layer's profile into its shard's (see the module table)."""

    compute_scale: float  # multiplies the measured time and the activation bytes
    param_bytes: int  # parameter bytes of the shard
    params: int  # parameter count of the shard
    pairs: int  # row-parallel pairs: each costs an all-reduce forward and one backward

    def comm_ms(self, output_bytes: int, tp: int, bandwidth: float) -> float:
        """Milliseconds of the layer's collectives for an output of `output_bytes`."""
        return self.pairs * 2 * allreduce_ms(output_bytes, tp, bandwidth)


def allreduce_ms(nbytes: int, tp: int, bandwidth: float) -> float:
    """Ring all-reduce time of `nbytes` over `tp` ranks at `bandwidth` bytes/s, in ms."""
    if tp <= 1 or nbytes == 0:
        return 0.0
    return 2 * (tp - 1) / tp * nbytes / bandwidth * 1000


def _is_sharded(module: nn.Module) -> bool:
    return (isinstance(module, (ParallelLinear, ParallelEmbedding)) and module.dim is not None
            and module.tp_size > 1)


def collective_group(layer: nn.Module) -> ProcessGroup | None:
    """The tp group whose collectives `layer` runs (None when it runs none).

    Ranks profiling such a layer must run it the same number of times, or one would wait in a
    collective the others never join.
    """
    for module in layer.modules():
        if isinstance(module, (ParallelLinear, ParallelEmbedding)) and _is_sharded(module):
            return module.group
    return None


def _is_shardable(module: nn.Module) -> bool:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        return True
    return isinstance(module, (ParallelLinear, ParallelEmbedding)) and module.dim is not None


def _nbytes(module: nn.Module) -> tuple[int, int]:
    params = list(module.parameters(recurse=False))
    return sum(p.numel() for p in params), sum(p.numel() * p.element_size() for p in params)


def shard_estimate(layer: nn.Module, tp: int) -> ShardEstimate:
    """The scaling of `layer` for `tp` ranks (identity for tp == 1 or an already-sharded layer)."""
    mods = list(layer.modules())
    count = sum(p.numel() for p in layer.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    if tp <= 1 or any(_is_sharded(m) for m in mods):
        return ShardEstimate(1.0, nbytes, count, 0)
    shardable = [m for m in mods if _is_shardable(m)]
    if not shardable:
        return ShardEstimate(1.0, nbytes, count, 0)
    linears = sum(1 for m in shardable if isinstance(m, (nn.Linear, ParallelLinear)))
    embeddings = len(shardable) - linears
    for m in shardable:
        c, b = _nbytes(m)
        count += c // tp - c
        nbytes += b // tp - b
    return ShardEstimate(1.0 / tp, nbytes, count, math.ceil(linears / 2) + embeddings)
