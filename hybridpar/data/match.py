"""Whether token ids fit a pretrained model: its own tokenizer's vocabulary against theirs.

A pretrained model's embedding row i was trained on the token its tokenizer calls i. Ids
made by another tokenizer index other rows (or none), and training on them quietly teaches
the model a scrambled language. The ids fit when every token of theirs has the same id in the
model's tokenizer (the same JSON is the quick case; the model's may have more tokens); byte
ids never fit a model with a tokenizer. A folder without tokenizer files cannot be compared.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from hybridpar.data.tokenizer import TokenizerSpec

__all__ = ["TOKENIZER_FILES", "has_tokenizer", "pretrained_mismatch"]

# the files of a save_pretrained folder that hold (or configure) its tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "spiece.model")


def has_tokenizer(folder: str | os.PathLike[str]) -> bool:
    """Whether the model folder `folder` holds a tokenizer of its own."""
    path = Path(folder)
    return path.is_dir() and any((path / name).is_file() for name in TOKENIZER_FILES)


def pretrained_mismatch(spec: TokenizerSpec, pretrained: str | os.PathLike[str]) -> str | None:
    """Why ids of the tokenizer `spec` do not fit the model folder `pretrained`, or None.

    None when that folder has no tokenizer files or its tokenizer cannot be loaded (nothing
    to compare), and when every token of `spec` has the same id there. Otherwise one clause
    naming both tokenizers, their sizes and a token they disagree on.
    """
    from hybridpar.data.tokenizer import _load_tokenizers

    if not has_tokenizer(pretrained):
        return None
    try:
        tok, text, _ = _load_tokenizers(os.fspath(pretrained))
    except ValueError:
        return None
    theirs = dict(tok.get_vocab(with_added_tokens=True))
    model = f"the tokenizer of model.pretrained {os.fspath(pretrained)!r} ({len(theirs)} tokens)"
    if spec.kind == "bytes":
        return f"byte ids 0-255 are not the ids of {model}"
    if hashlib.sha256(text.encode("utf-8")).hexdigest() == spec.sha256:
        return None
    from tokenizers import Tokenizer

    ours = Tokenizer.from_str(spec.json).get_vocab(with_added_tokens=True)
    bad = next(((t, i) for t, i in sorted(ours.items(), key=lambda x: x[1])
                if theirs.get(t) != i), None)
    if bad is None:
        return None
    token, i = bad
    there = theirs.get(token)
    return (f"the ids of tokenizer {spec.name!r} ({len(ours)} tokens) are not those of "
            f"{model}: token {token!r} is id {i} in the one and "
            + (f"id {there} in the other" if there is not None else "absent from the other"))
