"""Token folders: shard files written whole or not at all, meta.json, and `open_tokens`.

    OUT/
      meta.json          written last: its presence means the folder is complete
      tokenizer.json     the tokenizer itself (not for "bytes"), so OUT alone decodes
      train-00000.bin    token ids, uint16 or uint32, native byte order: np.memmap reads it
      train-00000.idx    uint64: the end offset in the .bin of each of its documents
      train-00001.bin ...
      val-00000.bin  val-00000.idx

Every document ends with the EOS id and lies in one shard; a shard holds whole documents
and is closed once it reaches `shard_tokens`. The folder is built as a hidden sibling
(``.OUT.PID.tmp``), every file fsynced, then renamed to OUT in one step; a killed run leaves
only that hidden folder (removed by the next run), never an OUT that looks complete.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

import numpy as np

from hybridpar.data.tokenizer import Encoder, TokenizerSpec
from hybridpar.io.files import fsync_dir

__all__ = ["FORMAT", "SPLITS", "VERSION", "FolderAppeared", "Shard", "ShardWriter", "TokenFolder",
           "TokenFolderError", "open_tokens", "staged_folder", "write_meta"]

FORMAT, VERSION = "hybridpar-tokens", 1
SPLITS = ("train", "val")
_DTYPES = ("uint16", "uint32")


class TokenFolderError(ValueError):
    """A token folder is missing, incomplete or disagrees with its meta.json."""


class ShardWriter:
    """One split's shards: whole documents appended, a new file once `shard_tokens` are in."""

    def __init__(self, folder: Path, split: str, *, dtype: str, shard_tokens: int) -> None:
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
        self.folder, self.split, self.dtype = folder, split, np.dtype(dtype)
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._bin: IO[bytes] | None = None
        self._idx: IO[bytes] | None = None
        self._hash = hashlib.sha256()
        self._tokens = self._documents = self._max = 0

    def _open(self) -> None:
        stem = f"{self.split}-{len(self.shards):05d}"
        self._bin = open(self.folder / f"{stem}.bin", "wb")
        self._idx = open(self.folder / f"{stem}.idx", "wb")
        self._hash, self._tokens, self._documents, self._max = hashlib.sha256(), 0, 0, 0

    def _close(self) -> None:
        assert self._bin is not None and self._idx is not None
        for f in (self._bin, self._idx):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        self.shards.append({"file": Path(self._bin.name).name, "index": Path(self._idx.name).name,
                            "tokens": self._tokens, "documents": self._documents,
                            "sha256": self._hash.hexdigest(), "max_id": self._max})
        self._bin = self._idx = None

    def write(self, ids: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: `ids` ``(sum(lengths),)`` of the dtype, `lengths` ``(docs,)``."""
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
        for f in (self._bin, self._idx):
            if f is not None:
                f.close()
        self._bin = self._idx = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FolderAppeared(FileExistsError):
    """The target of `staged_folder` was filled by someone else while this one was staged."""


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one step (Linux renameat2 RENAME_EXCHANGE); False where the system
    or the file system cannot (then nothing moved)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        rename = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, exchange = -100, 2
    if rename(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(code, f"cannot swap {a} and {b}: {os.strerror(code)}")


def _swap_in(tmp: Path, out: Path, *, replace: bool) -> bool:
    """Rename `tmp` to `out`; True when a non-empty `out` was replaced (only with `replace`).

    Without `replace`, a non-empty `out` (one that appeared since the caller looked) raises
    `FolderAppeared`: rename(2) refuses to put a folder onto a non-empty one, so there is no
    window between a check and the rename. With it, the two folders are exchanged in one
    step where the system can (a reader sees the old folder or the new, never none), else
    the old is moved aside first; `tmp` then holds the old folder, for the caller to remove.
    """
    try:
        os.replace(tmp, out)               # onto nothing, or an empty folder
        return False
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
    if not replace or not out.is_dir():
        raise FolderAppeared(f"{out} appeared while tokenizing (another hybridpar tokenize "
                             "writing the same folder?); not replacing it")
    if not _exchange(tmp, out):
        old = out.with_name(f".{out.name}.{os.getpid()}.old")
        os.replace(out, old)
        os.replace(tmp, out)
        os.replace(old, tmp)
    return True


@contextlib.contextmanager
def staged_folder(out: Path, *, replace: bool = False,
                  replaced: Callable[[], None] | None = None) -> Iterator[Path]:
    """A fresh hidden sibling of `out` to fill; renamed to `out` when the block ends cleanly.

    Removed instead when the block raises. Leftovers of killed runs (``.OUT.PID.tmp`` whose
    process is gone) are removed first. A non-empty `out` at the end (there before, or one
    that appeared meanwhile) is replaced only with `replace` (atomically where the system
    can: `_swap_in`), and `replaced` is called; without it, `FolderAppeared` is raised.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f".{out.name}.*.tmp"):
        pid = stale.name[len(out.name) + 2:-len(".tmp")]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        fsync_dir(tmp)
        if _swap_in(tmp, out, replace=replace) and replaced is not None:
            replaced()
        fsync_dir(out.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)   # what failed, or the folder replaced


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
    if meta.get("version") != VERSION:
        raise TokenFolderError(f"{folder}: token folder version {meta.get('version')!r}, this "
                               f"hybridpar reads version {VERSION}; tokenize the corpus again")
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
        for key in ("tokens", "documents"):
            total = _need(record, key, int, folder, at)
            if total != sum(s[key] for s in shards):
                raise _corrupt(folder, f"{at}{key} = {total} is not the sum over its shards")


def _open_shard(folder: Path, shard: Mapping[str, Any], dtype: np.dtype, verify: bool,
                vocab_size: int, mmap: bool = True) -> Shard | None:
    path, index = folder / shard["file"], folder / shard["index"]
    fix = "the file was truncated or changed; tokenize the corpus again (--overwrite)"
    for file, n, item, what in ((path, shard["tokens"], dtype.itemsize, f"tokens of {dtype}"),
                                (index, shard["documents"], 8, "document ends of uint64")):
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
    return Shard(path, tokens, ends, shard["sha256"])


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
