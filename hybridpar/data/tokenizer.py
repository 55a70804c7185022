"""Tokenizers by name (bytes, a tokenizer.json, a Hugging Face folder), their EOS, hash, encoder.

    name                      ids                           end of document (EOS)
    "bytes"                   the UTF-8 bytes, 0-255        byte 0 (NUL), or `eos`: a byte
    path/tokenizer.json       `tokenizers`' BPE, WordPiece  a special token named EOS-like
    path/ (a model folder)    its tokenizer.json, else      its tokenizer_config.json's
                              transformers' AutoTokenizer   eos_token (or config.json's id)

`eos` names the token, by its id (digits) or its text, and overrides the default. Documents
are encoded without the tokenizer's own special tokens; `Encoder` puts the BOS (if any)
before each one and the EOS after it. `bos`: "auto" takes what the tokenizer's post-processor
puts before a text (Llama's ``<s>``; GPT-2's nothing), "yes" that or else the tokenizer's
BOS token by name, "no" none.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BOS_RULES", "Encoder", "TokenizerSpec", "bos_note", "dtype_for", "load_tokenizer"]

# special tokens taken as the end of document when nothing names one, in this order
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>",
              "<|end|>", "[SEP]", "<|eos|>")
# and as the start of document for bos="yes" when the post-processor adds none
_BOS_NAMES = ("<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>", "<|bos|>", "[CLS]")
BOS_RULES = ("auto", "yes", "no")


def dtype_for(vocab_size: int) -> str:
    """The narrowest unsigned dtype that holds every id below `vocab_size`: uint16 or uint32."""
    if vocab_size < 1 or vocab_size > 2**32:
        raise ValueError(f"vocab_size {vocab_size} does not fit uint32 token ids")
    return "uint16" if vocab_size <= 2**16 else "uint32"


@dataclass(frozen=True)
class TokenizerSpec:
    """A loaded tokenizer as plain data: what meta.json records and what a worker rebuilds."""

    name: str           # as given: "bytes" or a path
    kind: str           # "bytes" | "tokenizers"
    vocab_size: int     # the largest id + 1
    eos_id: int
    eos: str            # the EOS token's text
    sha256: str         # of `json` (tokenizers) or of "bytes"
    json: str = ""      # the tokenizers.Tokenizer as JSON ("" for bytes)
    bos: tuple[int, ...] = ()   # ids put before each document (`load_tokenizer`'s bos)
    bos_rule: str = "auto"

    @property
    def dtype(self) -> str:
        return dtype_for(self.vocab_size)

    def record(self) -> dict[str, Any]:
        """The meta.json entry: everything but the JSON itself."""
        return {"name": self.name, "kind": self.kind, "sha256": self.sha256,
                "vocab_size": self.vocab_size, "eos_id": self.eos_id, "eos": self.eos,
                "bos_ids": list(self.bos), "bos_rule": self.bos_rule}


def bos_note(record: dict[str, Any]) -> str:
    """One line for the log from meta.json's tokenizer record: what each document starts
    with, and why."""
    ids, rule = record.get("bos_ids", []), record.get("bos_rule", "auto")
    if not ids:
        why = {"no": "--bos no", "auto": "the tokenizer's post-processor adds none"}
        return (f"BOS: none before each document ({why.get(rule, rule)}"
                + ("; --bos puts the tokenizer's BOS token there" if record["kind"] != "bytes"
                   and rule == "auto" else "") + ")")
    what = "the tokenizer's post-processor adds it" if rule == "auto" else "--bos"
    return (f"BOS: ids {ids} before each document ({what}"
            + ("; --bos no for none" if rule == "auto" else "") + ")")


class Encoder:
    """Documents to one array of ids, an EOS after each; ids back to text."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec, self.dtype = spec, np.dtype(spec.dtype)
        self._eos, self._bos = [spec.eos_id], list(spec.bos)
        self._tok: Any = None
        if spec.kind == "tokenizers":
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_str(spec.json)

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, lengths): ``(sum(lengths),)`` of the dtype, and ``(len(texts),)`` int64 counts
        of each document's ids with its BOS (if any) and EOS."""
        if self._tok is None:
            raw = [t.encode("utf-8") for t in texts]
            lengths = np.fromiter((len(r) + 1 for r in raw), np.int64, len(raw))
            sep = bytes(self._eos)
            joined = sep.join(raw) + sep
            return np.frombuffer(joined, np.uint8).astype(self.dtype), lengths
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # < 0.20
        ids = [e.ids for e in encode(list(texts), add_special_tokens=False)]
        extra = len(self._bos) + 1
        lengths = np.fromiter((len(i) + extra for i in ids), np.int64, len(ids))
        flat = itertools.chain.from_iterable(x for i in ids for x in (self._bos, i, self._eos))
        return np.fromiter(flat, self.dtype, int(lengths.sum())), lengths

    def token_id(self, token: str) -> int | None:
        """The id of the token spelled `token` (a special one too), or None (bytes: none)."""
        found = self._tok.token_to_id(token) if self._tok is not None else None
        return None if found is None else int(found)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of `ids`, special tokens included (bytes: invalid UTF-8 becomes U+FFFD)."""
        values = [int(i) for i in ids]
        if self._tok is None:
            return bytes(values).decode("utf-8", errors="replace")
        return str(self._tok.decode(values, skip_special_tokens=False))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _folder_eos(folder: Path, tok: Any) -> int | None:
    """The EOS id a model folder names: tokenizer_config.json's eos_token, else an id."""
    token = _read_json(folder / "tokenizer_config.json").get("eos_token")
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str) and tok.token_to_id(token) is not None:
        return int(tok.token_to_id(token))
    for name in ("generation_config.json", "config.json"):
        value = _read_json(folder / name).get("eos_token_id")
        if isinstance(value, list) and value:
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _load_tokenizers(name: str) -> tuple[Any, str, Path | None]:
    """(tokenizers.Tokenizer, its JSON, the model folder or None) for a file or a folder."""
    from tokenizers import Tokenizer

    path = Path(name)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            file = path / "tokenizer.json"
        else:
            try:
                from transformers import AutoTokenizer

                auto = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            except Exception as e:   # transformers raises many kinds for a bad folder
                raise ValueError(f"tokenizer {name!r}: a folder without tokenizer.json, and "
                                 f"transformers cannot load it ({type(e).__name__}: {e}); give "
                                 "a folder saved by save_pretrained, or a tokenizer.json") from None
            backend = getattr(auto, "backend_tokenizer", None)
            if backend is None:
                raise ValueError(f"tokenizer {name!r} has no fast (tokenizers) version; save "
                                 "it with a tokenizer.json (AutoTokenizer(...).save_pretrained)")
            text = backend.to_str()
            return Tokenizer.from_str(text), text, path
    elif path.is_file():
        file = path
    else:
        raise ValueError(f"tokenizer {name!r}: no such file or folder; give 'bytes', a "
                         "tokenizer.json, or a Hugging Face model folder")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as e:   # tokenizers raises a bare Exception for a bad file
        raise ValueError(f"tokenizer {str(file)!r} is not a tokenizers JSON file ({e}); save "
                         "one with Tokenizer.save or save_pretrained") from None
    return tok, tok.to_str(), path if path.is_dir() else None


