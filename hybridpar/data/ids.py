"""Each shard's largest token id, against the tokenizer's and the model's vocabulary.

A shard of another tokenizer (a folder mixing two tokenizers' shards, meta.json merged by
hand) holds ids past the vocabulary, and the embedding fails with a bare ``IndexError`` only
when a window of it is drawn, maybe hours in. `check_ids` compares every shard's largest id
with meta.json's ``tokenizer.vocab_size`` and the model's vocabulary before the first step,
naming the shard.

The largest id is computed once: `hybridpar tokenize` records it in meta.json (each shard's
``max_id``); for a folder written before that, it is a max over the shard's memmap, kept in
``max-ids.json`` next to the shards by file size and modification time (so a shard replaced
is read again). A folder that cannot be written computes it at each check.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from hybridpar.data.shards import SPLITS, TokenFolder, TokenFolderError
from hybridpar.io.files import atomic_write_text

__all__ = ["CACHE", "check_ids", "model_vocab", "shard_max_ids"]

CACHE = "max-ids.json"
_CHUNK = 1 << 26          # ids per read: a bounded pass over a memmap


def _stamp(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def _read_cache(folder: Path) -> dict[str, Any]:
    try:
        value = json.loads((folder / CACHE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _max_over(path: Path, dtype: str) -> int:
    tokens = np.memmap(path, dtype=dtype, mode="r")                 # (n,)
    return max(int(tokens[i:i + _CHUNK].max()) for i in range(0, len(tokens), _CHUNK))


def shard_max_ids(folder: TokenFolder) -> dict[str, int]:
    """The largest id of every shard of both splits, by file name (see the module)."""
    cache, dirty = _read_cache(folder.path), False
    out: dict[str, int] = {}
    for split in SPLITS:
        for shard in folder.meta["splits"][split]["shards"]:
            name = shard["file"]
            if isinstance(shard.get("max_id"), int):
                out[name] = shard["max_id"]
                continue
            path = folder.path / name
            stamp, seen = _stamp(path), cache.get(name)
            if isinstance(seen, dict) and seen.get("stamp") == stamp \
                    and isinstance(seen.get("max_id"), int):
                out[name] = seen["max_id"]
                continue
            out[name] = _max_over(path, folder.dtype)
            cache[name], dirty = {"stamp": stamp, "max_id": out[name]}, True
    if dirty:
        try:     # every rank may write it at once: each writes whole, the same values
            atomic_write_text(folder.path / CACHE, json.dumps(cache, indent=1) + "\n")
        except OSError:
            pass  # a read-only folder: computed again next time
    return out


def check_ids(folder: TokenFolder, *, model_vocab: int | None = None,
              model: str = "the model") -> None:
    """Raise `TokenFolderError` naming the first shard whose largest id is not below
    meta.json's vocabulary or `model_vocab` (the model's embedding rows)."""
    vocab = folder.vocab_size
    limits = [(vocab, f"the {vocab} ids of the folder's tokenizer "
                      f"({folder.meta['tokenizer']['name']}, meta.json)")]
    if model_vocab is not None:
        limits.append((model_vocab, f"the vocabulary of {model} (vocab_size={model_vocab})"))
    limit, whose = min(limits, key=lambda x: x[0])
    for name, top in shard_max_ids(folder).items():
        if top >= limit:
            raise TokenFolderError(
                f"{folder.path / name} holds token id {top}, past {whose}: it was not written "
                "by this folder's tokenizer (a folder mixing the shards of two tokenizers?) "
                "and would fail the embedding when drawn; tokenize the corpus again into one "
                "folder with one tokenizer (hybridpar tokenize ... -o NEW)")


def model_vocab(args: dict[str, Any]) -> int | None:
    """The vocabulary of a model's options: a ``pretrained`` folder's config.json (the model
    is built from it, whatever the other options say), else ``vocab_size``; None when
    neither says."""
    pretrained = args.get("pretrained")
    if isinstance(pretrained, str) and (Path(pretrained) / "config.json").is_file():
        try:
            value = json.loads((Path(pretrained) / "config.json").read_text()).get("vocab_size")
        except (OSError, ValueError):
            return None
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    value = args.get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


