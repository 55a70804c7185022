"""The layers `to_sequential` adds around Hugging Face modules: GPT-2's input, a decoder block."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from hybridpar.hf.structure import config_value
from hybridpar.moe.balance_loss import empty_stats
from hybridpar.moe.carry import join_carry, split_carry
from hybridpar.packing import document_segments, split_positions
from hybridpar.sharded.attrs import SEQUENCE, get_parallel_dim, register_parallel_dim

__all__ = ["DecoderBlock", "TokenPositionEmbedding"]


class TokenPositionEmbedding(nn.Module):
    """GPT-2's input layer: token + learned position embeddings, then dropout.

    ``(B, T)`` token ids -> ``(B, T, D)``, positions ``0 .. T-1`` (no padding, no cache); under
    sequence parallelism (`hf.sequence`) both tables give this rank's ``T / tp`` tokens. Holds
    the model's own ``wte`` / ``wpe`` / ``drop`` modules, so ``"0.wte.weight"`` is the model's
    ``transformer.wte.weight`` (and the head's tied weight).
    """

    def __init__(self, wte: nn.Embedding, wpe: nn.Embedding, drop: nn.Module) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, input_ids: Tensor) -> Tensor:
        positions = torch.arange(input_ids.shape[-1], device=input_ids.device).unsqueeze(0)
        tokens = self.wte(input_ids)
        hidden = tokens + self.wpe(positions)                         # (B, T, D)
        if get_parallel_dim(tokens) == SEQUENCE:    # sequence parallelism: (B, T / tp, D)
            register_parallel_dim(hidden, SEQUENCE)
        return self.drop(hidden)


class DecoderBlock(nn.Module):
    """A Hugging Face decoder layer as a layer of one input: ``(B, T, D) -> (B, T, D)``.

    Everything the layer needs besides the hidden states is computed here from the sequence
    length, so nothing but the hidden states crosses a pipeline stage boundary: positions
    ``0 .. T-1``, the causal mask of the model's attention implementation (made by Hugging
    Face's own ``create_causal_mask`` / ``create_sliding_window_causal_mask``) and, for rotary
    models, cos / sin from this block's copy of the rotary embedding.

    The block is a second view of the layer: it shares the layer's dict of children (so its
    state-dict names are the layer's, ``"3.self_attn.q_proj.weight"``, and a child replaced
    on either is replaced on both), and the rotary copy's buffers (``inv_freq``,
    ``original_inv_freq``; non-persistent) are the block's own buffers, which
    `reset_parameters` recomputes after a `meta` build.

    Packed documents (`hybridpar.packing`): given (hidden, positions), the positions restart
    per document, the rotary embedding uses them and the mask is Hugging Face's own for the
    attention implementation, and-ed with "same document" (block-diagonal, sliding windows
    kept); the block returns (hidden, positions), or hidden alone when `keep_positions` is
    False (the model's last block, `hybridpar.models.packing.pack_documents`).
    """

    hf_layer: nn.Module
    hf_rotary: nn.Module | None
    keep_positions: bool = True
    #: a model with experts (`to_sequential`): the routing sums travel with the hidden state
    #: (`hybridpar.moe.carry`); the first block starts them, a sparse one (`moe`) adds its own
    carries: bool = False
    starts: bool = False
    moe: Any = None
    #: sequence parallelism (`hf.sequence`): the tp group's size; the hidden states are
    #: (B, T / tp, D) and the mask and positions those of the full T (0: off)
    sequence_parallel: int = 0

    def __init__(self, layer: nn.Module, *, config: Any, attention_type: str,
                 rotary: nn.Module | None = None) -> None:
        super().__init__()
        if layer._parameters or layer._buffers:
            raise ValueError(f"{type(layer).__name__} holds parameters or buffers of its own; "
                             "DecoderBlock expects them all in its children")
        self._modules = layer._modules                    # one dict for both: the same children
        object.__setattr__(self, "hf_layer", layer)       # not registered: its children are ours
        object.__setattr__(self, "hf_rotary", rotary)
        if rotary is not None:
            if rotary._modules or rotary._parameters:
                raise ValueError(f"{type(rotary).__name__} holds more than buffers")
            self._buffers = rotary._buffers               # inv_freq, original_inv_freq
            self._non_persistent_buffers_set = rotary._non_persistent_buffers_set
        self.config = config
        self.attention_type = attention_type
        #: the rotary embedding takes the layer type (Gemma 3: one frequency table per type)
        self.rotary_by_type = rotary is not None and \
            "layer_type" in inspect.signature(rotary.forward).parameters
        self.train(layer.training)

    def forward(self, hidden: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        if not self.carries:
            states, packed = split_positions(hidden)
            return self._run(states, packed, None)
        states, packed, stats = split_carry(hidden, moe=not self.starts)
        if stats is None:                                        # the first block: zeros
            stats = empty_stats(self.config_experts, device=states.device)
        return self._run(states, packed, stats)

    @property
    def config_experts(self) -> int:
        return int(config_value(self.config, "num_local_experts", "num_experts"))

    def _run(self, states: Tensor, packed: Tensor | None, stats: Tensor | None
             ) -> Tensor | tuple[Tensor, ...]:
        from transformers import masking_utils

        make_mask = (masking_utils.create_sliding_window_causal_mask
                     if self.attention_type == "sliding_attention"
                     else masking_utils.create_causal_mask)
        # no position_ids: with them HF looks for packed sequences, a host sync (and no meta
        # trace) per block; packed documents say their segments themselves
        same_document = None if packed is None else \
            masking_utils.packed_sequence_mask_function(document_segments(packed))
        full = states                                           # (B, T, D), as the mask sees
        if self.sequence_parallel:                              # (B, T / tp, D): this rank's
            if packed is not None:
                raise ValueError("sequence parallelism does not take packed documents yet")
            B, T, D = states.shape
            full = states.new_empty((B, 1, 1)).expand(B, T * self.sequence_parallel, D)
        mask = make_mask(config=self.config, inputs_embeds=full, attention_mask=None,
                         past_key_values=None, position_ids=None,
                         and_mask_function=same_document)
        positions = torch.arange(full.shape[1], device=states.device).unsqueeze(0) \
            if packed is None else packed                       # (1, T) or (B, T)
        kwargs: dict[str, Any] = {}
        if self.hf_rotary is not None:                          # cos, sin (per layer type)
            by_type = (self.attention_type,) if self.rotary_by_type else ()
            kwargs["position_embeddings"] = self.hf_rotary(states, positions, *by_type)
        if self.moe is not None:                                # its routing sums added
            self.moe.stats = stats
        try:
            out: Tensor = self.hf_layer(states, attention_mask=mask, position_ids=positions,
                                        **kwargs)
        finally:
            if self.moe is not None:
                stats, self.moe.stats = self.moe.stats, None
        if self.sequence_parallel:                              # the residual sum lost it
            register_parallel_dim(out, SEQUENCE)
        return join_carry(out, packed if self.keep_positions else None, stats)

    def train(self, mode: bool = True) -> DecoderBlock:
        super().train(mode)
        self.hf_layer.training = mode      # the children are set by super(); the views here
        if self.hf_rotary is not None:
            self.hf_rotary.training = mode
        return self

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Recompute the rotary buffers (``inv_freq``, Gemma 3's ``{type}_inv_freq``, ...) as
        the rotary class computes them: a fresh one, built on the CPU, gives its values."""
        rotary = self.hf_rotary
        if rotary is None or any(b.is_meta for b in self._buffers.values() if b is not None):
            return
        with torch.device("cpu"):
            fresh = type(rotary)(getattr(rotary, "config", self.config))
        for name, buffer in self._buffers.items():
            value = fresh._buffers.get(name)
            if buffer is not None and value is not None:
                buffer.copy_(value)

    def extra_repr(self) -> str:
        rotary = "rotary, " if self.hf_rotary is not None else ""
        return f"{type(self.hf_layer).__name__}, {rotary}{self.attention_type}"