def _id_of(eos: str, vocab: dict[str, int], vocab_size: int, where: str,
           specials: list[str]) -> int:
    if eos.isdigit() and int(eos) < vocab_size:
        return int(eos)
    if eos in vocab and not eos.isdigit():
        return vocab[eos]
    raise ValueError(f"--eos {eos!r} is neither a token of {where} nor an id below "
                     f"{vocab_size}; name one of its tokens, e.g. its special ones: "
                     f"{', '.join(specials[:12]) or 'none'}")


def _bos(tok: Any, folder: Path | None, rule: str, name: str, specials: list[str]
         ) -> tuple[int, ...]:
    """The ids to put before each document under `rule` (see the module)."""
    if rule == "no":
        return ()
    bare = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    start = next((k for k in range(len(full) - len(bare) + 1)
                  if full[k:k + len(bare)] == bare), 0)
    if full[:start] or rule == "auto":          # what the post-processor puts before a text
        return tuple(full[:start])
    token = _read_json(folder / "tokenizer_config.json").get("bos_token") if folder else None
    if isinstance(token, dict):
        token = token.get("content")
    vocab = tok.get_vocab(with_added_tokens=True)
    for candidate in ([token] if isinstance(token, str) else []) + list(_BOS_NAMES):
        if candidate in vocab:
            return (int(vocab[candidate]),)
    raise ValueError(f"--bos: tokenizer {name!r} names no start-of-document token (its "
                     f"post-processor adds none, and none of its tokens is named "
                     f"{', '.join(_BOS_NAMES)}; its special tokens: "
                     f"{', '.join(specials[:12]) or 'none'}); leave out --bos")


