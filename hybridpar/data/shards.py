"""Token folders: shard files written whole or not at all, meta.json, and `open_tokens`.

    OUT/
      meta.json          written last: its presence means the folder is complete
      tokenizer.json     the tokenizer itself (not for "bytes"), so OUT alone decodes
      train-00000.bin    token ids, uint16 or uint32, native byte order: np.memmap reads it
      train-00000.idx    uint64: the end offset in the .bin of each of its documents
      train-00001.bin ...
      val-00000.bin  val-00000.idx
      train-00000.mask   conversations only (version 2): uint8, 1 where the loss counts the token

Every document ends with the EOS id and lies in one shard; a shard holds whole documents
and is closed once it reaches `shard_tokens`. The folder is built as a hidden sibling
(`staging.staged_folder`), every file fsynced, then renamed to OUT in one step.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np

from hybridpar.data.tokenizer import Encoder, TokenizerSpec

__all__ = ["FORMAT", "MASKED_VERSION", "SPLITS", "VERSION", "Shard", "ShardWriter", "TokenFolder",
           "TokenFolderError", "open_tokens", "write_meta"]

FORMAT, VERSION = "hybridpar-tokens", 1
MASKED_VERSION = 2          # a folder with loss masks: a reader of version 1 must refuse it
SPLITS = ("train", "val")
_DTYPES = ("uint16", "uint32")


class TokenFolderError(ValueError):
    """A token folder is missing, incomplete or disagrees with its meta.json."""


class ShardWriter:
    """One split's shards: whole documents appended, a new file once `shard_tokens` are in."""

    def __init__(self, folder: Path, split: str, *, dtype: str, shard_tokens: int,
                 masks: bool = False) -> None:
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
        self.folder, self.split, self.dtype = folder, split, np.dtype(dtype)
        self.shard_tokens, self.masks = shard_tokens, masks
        self.shards: list[dict[str, Any]] = []
        self._bin: IO[bytes] | None = None
        self._idx: IO[bytes] | None = None
        self._mask: IO[bytes] | None = None
        self._hash, self._mask_hash = hashlib.sha256(), hashlib.sha256()
        self._tokens = self._documents = self._max = self._counted = 0

    def _open(self) -> None:
        stem = f"{self.split}-{len(self.shards):05d}"
        self._bin = open(self.folder / f"{stem}.bin", "wb")
        self._idx = open(self.folder / f"{stem}.idx", "wb")
        self._mask = open(self.folder / f"{stem}.mask", "wb") if self.masks else None
        self._hash, self._mask_hash = hashlib.sha256(), hashlib.sha256()
        self._tokens = self._documents = self._max = self._counted = 0

    def _close(self) -> None:
        assert self._bin is not None and self._idx is not None
        for f in (self._bin, self._idx, self._mask):
            if f is not None:
                f.flush()
                os.fsync(f.fileno())
                f.close()
        record = {"file": Path(self._bin.name).name, "index": Path(self._idx.name).name,
                  "tokens": self._tokens, "documents": self._documents,
                  "sha256": self._hash.hexdigest(), "max_id": self._max}
        if self._mask is not None:
            record.update(mask=Path(self._mask.name).name, counted=self._counted,
                          mask_sha256=self._mask_hash.hexdigest())
        self.shards.append(record)
        self._bin = self._idx = self._mask = None

    def write(self, ids: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None
              ) -> None:
        """Append documents: `ids` ``(sum(lengths),)`` of the dtype, `lengths` ``(docs,)``,
        and for a writer of masks their uint8 loss mask, shaped as `ids`."""
        if self.masks != (mask is not None):
            raise ValueError("a writer of masks takes a mask with every write, and only then")
        while len(lengths):
            if self._bin is None:
                self._open()
            assert self._bin is not None and self._idx is not None
            ends = self._tokens + np.cumsum(lengths, dtype=np.uint64)          # (docs,)
            # the documents up to the first that reaches shard_tokens fit this shard
            k = int(np.searchsorted(ends, self.shard_tokens, side="left")) + 1
            k = min(k, len(lengths))
            n = int(ends[k - 1]) - self._tokens
            part = np.ascontiguousarray(ids[:n], dtype=self.dtype)
            self._max = max(self._max, int(part.max()))   # the run's id check reads it
            chunk = part.data.cast("B")
            self._bin.write(chunk)
            self._hash.update(chunk)
            self._idx.write(ends[:k].tobytes())
            if mask is not None and self._mask is not None:
                bits = np.ascontiguousarray(mask[:n], dtype=np.uint8)
                self._mask.write(bits.data)
                self._mask_hash.update(bits.data)
                self._counted += int(bits.sum(dtype=np.int64))
                mask = mask[n:]
            self._tokens, self._documents = self._tokens + n, self._documents + k
            ids, lengths = ids[n:], lengths[k:]
            if self._tokens >= self.shard_tokens:
                self._close()

    def close(self) -> dict[str, Any]:
        """Finish the last shard; the split's meta.json record."""
        if self._bin is not None:
            self._close()
        return {"documents": sum(s["documents"] for s in self.shards),
                "tokens": sum(s["tokens"] for s in self.shards), "shards": self.shards}

    def abort(self) -> None:
        """Close the open files (their folder is about to be removed)."""
        for f in (self._bin, self._idx, self._mask):
            if f is not None:
                f.close()
        self._bin = self._idx = self._mask = None


