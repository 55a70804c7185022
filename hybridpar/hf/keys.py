"""Names of the `to_sequential` layout against Hugging Face's, both ways, for whole state dicts."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from hybridpar.hf.glue import GLUE, Glue, glue_of
from hybridpar.hf.structure import config_value, num_layers, structure_of
from hybridpar.moe.hub_names import (
    Merge,
    Piece,
    fuse_experts,
    merges,
    piece_view,
    pieces_of,
    split_name,
)

__all__ = ["FileNames", "KeyMap", "as_saved", "hf_file_names", "hf_state_dict", "key_map",
           "plain_file_names", "sequential_state_dict"]

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
                 ignored: tuple[str, ...] = (), renames: tuple[tuple[str, str], ...] = (),
                 merges: tuple[Merge, ...] = ()) -> None:
        self.pairs = pairs
        self.base = base        # "model." / "transformer.": a bare decoder's names lack it
        self.tied = tied        # (head key, embedding key) in HF names, when tied
        self.ignored = [re.compile(p) for p in ignored]
        self.renames = [(re.compile(p), r) for p, r in renames]   # checkpoint -> model names
        self.merges = merges    # experts stored one by one (`hybridpar.moe.hub_names`)
        plain = [(p, r, _plain(p)) for p, r in renames]
        self.reverse = [(re.compile(("^" if p.startswith("^") else "") + re.escape(r)), text)
                        for p, r, text in plain if text is not None]

    def to_hf(self, name: str) -> str:
        """The Hugging Face name of a Sequential state-dict name (``KeyError`` if none)."""
        return self._map(name, 0, 1, "Sequential")

    def from_file(self, name: str) -> str:
        """The model's Hugging Face name of a checkpoint's (transformers' renames: GPT-NeoX's
        ``embed_out.``, Mixtral's ``block_sparse_moe.``)."""
        for pattern, target in self.renames:
            name = pattern.sub(target, name)
        return name

    def to_file(self, name: str) -> str:
        """A checkpoint's name of the model's Hugging Face name, as ``save_pretrained`` writes
        it (the renames undone, those whose pattern is a plain string)."""
        for pattern, target in reversed(self.reverse):
            name = pattern.sub(target, name)
        return name

    def saved(self, name: str, experts: int) -> list[tuple[str, Piece | None]]:
        """What ``save_pretrained`` writes for the model's Hugging Face tensor `name`: its
        checkpoint name, or one per expert and part of fused experts (`experts`: E), each
        with its `Piece` (`piece_view` takes it from the tensor)."""
        pieces = pieces_of(name, range(experts), self.merges)
        if pieces is None:
            return [(self.to_file(name), None)]
        return [(self.to_file(p.name), p) for p in pieces]

    def from_hf(self, name: str) -> str:
        """The Sequential name of a Hugging Face name; a bare decoder's (no base prefix) and a
        checkpoint's older one (`from_file`) too."""
        name = self.from_file(name)
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


def _plain(pattern: str) -> str | None:
    """The text a rename's `pattern` matches when it is a plain string (``^`` allowed first;
    ``\\.`` a dot), else None."""
    body = pattern.removeprefix("^")
    if not re.fullmatch(r"(?:[\w.-]|\\.)*", body):
        return None
    return re.sub(r"\\(.)", r"\1", body)


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
                  ignored=parts.ignored, renames=parts.renames, merges=merges(config))


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
    leaves it out) is the embedding's tensor; experts stored one by one are fused (each one
    present, or a `ValueError` naming the first missing).
    """
    names = key_map(config)
    hf = fuse_experts({names.from_file(k): v for k, v in state_dict.items()
                       if not names.is_ignored(k)}, names.merges, named=names.to_file)
    if names.tied is not None:
        head, embedding = names.tied
        bare = embedding[len(names.base):]
        source = embedding if embedding in hf else bare if bare in hf else None
        if head not in hf and source is not None:
            hf[head] = hf[source]
    return {names.from_hf(k): v for k, v in hf.items()}


def _candidates(key: str, names: KeyMap, others: list[str]) -> list[str]:
    """The checkpoint names `key`'s tensor may be stored under, in order of preference: as
    ``save_pretrained`` writes it (`KeyMap.to_file`), then as the model names it."""
    hf = [names.to_hf(key)]
    if names.tied is not None and hf[0] == names.tied[0]:
        hf.append(names.tied[1])                  # the head: save_pretrained omits it
    hf += [names.to_hf(other) for other in others]
    hf += [h.removeprefix(names.base) for h in hf if h.startswith(names.base)]   # bare decoder
    return list(dict.fromkeys([names.to_file(h) for h in hf] + hf))


@dataclass(frozen=True)
class FileNames:
    """How the model's (Sequential) names are found in the files: all a source decides."""

    #: ``(name, its tie's other names)`` -> the names it may be stored under, preferred first
    candidates: Callable[[str, list[str]], list[str]]
    #: ``(name, experts)`` -> the per-expert tensors a fused one is stored under, in the files'
    #: names with `hybridpar.moe.hub_names.Piece` s (None: not a fused experts' tensor)
    pieces: Callable[[str, range], list[tuple[str, Any]] | None]
    #: a model name as an error gives it (with its name in the files)
    describe: Callable[[str], str]
    #: ``(every key of the model, the files' names)`` -> the files' names the model lacks
    unexpected: Callable[[list[str], Iterable[str]], list[str]]
    #: what the model was built from, as errors name it ("config.json", "model 'gpt'")
    model: str
    #: what a file's extra tensor or a shape mismatch means (the end of those errors)
    extra_hint: str
    shape_hint: str


