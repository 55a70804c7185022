"""Tensor parallelism: sharded layers, their communication, loss, RNG, plans and state dicts."""

from hybridpar.tensor_parallel.feature import (
    ModelParallelismWrapper,
    TPDense,
    async_gather,
    async_gather_bidirectional,
    async_gather_split,
    async_scatter,
    async_scatter_split,
)

__all__ = [
    "ModelParallelismWrapper",
    "TPDense",
    "async_gather",
    "async_gather_bidirectional",
    "async_gather_split",
    "async_scatter",
    "async_scatter_split",
]
