"""`to_sequential`: a Hugging Face causal LM as an `nn.Sequential` of single-input layers."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from torch import nn

from hybridpar.hf.attention import route_attention
from hybridpar.hf.blocks import DecoderBlock, TokenPositionEmbedding
from hybridpar.hf.glue import GLUE, Glue, InputLayer, LogitsLayer, glue_of
from hybridpar.hf.structure import attention_type, num_layers, structure_of
from hybridpar.moe.carry import AuxOutput, Carried
from hybridpar.moe.hf_blocks import hf_moe

__all__ = ["to_sequential"]


def to_sequential(model: nn.Module, *, glue: Sequence[Glue] = GLUE) -> nn.Sequential:
    """The causal LM `model` as ``nn.Sequential(input, block × L, final norm, head)``.

    Layers (L = ``config.num_hidden_layers``; names from `hf.structure`, Llama's here)::

        0        (B, T) ids -> (B, T, D)   model.embed_tokens    (GPT-2: transformer.wte + wpe)
        1 .. L   (B, T, D) -> (B, T, D)    model.layers.{i-1}    (GPT-2: transformer.h.{i-1})
        L + 1    (B, T, D) -> (B, T, D)    model.norm            (GPT-2: transformer.ln_f)
        L + 2    (B, T, D) -> (B, T, V)    lm_head

    Layer 0 is the embedding itself, or an `InputLayer` holding the trunk's modules before
    the blocks (Phi's dropout) and the input glue (`hf.glue`: Granite's multiplier); layer
    L + 2 the head itself, or a `LogitsLayer` with the logit glue (Gemma 2's soft-capping).
    Only the hidden states cross a stage boundary: each `DecoderBlock` computes positions
    ``0 .. T-1``, its causal mask (per layer type) and rotary cos / sin from the sequence
    length. The layers are the model's own modules, so the parameters are the same objects
    (a tied head uses the embedding's Parameter) and ``seq(input_ids)`` equals
    ``model(input_ids).logits`` (`hf.probe` checks that for a family before training). The
    model is shared, not copied: what changes one changes the other.

    Any decoder whose class declares a pp plan (or has GPT-2's shape) converts; `glue` is
    the registry of `hf.glue`. Not supported: attention masks / padding, position ids other
    than ``0 .. T-1``, the KV cache (generation), ``inputs_embeds``, cross-attention; the
    features of `hf.structure.UNSUPPORTED` are a `ValueError` naming them.
    """
    if not isinstance(model, nn.Module) or getattr(model, "config", None) is None:
        raise TypeError(f"to_sequential takes a Hugging Face model (an nn.Module with a "
                        f"config), got {type(model).__name__}")
    config: Any = model.config
    parts = structure_of(config)
    route_attention(config)   # checkpoint = "selective" recomputes its core (`hf.attention`)
    base = getattr(model, parts.base, None)
    head = getattr(model, parts.head, None)
    if base is None or not isinstance(head, nn.Module):
        raise ValueError(
            f"{type(model).__name__} is a {parts.model_type} model without a causal-LM head; "
            f"pass the causal LM ({parts.causal_lm}), which has '{parts.base}' and "
            f"'{parts.head}'")
    if getattr(config, "add_cross_attention", False):
        raise ValueError(f"{type(model).__name__} has cross-attention (add_cross_attention="
                         "True); to_sequential supports decoder-only models")

    count = num_layers(config)
    layers = list(getattr(base, parts.layers))[:count]    # as the model's forward slices them
    inputs = {name: getattr(base, name) for name in parts.inputs}
    input_glue, logits_glue = (glue_of(config, w, glue=glue) for w in ("input", "logits"))
    embedding: nn.Module
    if parts.learned_positions:
        embedding = TokenPositionEmbedding(*inputs.values())
    elif len(inputs) == 1 and not input_glue:
        embedding = inputs[parts.embedding]
    else:
        embedding = InputLayer(inputs, input_glue)
    rotary = getattr(base, "rotary_emb", None)
    blocks = [
        DecoderBlock(layer, config=config, attention_type=attention_type(config, i),
                     rotary=_copy_rotary(rotary) if rotary is not None else None)
        for i, layer in enumerate(layers)
    ]
    output = LogitsLayer({parts.head: head}, logits_glue) if logits_glue else head
    norm = getattr(base, parts.norm)
    if _with_experts(blocks, config):   # the routing sums travel from block to block
        norm, output = Carried(norm), AuxOutput(output, coef=_aux_coef(model, config))
    sequential = nn.Sequential(embedding, *blocks, norm, output)
    sequential.train(model.training)
    return sequential


def _copy_rotary(rotary: nn.Module) -> nn.Module:
    """A copy of the rotary embedding for one block (its config shared, not copied)."""
    memo: dict[int, Any] = {}
    if getattr(rotary, "config", None) is not None:
        memo[id(rotary.config)] = rotary.config
    return copy.deepcopy(rotary, memo)


def _with_experts(blocks: list[DecoderBlock], config: Any) -> bool:
    """Make each sparse block's MoE block hybridpar's view (`hybridpar.moe.hf_blocks`) and
    let every block carry the routing sums; whether the model has experts at all."""
    sparse = False
    for block in blocks:
        found = hf_moe(block.hf_layer, config)
        if found is not None:
            name, view = found
            setattr(block.hf_layer, name, view)     # the block shares the layer's children
            object.__setattr__(block, "moe", view)  # not registered again: it is one of them
            sparse = True
    for i, block in enumerate(blocks):
        block.carries, block.starts = sparse, sparse and i == 0
    return sparse


def _aux_coef(model: nn.Module, config: Any) -> float:
    """The load-balancing loss's weight: Hugging Face adds it when the config asks for the
    router logits (``output_router_logits``), as the causal LM's ``router_aux_loss_coef``
    (a class that keeps none, Cohere2-MoE's, adds no such loss); else 0."""
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(model, "router_aux_loss_coef", 0.0) or 0.0)
