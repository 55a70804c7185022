"""`init_fn`: the initializer that materializes a `meta`-built Hugging Face Sequential."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["init_fn"]


def init_fn(model_or_config: Any) -> Callable[[nn.Module], None]:
    """The callable to pass as ``HybridPipe(..., init_fn=)`` for a `to_sequential` model.

    Applied to every module after ``to_empty``, it runs the model's own ``_init_weights``
    (random weights as Hugging Face draws them; RMSNorm / LayerNorm weights 1; GPT-2's scaled
    projections) and recomputes what is not random: the rotary buffers ``inv_freq`` /
    ``original_inv_freq`` of each `DecoderBlock`. Give the Hugging Face model (any device,
    `meta` included) or its config (a `meta` model is then built for its ``_init_weights``).
    Load a checkpoint afterwards for real weights.
    """
    if isinstance(model_or_config, nn.Module):
        model = model_or_config
    else:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_or_config)
    init_weights = model._init_weights
    if not callable(init_weights):
        raise TypeError(f"{type(model).__name__} has no _init_weights; pass a Hugging Face "
                        "model or config")

    from hybridpar.hf.blocks import DecoderBlock

    @torch.no_grad()
    def initialize(module: nn.Module) -> None:
        if isinstance(module, DecoderBlock):
            module.reset_parameters()      # its rotary buffers; its children come on their own
        else:
            init_weights(module)

    return initialize
