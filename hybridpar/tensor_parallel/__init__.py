"""Tensor parallelism: sharded layers, their communication, loss, RNG and state dicts."""

from hybridpar.tensor_parallel.dense import TPDense
from hybridpar.tensor_parallel.ring import (
    async_gather,
    async_gather_bidirectional,
    async_gather_split,
    async_scatter,
    async_scatter_split,
)
from hybridpar.tensor_parallel.wrapper import ModelParallelismWrapper

__all__ = [
    "ModelParallelismWrapper",
    "TPDense",
    "async_gather",
    "async_gather_bidirectional",
    "async_gather_split",
    "async_scatter",
    "async_scatter_split",
]
