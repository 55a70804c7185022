"""Tensor-parallel layers: torchshard's (`ParallelLinear`, ...) and xlstm-jax's (`TPDense`, ...)."""

from hybridpar.nn import functional, init
from hybridpar.pipeline.batchnorm import DeferredBatchNorm
from hybridpar.tensor_parallel.dense import TPDense
from hybridpar.tensor_parallel.layers import ParallelEmbedding, ParallelLinear, RegisterParallelDim
from hybridpar.tensor_parallel.loss import CausalLMLoss, ParallelCrossEntropyLoss
from hybridpar.tensor_parallel.random import ParallelDropout
from hybridpar.tensor_parallel.wrapper import ModelParallelismWrapper

__all__ = [
    "CausalLMLoss",
    "DeferredBatchNorm",
    "ModelParallelismWrapper",
    "ParallelCrossEntropyLoss",
    "ParallelDropout",
    "ParallelEmbedding",
    "ParallelLinear",
    "RegisterParallelDim",
    "TPDense",
    "functional",
    "init",
]
