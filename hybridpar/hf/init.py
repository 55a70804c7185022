"""`init_fn`: the initializer that materializes a `meta`-built Hugging Face Sequential."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["init_fn"]

_Init = Callable[[nn.Module], None]


def init_fn(model_or_config: Any) -> _Init:
    """The callable to pass as ``HybridPipe(..., init_fn=)`` for a `to_sequential` model.

    Applied to every module after ``to_empty``, it runs the model's own ``_init_weights``
    (random weights as Hugging Face draws them; RMSNorm / LayerNorm weights 1; GPT-2's scaled
    projections) and recomputes what is not random: the rotary buffers ``inv_freq`` /
    ``original_inv_freq`` of each `DecoderBlock`. Give the Hugging Face model (any device,
    `meta` included) or its config (a `meta` model is then built for its ``_init_weights``).
    Load a checkpoint afterwards for real weights.

    The tp layers a ``tp_plan`` put in (`ParallelLinear`, `ParallelConv1D`,
    `ParallelEmbedding`, `TPDense`) are not layers ``_init_weights`` knows. Each is drawn as
    Hugging Face draws the plain layer it is a shard of, and keeps its slice (`shard_of`):

        tp layer                     drawn full, by _init_weights      keeps
        ParallelLinear, TPDense      nn.Linear(in, out)                its rows / columns
        ParallelConv1D               Conv1D(nf, nx)                    "
        ParallelEmbedding            nn.Embedding(V, D, padding_idx)   its vocab / features

    and a Hugging Face module whose own rule draws a child's weight (GPT-2's attention and MLP
    redraw ``c_proj.weight`` scaled by 1 / sqrt(2 n_layer)) draws it on the full layer too:
    its tp children are swapped for full plain layers while the rule runs, and keep the
    slices of what it drew. So a tp group's shards form one full tensor, drawn as on one
    device, when its ranks share the seed; it costs the full tensors of one layer (or of the
    tp children of one module) at a time, on their device.
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
    from hybridpar.tensor_parallel.base import ParallelLayer

    @torch.no_grad()
    def initialize(module: nn.Module) -> None:
        if isinstance(module, DecoderBlock):
            module.reset_parameters()      # its rotary buffers; its children come on their own
        elif isinstance(module, ParallelLayer):
            full = _full_layer(module)
            if full is None:               # a tp layer of a kind not listed: its own draw
                module.reset_parameters()
                return
            init_weights(full)
            full.weight.mul_(getattr(module, "init_scale", 1.0))   # TPDense's (xlstm's)
            _keep_slices(module, full)
        elif type(module).__module__.startswith("transformers."):
            _init_over_full_children(module, init_weights)
        else:
            init_weights(module)

    return initialize


def _full_layer(layer: nn.Module) -> nn.Module | None:
    """The full, plain layer `layer` is a shard of, uninitialized on `layer`'s device (None:
    a tp layer of a kind not known here)."""
    from hybridpar.tensor_parallel.embedding import ParallelEmbedding
    from hybridpar.tensor_parallel.feature.dense import TPDense
    from hybridpar.tensor_parallel.layers import ParallelConv1D, ParallelLinear

    full: nn.Module
    with torch.device("meta"):
        if isinstance(layer, ParallelConv1D):
            from transformers.pytorch_utils import Conv1D

            full = Conv1D(layer.out_features, layer.in_features)
        elif isinstance(layer, (ParallelLinear, TPDense)):
            full = nn.Linear(layer.in_features, layer.out_features, layer.bias is not None)
        elif isinstance(layer, ParallelEmbedding):
            full = nn.Embedding(layer.num_embeddings, layer.embedding_dim, layer.padding_idx)
        else:
            return None
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    return full.to(dtype=weight.dtype).to_empty(device=weight.device)


def _keep_slices(layer: nn.Module, full: nn.Module, *, drawn_only: bool = False) -> None:
    """Copy this rank's slice of every parameter of `full` into `layer`'s (`drawn_only`: of
    those that hold something other than NaN, i.e. that an initializer wrote)."""
    from hybridpar.tensor_parallel.state import shard_of

    group = getattr(layer, "group", None)
    for name, param in layer.named_parameters(recurse=False):
        value = getattr(full, name, None)
        if not isinstance(value, torch.Tensor) or (drawn_only and bool(value.isnan().all())):
            continue
        param.copy_(shard_of(value, param, group))


def _init_over_full_children(module: nn.Module, init_weights: _Init) -> None:
    """``init_weights(module)`` with its tp children swapped for full plain layers (NaN),
    each child then keeping the slices of what the rule drew on its full layer."""
    from hybridpar.tensor_parallel.base import ParallelLayer

    swapped: dict[str, tuple[nn.Module, nn.Module]] = {}
    for name, child in module.named_children():
        if isinstance(child, ParallelLayer):
            full = _full_layer(child)
            if full is not None:
                for t in full.parameters():
                    t.fill_(float("nan"))
                swapped[name] = (child, full)
    for name, (_, full) in swapped.items():
        module._modules[name] = full
    try:
        init_weights(module)
    finally:
        for name, (child, _) in swapped.items():
            module._modules[name] = child
    for child, full in swapped.values():
        _keep_slices(child, full, drawn_only=True)
