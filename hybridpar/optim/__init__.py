"""Optimizers over a rank's shard: state (ZeRO-1) and gradients (ZeRO-2) sharded over dp,
float32 master weights."""

from hybridpar.optim.for_pipe import contiguous_owners, gradient_owners, pipe_optimizer
from hybridpar.optim.master import MasterWeights, deal
from hybridpar.optim.zero import (
    ZERO_LEVELS,
    check_shardable,
    local_optimizer,
    optimizer_state_tensors,
    owned_parameters,
    zero_optimizer,
)

__all__ = ["ZERO_LEVELS", "MasterWeights", "check_shardable", "contiguous_owners", "deal",
           "gradient_owners",
           "local_optimizer", "optimizer_state_tensors", "owned_parameters", "pipe_optimizer",
           "zero_optimizer"]