def hf_file_names(config: Any) -> FileNames:
    """A Hugging Face checkpoint's names: `key_map(config)`, ties, bare decoders, renames
    (`KeyMap.to_file`), experts stored one by one (`hybridpar.moe.hub_names`)."""
    names = key_map(config)
    desc = "config.json" if isinstance(config, dict) else type(config).__name__
    found = names.merges
    n_experts = int(config_value(config, "num_local_experts", "num_experts", default=0))

    def pieces(key: str, experts: range) -> list[tuple[str, Any]] | None:
        split = pieces_of(names.to_hf(key), experts, found)
        return None if split is None else [(names.to_file(p.name), p) for p in split]

    def unexpected(model_keys: list[str], held: Iterable[str]) -> list[str]:
        try:
            wanted = {names.to_hf(k) for k in model_keys}
        except KeyError as error:
            raise ValueError(f"the model's names do not map to {desc}'s: {error}; load into a "
                             "Sequential that hybridpar.hf.to_sequential made") from None

        def known(name: str) -> bool:
            for model in {name, names.from_file(name)}:
                if model in wanted or names.base + model in wanted:
                    return True
                split = split_name(model, found)
                if split is not None and split[0] in wanted and split[1].expert < n_experts:
                    return True
            return False

        return [k for k in held if not names.is_ignored(k) and not known(k)]

    return FileNames(
        candidates=lambda key, others: _candidates(key, names, others), pieces=pieces,
        describe=lambda key: f"{names.to_file(names.to_hf(key))} (the model's {key})",
        unexpected=unexpected, model=desc,
        extra_hint="the checkpoint and its config.json disagree (layer count, biases, tied "
                   "embeddings, experts)",
        shape_hint="the weights and config.json disagree (hidden size, head counts, "
                   "head_dim, vocab)")


def plain_file_names(model: str) -> FileNames:
    """`hybridpar export`'s names: the Sequential's own, every name of a tie written."""
    return FileNames(
        candidates=lambda key, others: [key, *others], pieces=lambda key, experts: None,
        describe=lambda key: key,
        unexpected=lambda model_keys, held: [k for k in held if k not in set(model_keys)],
        model=model,
        extra_hint="the export is of another model (layer count, sizes, biases)",
        shape_hint="the export is of another model size (width, heads, vocab)")


def as_saved(entries: list[tuple[str, str]], infos: list[tuple[torch.dtype, torch.Size]],
              tensors: Iterator[Tensor | None], config: Any
              ) -> tuple[list[tuple[str, int]], Iterator[Tensor | None]]:
    """The sizes and tensors of `entries` (one full tensor each, `infos` its dtype and shape)
    under the names ``save_pretrained`` writes (`KeyMap.saved`: renames undone, fused experts
    one expert and part at a time)."""
    keys = key_map(config)
    saved = [keys.saved(name, shape[0] if len(shape) else 0)
             for (name, _), (_, shape) in zip(entries, infos)]
    sizes = [(file_name, shape.numel() * dtype.itemsize // (
        shape[0] * piece.parts if piece is not None else 1))
        for names, (dtype, shape) in zip(saved, infos) for file_name, piece in names]

    def pieces() -> Iterator[Tensor | None]:
        for names in saved:   # (not zip: its cached tuple would hold the last tensor)
            full = next(tensors)
            for _, piece in names:
                yield full if piece is None or full is None else piece_view(full, piece).clone()
            del full   # (before the next one arrives: one full tensor held at a time)

    return sizes, pieces()
