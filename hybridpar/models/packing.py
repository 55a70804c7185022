"""`pack_documents`: a token model made to carry document positions from layer to layer.

``data.pack = "documents"`` feeds the first stage (ids, positions) (`hybridpar.packing`).
The model's layers pass the positions on with the hidden state, so they cross every
pipeline stage boundary in the same message, and stop at the last attention block:

    layer       gpt                          hf: rotary decoders (llama, gemma2, phi3, ...)
    0           Embeddings: pos table        its input layer, made to pass them on
    1 .. L-1    Block: mask, passes them     DecoderBlock: mask and rotary, passes them
    L           Block: mask, drops them      DecoderBlock: mask and rotary, drops them
    L+1, L+2    LayerNorm, Head: unchanged   norm, lm_head: unchanged

Given ids alone, every layer computes what it computed before (`pack_documents` changes no
parameter, buffer or name): evaluation prompts and sampling need no positions.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from hybridpar.packing import PACKED_ATTR, split_positions

__all__ = ["PACKABLE", "PassesPositions", "PositionsEmbedding", "pack_documents", "pack_problem"]

PACKABLE = ("gpt", "hf:<a rotary decoder: llama, mistral, qwen2, qwen3, gemma2, phi3, ...>")


def pack_problem(name: str) -> str | None:
    """Why model `name` cannot train packed documents, with what to do; None when it can."""
    if name == "gpt" or (name.startswith("hf:") and not _learned_positions(name)):
        return None
    why = ("its learned positions (TokenPositionEmbedding) take no document positions"
           if name.startswith("hf:") else "its layers take no document positions")
    return (f"data.pack = 'documents' needs a model whose layers carry document positions "
            f"({', '.join(PACKABLE)}); model {name!r} is not one ({why}): set data.pack = "
            "'none' (windows may then cross documents, attending across them)")


def _learned_positions(name: str) -> bool:
    """Whether an ``hf:`` model's input is GPT-2's token + position tables."""
    from hybridpar.hf.structure import structure_of

    try:
        return structure_of({"model_type": name.removeprefix("hf:")}).learned_positions
    except (ValueError, ImportError):   # not a decoder: the model check says so
        return False


class PassesPositions(nn.Module):
    """A Hugging Face model's input layer that passes document positions on:
    ``(ids, positions) -> ((B, T, D), positions)``; ids alone: ``(B, T, D)`` as before.

    `pack_documents` makes it a base of the class of the model's own input layer (an
    ``nn.Embedding``, Gemma's scaled subclass, an `InputLayer` with glue): the same module,
    its parameters, names, ties and initialization untouched, its own forward run on the ids."""

    def forward(self, input: Any) -> Any:
        ids, positions = split_positions(input)
        out: Tensor = super().forward(ids)                     # (B, T, D)
        return out if positions is None else (out, positions)


class PositionsEmbedding(PassesPositions, nn.Embedding):
    """A plain ``nn.Embedding`` that passes document positions on (`PassesPositions`)."""


def pack_documents(model: nn.Sequential) -> nn.Sequential:
    """`model`, changed in place, taking (ids, positions) as well as ids (see the module).

    `model` is a `gpt` or a `hybridpar.hf.to_sequential` model of a rotary family; call it
    before `HybridPipe` splits the model. Any other layout is a `ValueError`. A tp plan that
    replaces layer 0 must leave it out (its replacement would not pass the positions on).
    """
    from hybridpar.hf.blocks import DecoderBlock
    from hybridpar.hf.glue import InputLayer
    from hybridpar.models.gpt_layers import Block, Embeddings

    layers = list(model)
    blocks = [i for i, m in enumerate(layers) if isinstance(m, (Block, DecoderBlock))]
    first = layers[0] if layers else None
    gpt = isinstance(first, Embeddings) and all(isinstance(layers[i], Block) for i in blocks)
    rotary = isinstance(first, nn.Embedding | InputLayer) and all(
        isinstance(layers[i], DecoderBlock) and layers[i].hf_rotary is not None for i in blocks)
    if not blocks or blocks != list(range(1, blocks[-1] + 1)) or not (gpt or rotary):
        kinds = ", ".join(type(m).__name__ for m in layers[:3])
        raise ValueError(
            f"pack_documents takes a gpt or a Hugging Face rotary model (Llama, Gemma, Phi-3, "
            f"...) as to_sequential makes it: an embedding, then the attention blocks; got "
            f"layers {kinds}, ...; train it with data.pack = 'none'")
    if rotary and not gpt and not isinstance(first, PassesPositions):
        cls = type(first)   # the same module, now passing positions on
        first.__class__ = PositionsEmbedding if cls is nn.Embedding else \
            type(f"Positions{cls.__name__}", (PassesPositions, cls), {})
    attention = [m for m in layers if isinstance(m, (Block, DecoderBlock))]
    for block in attention:
        block.keep_positions = block is not attention[-1]   # the last hands on x alone
    setattr(model, PACKED_ATTR, True)   # for HybridPipe's checks (`is_packed`)
    return model
