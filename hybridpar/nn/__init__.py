"""Tensor-parallel layers: torchshard's (`ParallelLinear`, ...) and xlstm-jax's (`TPDense`, ...)."""

from hybridpar.nn import functional, init
from hybridpar.pipeline.runtime.batchnorm import DeferredBatchNorm
from hybridpar.sharded.attrs import register_partial_grad
from hybridpar.tensor_parallel.feature.dense import TPDense
from hybridpar.tensor_parallel.feature.wrapper import ModelParallelismWrapper
from hybridpar.tensor_parallel.layers import ParallelEmbedding, ParallelLinear, RegisterParallelDim
from hybridpar.tensor_parallel.loss import CausalLMLoss, ParallelCrossEntropyLoss
from hybridpar.tensor_parallel.random import ParallelDropout

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
    "register_partial_grad",
]
