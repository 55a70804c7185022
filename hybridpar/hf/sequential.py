"""`to_sequential`: a Hugging Face causal LM as an `nn.Sequential` of single-input layers."""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from hybridpar.hf.attention import route_attention
from hybridpar.hf.blocks import DecoderBlock, TokenPositionEmbedding
from hybridpar.hf.families import attention_type, family_of, num_layers

__all__ = ["to_sequential"]


def to_sequential(model: nn.Module) -> nn.Sequential:
    """The causal LM `model` as ``nn.Sequential(embedding, block × L, final norm, head)``.

    Layers (L = ``config.num_hidden_layers``; index: what it is, its Hugging Face name)::

        0        (B, T) ids -> (B, T, D)   model.embed_tokens    (GPT-2: transformer.wte + wpe)
        1 .. L   (B, T, D) -> (B, T, D)    model.layers.{i-1}    (GPT-2: transformer.h.{i-1})
        L + 1    (B, T, D) -> (B, T, D)    model.norm            (GPT-2: transformer.ln_f)
        L + 2    (B, T, D) -> (B, T, V)    lm_head

    Only the hidden states cross a stage boundary: each `DecoderBlock` computes positions
    ``0 .. T-1``, the causal mask and rotary cos / sin from the sequence length. The layers are
    the model's own modules, so the parameters are the same objects (a tied head uses the
    embedding's Parameter) and ``seq(input_ids)`` equals ``model(input_ids).logits``. The model
    is shared, not copied: what changes one (training, `HybridPipe` releasing other stages'
    layers to `meta`) changes the other.

    Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
    ``Qwen3ForCausalLM``, ``GPT2LMHeadModel``, on input ids of full sequences. Not supported:
    attention masks / padding, position ids other than ``0 .. T-1``, the KV cache (generation),
    ``inputs_embeds``, GPT-2's ``token_type_ids`` and cross-attention. Other models are a
    `ValueError` naming the supported types.
    """
    if not isinstance(model, nn.Module) or getattr(model, "config", None) is None:
        raise TypeError(f"to_sequential takes a Hugging Face model (an nn.Module with a "
                        f"config), got {type(model).__name__}")
    config: Any = model.config
    family = family_of(config)
    route_attention(config)   # checkpoint = "selective" recomputes its core (`hf.attention`)
    base = getattr(model, family.base, None)
    head = getattr(model, "lm_head", None)
    if base is None or not isinstance(head, nn.Module):
        raise ValueError(
            f"{type(model).__name__} is a {family.model_type} model without a causal-LM head; "
            f"pass the causal LM ({' / '.join(family.classes)}), which has '{family.base}' and "
            "'lm_head'")
    if getattr(config, "add_cross_attention", False):
        raise ValueError(f"{type(model).__name__} has cross-attention (add_cross_attention="
                         "True); to_sequential supports decoder-only models")

    count = num_layers(config)
    layers = list(getattr(base, family.layers))[:count]   # as the model's forward slices them
    embedding: nn.Module
    if family.embedding is None:
        embedding = TokenPositionEmbedding(base.wte, base.wpe, base.drop)
    else:
        embedding = getattr(base, family.embedding)
    rotary = getattr(base, "rotary_emb", None) if family.rotary else None
    if family.rotary and rotary is None:
        raise ValueError(f"{type(model).__name__} has no '{family.base}.rotary_emb'")
    blocks = [
        DecoderBlock(layer, config=config, attention_type=attention_type(config, i),
                     rotary=_copy_rotary(rotary) if rotary is not None else None)
        for i, layer in enumerate(layers)
    ]
    sequential = nn.Sequential(embedding, *blocks, getattr(base, family.norm), head)
    sequential.train(model.training)
    return sequential


def _copy_rotary(rotary: nn.Module) -> nn.Module:
    """A copy of the rotary embedding for one block (its config shared, not copied)."""
    memo: dict[int, Any] = {}
    if getattr(rotary, "config", None) is not None:
        memo[id(rotary.config)] = rotary.config
    return copy.deepcopy(rotary, memo)
