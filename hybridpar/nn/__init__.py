"""Tensor-parallel layers with torchshard's names: `hybridpar.nn.ParallelLinear`, ..."""

from hybridpar.nn import functional, init
from hybridpar.pipeline.batchnorm import DeferredBatchNorm
from hybridpar.tensor_parallel.layers import ParallelEmbedding, ParallelLinear, RegisterParallelDim
from hybridpar.tensor_parallel.loss import ParallelCrossEntropyLoss
from hybridpar.tensor_parallel.random import ParallelDropout

__all__ = [
    "DeferredBatchNorm",
    "ParallelCrossEntropyLoss",
    "ParallelDropout",
    "ParallelEmbedding",
    "ParallelLinear",
    "RegisterParallelDim",
    "functional",
    "init",
]
