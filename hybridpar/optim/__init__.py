"""Optimizers over a rank's shard: state sharded over dp (ZeRO-1), float32 master weights."""

from hybridpar.optim.master import MasterWeights, deal
from hybridpar.optim.zero import (
    ZERO_LEVELS,
    check_shardable,
    local_optimizer,
    optimizer_state_tensors,
    owned_parameters,
    zero_optimizer,
)

__all__ = ["ZERO_LEVELS", "MasterWeights", "check_shardable", "deal", "local_optimizer",
           "optimizer_state_tensors", "owned_parameters", "zero_optimizer"]
