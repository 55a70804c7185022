"""Functional forms of the tensor-parallel layers (torchshard's `nn.functional`)."""

from torch import Tensor

from hybridpar.tensor_parallel.functional import parallel_embedding, parallel_linear
from hybridpar.tensor_parallel.loss import parallel_cross_entropy

__all__ = ["ParallelCrossEntropy", "parallel_cross_entropy", "parallel_embedding",
           "parallel_linear"]


class ParallelCrossEntropy:
    """torchshard's autograd entry point: ``ParallelCrossEntropy.apply(input, target, weight,
    size_average, ignore_index, reduce, reduction)`` is `parallel_cross_entropy`."""

    @staticmethod
    def apply(input: Tensor, target: Tensor, weight: Tensor | None = None,
              size_average: bool | None = None, ignore_index: int = -100,
              reduce: bool | None = None, reduction: str = "mean") -> Tensor:
        return parallel_cross_entropy(input, target, weight, size_average, ignore_index,
                                      reduce, reduction)
