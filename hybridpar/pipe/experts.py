"""A Hugging Face model's experts split over the ep group when HybridPipe builds it."""

from __future__ import annotations

from torch import nn
from torch.distributed import ProcessGroup

from hybridpar.moe.hf_blocks import HFMoE, shard_experts

__all__ = ["shard_hf_experts"]


def shard_hf_experts(module: nn.Module, group: ProcessGroup) -> int:
    """Each Hugging Face sparse block of `module` keeps this rank's E / ep experts
    (`hybridpar.moe.hf_blocks.shard_experts`); how many blocks. A model built on `meta`
    is refused: its experts would be drawn at their local size, not as slices of the whole
    layer (a rank's values would differ from the unsharded model's)."""
    if any(p.is_meta for p in module.parameters()) and any(
            isinstance(m, HFMoE) for m in module.modules()):
        raise ValueError("expert parallelism of a Hugging Face model built on meta is not "
                         "supported yet: build it whole (each rank slices its experts), or "
                         "train it with ep = 1")
    return shard_experts(module, group)