def load_tokenizer(name: str | os.PathLike[str], *, eos: str | int | None = None,
                   bos: str = "auto") -> TokenizerSpec:
    """The tokenizer `name` as a `TokenizerSpec` (see the table at the top of this module)."""
    name = os.fspath(name)
    if bos not in BOS_RULES:
        raise ValueError(f"--bos {bos!r}: choose one of {', '.join(BOS_RULES)}")
    if name == "bytes":
        if bos == "yes":
            raise ValueError("--bos: the bytes tokenizer has no start-of-document token (its "
                             "ids are the 256 bytes); leave out --bos")
        if eos is None:
            eos_id = 0
        elif isinstance(eos, int) or eos.isdigit():
            eos_id = int(eos)
        elif len(eos.encode("utf-8")) == 1:
            eos_id = eos.encode("utf-8")[0]
        else:
            raise ValueError(f"--eos {eos!r}: the bytes tokenizer's end of document is one "
                             "byte; give an id 0-255 or a one-byte character such as '\\n'")
        if not 0 <= eos_id < 256:
            raise ValueError(f"--eos {eos_id} is not a byte; give an id 0-255")
        return TokenizerSpec("bytes", "bytes", 256, eos_id, chr(eos_id),
                             hashlib.sha256(b"bytes").hexdigest(), bos_rule=bos)
    tok, text, folder = _load_tokenizers(name)
    vocab = tok.get_vocab(with_added_tokens=True)
    vocab_size = max(vocab.values()) + 1
    specials = sorted(a.content for a in tok.get_added_tokens_decoder().values())
    if eos is not None:
        eos_id = _id_of(str(eos), vocab, vocab_size, name, specials)
    else:
        found = _folder_eos(folder, tok) if folder is not None else None
        if found is None:
            special = {a.content for a in tok.get_added_tokens_decoder().values() if a.special}
            found = next((vocab[t] for t in _EOS_NAMES if t in special), None)
        if found is None:
            raise ValueError(f"tokenizer {name!r} names no end-of-document token; pass --eos "
                             f"TOKEN (its special tokens: {', '.join(specials[:12]) or 'none'})")
        eos_id = found
    if not 0 <= eos_id < vocab_size:
        raise ValueError(f"the EOS id {eos_id} of {name!r} is outside its {vocab_size} ids; "
                         "pass --eos TOKEN")
    eos_text = tok.id_to_token(eos_id) or ""
    return TokenizerSpec(name, "tokenizers", vocab_size, eos_id, eos_text,
                         hashlib.sha256(text.encode("utf-8")).hexdigest(), text,
                         _bos(tok, folder, bos, name, specials), bos)
