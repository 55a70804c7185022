"""Feature-sharded tensor parallelism (xlstm-jax's TPDense): activations stay split on features.

    module        owns
    dense         TPDense: gather / scatter / none modes, (*, in / tp) -> (*, out / tp)
    dense_async   the overlapped (ring) linear maps of TPDense(async_comm=True)
    ring          ring all-gather and scatter-sum by neighbour hops, overlapping compute
    wrapper       ModelParallelismWrapper: one module per tp rank, rank-dependent init

`tp_plan` styles ``"dense_gather"`` / ``"dense_scatter"`` (``"..._async"``) put TPDense layers
into a model (`plan`); see docs/tensor-parallel.md for when to choose them over column / row.
"""

from hybridpar.tensor_parallel.feature.dense import MODES, TPDense
from hybridpar.tensor_parallel.feature.ring import (
    async_gather,
    async_gather_bidirectional,
    async_gather_split,
    async_scatter,
    async_scatter_split,
)
from hybridpar.tensor_parallel.feature.wrapper import ModelParallelismWrapper

__all__ = [
    "MODES",
    "ModelParallelismWrapper",
    "TPDense",
    "async_gather",
    "async_gather_bidirectional",
    "async_gather_split",
    "async_scatter",
    "async_scatter_split",
]
