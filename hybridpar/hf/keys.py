"""Names of the `to_sequential` layout against Hugging Face's, both ways, for whole state dicts."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from hybridpar.hf.glue import GLUE, Glue, glue_of
from hybridpar.hf.structure import config_value, num_layers, structure_of

__all__ = ["KeyMap", "hf_state_dict", "key_map", "sequential_state_dict"]

V = TypeVar("V")


class KeyMap:
    """Prefix pairs ``(sequential, hugging_face)``; a name maps by its longest matching prefix.

    Llama-style (L blocks)                  GPT-2
        "0."        model.embed_tokens.         "0.wte." / "0.wpe."  transformer.wte. / .wpe.
        "i."        model.layers.{i-1}.         "i."                 transformer.h.{i-1}.
        "{L+1}."    model.norm.                 "{L+1}."             transformer.ln_f.
        "{L+2}."    lm_head.                    "{L+2}."             lm_head.
    """

    def __init__(self, pairs: list[tuple[str, str]], *, base: str, tied: tuple[str, str] | None,
                 ignored: tuple[str, ...] = (), renames: tuple[tuple[str, str], ...] = ()
                 ) -> None:
        self.pairs = pairs
        self.base = base        # "model." / "transformer.": a bare decoder's names lack it
        self.tied = tied        # (head key, embedding key) in HF names, when tied
        self.ignored = [re.compile(p) for p in ignored]
        self.renames = [(re.compile(p), r) for p, r in renames]   # checkpoint -> model names

    def to_hf(self, name: str) -> str:
        """The Hugging Face name of a Sequential state-dict name (``KeyError`` if none)."""
        return self._map(name, 0, 1, "Sequential")

    def from_hf(self, name: str) -> str:
        """The Sequential name of a Hugging Face name; a bare decoder's (no base prefix) and a
        checkpoint's older one (transformers' renames: GPT-NeoX's ``embed_out.``) too."""
        for pattern, target in self.renames:
            name = pattern.sub(target, name)
        try:
            return self._map(name, 1, 0, "Hugging Face")
        except KeyError:
            if name.startswith(self.base):
                raise
            return self._map(self.base + name, 1, 0, "Hugging Face")

    def is_ignored(self, hf_name: str) -> bool:
        """Whether a checkpoint key holds no weight (a causal-mask or ``inv_freq`` buffer)."""
        return any(p.search(hf_name) for p in self.ignored)

    def _map(self, name: str, src: int, dst: int, what: str) -> str:
        best: tuple[str, str] | None = None
        for pair in self.pairs:
            if name.startswith(pair[src]) and (best is None or len(pair[src]) > len(best[src])):
                best = pair
        if best is None:
            raise KeyError(f"{name!r} is not a {what} name of this model "
                           f"(known prefixes: {', '.join(p[src] for p in self.pairs)})")
        return best[dst] + name[len(best[src]):]


def key_map(config: Any, *, glue: Sequence[Glue] = GLUE) -> KeyMap:
    """The `KeyMap` of a model's `to_sequential` layout (`config`: a config, model or dict)."""
    parts = structure_of(config)
    count = num_layers(config)
    base = parts.base + "."
    embedding = f"{base}{parts.embedding}."
    pairs: list[tuple[str, str]]
    if parts.learned_positions or len(parts.inputs) > 1 or glue_of(config, "input", glue=glue):
        pairs = [(f"0.{name}.", f"{base}{name}.") for name in parts.inputs]   # InputLayer
    else:
        pairs = [("0.", embedding)]
    pairs += [(f"{i + 1}.", f"{base}{parts.layers}.{i}.") for i in range(count)]
    head = f"{count + 2}.{parts.head}." if glue_of(config, "logits", glue=glue) \
        else f"{count + 2}."
    pairs += [(f"{count + 1}.", f"{base}{parts.norm}."), (head, f"{parts.head}.")]
    tied = config_value(config, "tie_word_embeddings", default=True)
    return KeyMap(pairs, base=base,
                  tied=(f"{parts.head}.weight", embedding + "weight") if tied else None,
                  ignored=parts.ignored, renames=parts.renames)


def hf_state_dict(state_dict: Mapping[str, V], config: Any) -> dict[str, V]:
    """A Sequential state dict under Hugging Face names (``load_state_dict(strict=True)`` takes it).

    A tied model's Sequential state dict holds the head under its own name too (as the HF
    model's does), so every HF key is present.
    """
    names = key_map(config)
    return {names.to_hf(k): v for k, v in state_dict.items()}


def sequential_state_dict(state_dict: Mapping[str, V], config: Any) -> dict[str, V]:
    """A Hugging Face state dict (or checkpoint) under the Sequential's names.

    Checkpoint keys that hold no weight (GPT-2's old ``attn.bias`` masks, ``inv_freq``) are
    dropped; names of a bare decoder (``embed_tokens.weight`` for ``model.embed_tokens.weight``)
    are accepted; with tied embeddings, a missing ``lm_head.weight`` (``save_pretrained``
    leaves it out) is the embedding's tensor.
    """
    names = key_map(config)
    hf = {k: v for k, v in state_dict.items() if not names.is_ignored(k)}
    if names.tied is not None:
        head, embedding = names.tied
        bare = embedding[len(names.base):]
        source = embedding if embedding in hf else bare if bare in hf else None
        if head not in hf and source is not None:
            hf[head] = hf[source]
    return {names.from_hf(k): v for k, v in hf.items()}