def write_meta(folder: Path, meta: Mapping[str, Any]) -> None:
    """meta.json, fsynced: the last file of a token folder."""
    with open(folder / "meta.json", "w", encoding="utf-8") as f:
        f.write(json.dumps(meta, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())


class Shard(NamedTuple):
    """One shard file, memory-mapped: ``tokens[ends[i - 1]:ends[i]]`` is its document i."""

    path: Path
    tokens: np.ndarray      # (n,) uint16 | uint32, np.memmap
    ends: np.ndarray        # (documents,) uint64, np.memmap
    sha256: str
    mask: np.ndarray | None = None   # (n,) uint8, 1 where the loss counts: conversations only


@dataclass(frozen=True)
class TokenFolder:
    """A checked token folder: meta.json and each split's shards as memmaps."""

    path: Path
    meta: dict[str, Any]
    splits: dict[str, list[Shard]]

    @property
    def dtype(self) -> str:
        return str(self.meta["dtype"])

    @property
    def masked(self) -> bool:
        """Whether the folder holds loss masks (conversations): `Shard.mask` is set."""
        return int(self.meta["version"]) == MASKED_VERSION

    @property
    def vocab_size(self) -> int:
        return int(self.meta["tokenizer"]["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.meta["tokenizer"]["eos_id"])

    @property
    def fingerprint(self) -> str:
        """What the tokens are (tokenizer, EOS, every shard's hash): a resume checks it."""
        return str(self.meta["fingerprint"])

    def tokens(self, split: str = "train") -> int:
        return int(self.meta["splits"][split]["tokens"])

    def documents(self, split: str = "train") -> int:
        return int(self.meta["splits"][split]["documents"])

    @functools.cached_property
    def encoder(self) -> Encoder:
        """The folder's own tokenizer (its tokenizer.json, or bytes), loaded once."""
        info = self.meta["tokenizer"]
        text = ((self.path / "tokenizer.json").read_text(encoding="utf-8")
                if info["kind"] == "tokenizers" else "")
        return Encoder(TokenizerSpec(info["name"], info["kind"], info["vocab_size"],
                                     info["eos_id"], info.get("eos", ""), info["sha256"], text))

    def decode(self, ids: Any) -> str:
        """Token ids back to text with the folder's own tokenizer (special tokens kept)."""
        return self.encoder.decode(np.asarray(ids))


def _corrupt(folder: Path, what: str) -> TokenFolderError:
    return TokenFolderError(f"{folder / 'meta.json'} is corrupt: {what}; tokenize the corpus "
                            "again (hybridpar tokenize ... --overwrite)")


def _need(table: Any, key: str, kind: type | tuple[type, ...], folder: Path, at: str) -> Any:
    if not isinstance(table, dict) or key not in table:
        raise _corrupt(folder, f"{at.rstrip('.') or 'it'} has no {key!r}")
    value = table[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise _corrupt(folder, f"{at}{key} is {value!r}")
    return value


def _check_meta(folder: Path, meta: Any) -> None:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _corrupt(folder, f"its format is not {FORMAT!r}")
    if meta.get("version") not in (VERSION, MASKED_VERSION):
        raise TokenFolderError(f"{folder}: token folder version {meta.get('version')!r}, this "
                               f"hybridpar reads versions {VERSION} and {MASKED_VERSION}; "
                               "tokenize the corpus again")
    masked = meta["version"] == MASKED_VERSION
    if masked:
        _need(meta, "chat", dict, folder, "")
    tok = _need(meta, "tokenizer", dict, folder, "")
    for key in ("vocab_size", "eos_id"):
        _need(tok, key, int, folder, "tokenizer.")
    for key in ("kind", "sha256", "name"):
        _need(tok, key, str, folder, "tokenizer.")
    if _need(meta, "dtype", str, folder, "") not in _DTYPES:
        raise _corrupt(folder, f"dtype {meta['dtype']!r} is not one of {', '.join(_DTYPES)}")
    for key in ("fingerprint", "request"):
        _need(meta, key, str, folder, "")
    splits = _need(meta, "splits", dict, folder, "")
    for split in SPLITS:
        record = _need(splits, split, dict, folder, "splits.")
        at = f"splits.{split}."
        shards = _need(record, "shards", list, folder, at)
        for i, shard in enumerate(shards):
            for key in ("file", "index", "sha256"):
                _need(shard, key, str, folder, f"{at}shards[{i}].")
            for key in ("tokens", "documents"):
                if _need(shard, key, int, folder, f"{at}shards[{i}].") < 1:
                    raise _corrupt(folder, f"{at}shards[{i}].{key} is {shard[key]}")
            if "max_id" in shard and _need(shard, "max_id", int, folder, f"{at}shards[{i}].") < 0:
                raise _corrupt(folder, f"{at}shards[{i}].max_id is {shard['max_id']}")
            if masked:
                for key in ("mask", "mask_sha256"):
                    _need(shard, key, str, folder, f"{at}shards[{i}].")
                if not 0 <= _need(shard, "counted", int, folder, f"{at}shards[{i}]."
                                  ) <= shard["tokens"]:
                    raise _corrupt(folder, f"{at}shards[{i}].counted is {shard['counted']}")
        for key in ("tokens", "documents"):
            total = _need(record, key, int, folder, at)
            if total != sum(s[key] for s in shards):
                raise _corrupt(folder, f"{at}{key} = {total} is not the sum over its shards")


def _open_shard(folder: Path, shard: Mapping[str, Any], dtype: np.dtype, verify: bool,
                vocab_size: int, mmap: bool = True) -> Shard | None:
    path, index = folder / shard["file"], folder / shard["index"]
    masks = folder / shard["mask"] if "mask" in shard else None
    fix = "the file was truncated or changed; tokenize the corpus again (--overwrite)"
    files = [(path, shard["tokens"], dtype.itemsize, f"tokens of {dtype}"),
             (index, shard["documents"], 8, "document ends of uint64")]
    if masks is not None:
        files.append((masks, shard["tokens"], 1, "loss-mask bytes, one per token"))
    for file, n, item, what in files:
        if not file.is_file():
            raise TokenFolderError(f"{file} is missing, and meta.json lists it; tokenize the "
                                   "corpus again (--overwrite)")
        size = file.stat().st_size
        if size != n * item:
            raise TokenFolderError(f"{file} holds {size} bytes, but meta.json says {n} {what} "
                                   f"({n * item} bytes); {fix}")
    if not mmap:
        return None
    tokens = np.memmap(path, dtype=dtype, mode="r")
    ends = np.memmap(index, dtype=np.uint64, mode="r")
    if int(ends[-1]) != shard["tokens"] or (len(ends) > 1 and bool(np.any(ends[1:] < ends[:-1]))):
        raise TokenFolderError(f"{index}: its document ends do not run up to the {shard['tokens']}"
                               f" tokens of {path.name}; {fix}")
    if verify:
        digest = hashlib.sha256(np.ascontiguousarray(tokens).data.cast("B")).hexdigest()
        if digest != shard["sha256"]:
            raise TokenFolderError(f"{path}: its contents do not match meta.json's sha256; {fix}")
        top = int(tokens.max())
        if top >= vocab_size:
            raise TokenFolderError(f"{path} holds token id {top}, past the tokenizer's "
                                   f"{vocab_size} ids; {fix}")
    mask = None if masks is None else np.memmap(masks, dtype=np.uint8, mode="r")
    if verify and mask is not None:
        bits = np.ascontiguousarray(mask)
        if hashlib.sha256(bits.data).hexdigest() != shard["mask_sha256"]:
            raise TokenFolderError(f"{masks}: its contents do not match meta.json's "
                                   f"mask_sha256; {fix}")
        if int(bits.max()) > 1 or int(bits.sum(dtype=np.int64)) != shard["counted"]:
            raise TokenFolderError(f"{masks} is not a mask of 0 / 1 with the {shard['counted']} "
                                   f"counted tokens meta.json says; {fix}")
    return Shard(path, tokens, ends, shard["sha256"], mask)


def open_tokens(folder: str | os.PathLike[str], *, verify: bool = False,
                mmap: bool = True) -> TokenFolder:
    """The token folder of `hybridpar tokenize`, checked, its shards memory-mapped.

    Checks meta.json (format, version, every field) and each file's size against it, and the
    document ends; `verify` also reads every token: the shards' sha256 and their ids against
    the vocabulary size. ``mmap=False`` checks meta.json and the file sizes only and maps
    nothing (``splits`` is empty): what a rank that reads no tokens checks. Raises
    `TokenFolderError` naming the file and the fix.
    """
    path = Path(folder)
    if not path.is_dir():
        raise TokenFolderError(f"{path}: no such token folder; make one with hybridpar tokenize")
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise TokenFolderError(f"{path} has no meta.json: not a finished token folder (a run "
                               "that stopped early leaves none); tokenize the corpus again")
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _corrupt(path, f"not JSON ({e})") from None
    _check_meta(path, meta)
    dtype = np.dtype(meta["dtype"])
    if meta["tokenizer"]["kind"] == "tokenizers" and not (path / "tokenizer.json").is_file():
        raise TokenFolderError(f"{path / 'tokenizer.json'} is missing, and meta.json names a "
                               "tokenizers tokenizer; tokenize the corpus again (--overwrite)")
    opened = {split: [_open_shard(path, s, dtype, verify and mmap,
                                  meta["tokenizer"]["vocab_size"], mmap)
                      for s in meta["splits"][split]["shards"]] for split in SPLITS}
    splits = {split: [s for s in shards if s is not None] for split, shards in opened.items()
              } if mmap else {}
    return TokenFolder(path, meta, splits)
