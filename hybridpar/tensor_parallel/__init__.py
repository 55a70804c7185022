"""Tensor parallelism, in rooms:

    room       owns                                                       imports
    (here)     sharded layers (Linear, Conv1D, Embedding), the            `hybridpar.sharded`
               vocab-parallel loss, dropout RNG, sliced init, state dicts (tags, collectives),
                                                                          the leaf modules
    feature    TPDense and the ring-overlapped gather / scatter           (here)
    plans      which layers to shard: styles, "auto", strategies, hooks   (here), feature

Never the pipeline: `hybridpar.pipe` and `pipeline.parameters` apply plans to a stage.
"""

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
