"""Functional forms of the tensor-parallel layers (torchshard's `nn.functional`)."""

from hybridpar.tensor_parallel.functional import parallel_embedding, parallel_linear
from hybridpar.tensor_parallel.loss import parallel_cross_entropy

__all__ = ["parallel_cross_entropy", "parallel_embedding", "parallel_linear"]
