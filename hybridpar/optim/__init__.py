"""Optimizers over a rank's shard: optimizer state sharded over data parallelism (ZeRO-1)."""

from hybridpar.optim.zero import (
    ZERO_LEVELS,
    local_optimizer,
    optimizer_state_tensors,
    owned_parameters,
    zero_optimizer,
)

__all__ = ["ZERO_LEVELS", "local_optimizer", "optimizer_state_tensors", "owned_parameters",
           "zero_optimizer"]
