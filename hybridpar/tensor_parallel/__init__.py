"""Tensor parallelism: sharded layers, their communication, loss, RNG and state dicts."""
