"""Initializers for sharded tensors (torchshard's `nn.init`)."""

from hybridpar.tensor_parallel.init import shard_init_helper_

__all__ = ["shard_init_helper_"]
