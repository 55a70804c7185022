"""The batches of a run: byte tokens of a text or the stdlib corpus, a token folder's windows
(`hybridpar.data.windows`), or synthetic; resumable."""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hybridpar.data.ids import check_ids, model_vocab
from hybridpar.data.shards import TokenFolder, TokenFolderError
from hybridpar.data.windows import (
    PaddedExamples,
    TokenWindows,
    WindowOrder,
    check_folder,
    no_val_window,
)
from hybridpar.models import example_batch
from hybridpar.train.configs.config import Config

__all__ = ["SyntheticBatches", "TokenBatches", "byte_tokens", "decode", "default_corpus",
           "make_batches", "read_text", "split_tokens", "token_folder", "validation_problem"]

_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                        "__pycache__"})
_VAL_SEED_OFFSET = 2**31   # synthetic val seeds, apart from training (a CPU seed keeps 32 bits)


@functools.lru_cache(maxsize=4)
def default_corpus(max_bytes: int = 2_000_000) -> bytes:
    """The embedded corpus: the standard library's own ``.py`` sources, so no download is needed.

    Every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``, sorted by relative path
    (compared as a tuple of its parts), skipping site-packages, test directories, ``test_*.py``
    and files that cannot be read as UTF-8; each is preceded by ``# file: REL/PATH`` and a
    blank line, and the whole is cut at `max_bytes`. The same Python build gives the same bytes;
    computed once per process.
    """
    if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 1:
        raise ValueError(f"max_bytes must be a positive integer, got {max_bytes!r}")
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[tuple[str, ...]] = []
    for here, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        rel = Path(here).relative_to(root).parts
        files += [(*rel, n) for n in names if n.endswith(".py") and not n.startswith("test_")]
    out = bytearray()
    for parts in sorted(files):
        try:
            text = root.joinpath(*parts).read_bytes()
            text.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        out += f"# file: {'/'.join(parts)}\n\n".encode() + text + b"\n\n"
        if len(out) >= max_bytes:
            break
    if not out:
        raise ValueError(f"no readable .py files under the standard library at {root}; "
                         "use data.source = 'text' with data.path")
    return bytes(out[:max_bytes])


def read_text(path: str | os.PathLike[str]) -> bytes:
    """The bytes of the text file of ``data.source = 'text'``; a ValueError if missing or empty."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"data.path {str(path)!r}: no such file (relative paths are from the "
                         f"working directory {os.getcwd()})")
    data = file.read_bytes()
    if not data:
        raise ValueError(f"data.path {str(path)!r} is empty; give a text file with at least "
                         "seq_len + 1 bytes")
    return data


def byte_tokens(data: bytes) -> Tensor:
    """Bytes as token ids 0..255: ``(len(data),)`` int64."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def decode(ids: Tensor | list[int]) -> str:
    """Byte token ids back to text (invalid UTF-8, e.g. a cut character, becomes U+FFFD; so
    does an id past 255, which a model with a larger vocabulary can sample from bytes)."""
    values = ids.tolist() if isinstance(ids, Tensor) else ids
    if all(0 <= v < 256 for v in values):
        return bytes(values).decode("utf-8", errors="replace")
    return "".join(bytes(run).decode("utf-8", errors="replace") if ok else "\ufffd" * len(run)
                   for ok, run in _runs(values))


def _runs(values: list[int]) -> list[tuple[bool, list[int]]]:
    """`values` cut into runs of bytes (True) and of ids past a byte (False), in order."""
    out: list[tuple[bool, list[int]]] = []
    for v in values:
        ok = 0 <= v < 256
        if out and out[-1][0] == ok:
            out[-1][1].append(v)
        else:
            out.append((ok, [v]))
    return out


def split_tokens(tokens: Tensor, *, val_fraction: float) -> tuple[Tensor, Tensor]:
    """(train, val): the tail ``int(n * val_fraction)`` tokens are val, the rest train."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    cut = len(tokens) - int(len(tokens) * val_fraction)
    return tokens[:cut], tokens[cut:]


def _check_shard(batch_size: int, dp_rank: int, dp: int) -> None:
    if dp < 1 or not 0 <= dp_rank < dp:
        raise ValueError(f"dp_rank={dp_rank} is not a replica of dp={dp}; "
                         f"use 0 <= dp_rank < dp with dp >= 1")
    if batch_size < 1 or batch_size % dp:
        raise ValueError(f"batch_size={batch_size} is not divisible by dp={dp}; each replica "
                         f"takes batch_size / dp samples, so use a positive multiple of {dp}")


def _position(state: Mapping[str, Any], key: str) -> int:
    value = state.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"data state {dict(state)!r} has no valid {key!r} (an integer >= 0); "
                         "was it saved by a different kind of batches?")
    return value


class TokenBatches(WindowOrder):
    """Next-token windows of a token stream in an order fixed by the seed; dp-sharded, resumable.

    Window i of tokens t starts at i * T (T = seq_len): x = t[iT : iT+T], y = t[iT+1 : iT+T+1],
    so each epoch predicts every token after the first exactly once. Epoch e visits the windows
    in the order ``randperm(windows, generator seeded with seed + e)``; a global batch is the next
    `batch_size` windows of that endless stream (running on into the next epoch), and replica r
    of dp keeps its rows [r * B / dp, (r + 1) * B / dp) — together, the one-device batch.

    6 windows, batch_size=4, dp=2, seed=0 (epoch 0: 2 5 3 0 1 4, epoch 1: 1 5 2 0 3 4):

        step 0 | 2 5 | 3 0     (replica 0 | replica 1)
        step 1 | 1 4 | 1 5     epoch 0 ends after 1 4
        step 2 | 2 0 | 3 4

    The position (epoch, index into its order) is the same on every replica and independent
    of dp, so a `state_dict` resumes exactly, under the same or another dp.
    """

    def __init__(self, tokens: Tensor, *, seq_len: int, batch_size: int, seed: int = 0,
                 dp_rank: int = 0, dp: int = 1) -> None:
        _check_shard(batch_size, dp_rank, dp)
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if tokens.dim() != 1 or len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens cannot fill one window of seq_len + 1 = "
                             f"{seq_len + 1}; use a longer text or a shorter seq_len")
        self.tokens = tokens.to(torch.int64)              # (n,)
        self.seq_len, self.seed = seq_len, seed
        self.global_batch, self.batch_size = batch_size, batch_size // dp
        self.dp_rank, self.dp = dp_rank, dp
        self.windows = (len(tokens) - 1) // seq_len
        self.start_order()

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """This replica's (x, y), each ``(batch_size / dp, seq_len)`` int64; y is x shifted."""
        ids = self._take(self.global_batch)                              # (B,)
        b, r = self.batch_size, self.dp_rank
        starts = ids[r * b:(r + 1) * b] * self.seq_len                   # (B / dp,)
        rows = starts[:, None] + torch.arange(self.seq_len + 1)          # (B / dp, T + 1)
        chunk = self.tokens[rows]                                        # (B / dp, T + 1)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()     # (B / dp, T) twice

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"epoch", "index"}`` (plain ints, the same on every replica)."""
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict`: the next batch is the one that followed it."""
        epoch, index = _position(state, "epoch"), _position(state, "index")
        if index >= self.windows:
            raise ValueError(f"data state index={index} is past the {self.windows} windows of "
                             "this data; did the text, seq_len or val_fraction change?")
        self.epoch, self.index = epoch, index

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        return self.next_batch()


class SyntheticBatches:
    """Batch `step` is ``example_batch(name, batch_size, seed=seed + step, **model_args)``.

    Every replica makes the global batch and keeps rows [r * B / dp, (r + 1) * B / dp), so
    the union over replicas is the one-device batch; the position is the step.
    """

    def __init__(self, name: str, *, batch_size: int, seed: int = 0, dp_rank: int = 0,
                 dp: int = 1, model_args: Mapping[str, Any] | None = None) -> None:
        _check_shard(batch_size, dp_rank, dp)
        self.name, self.model_args = name, dict(model_args or {})
        self.seed, self.global_batch, self.batch_size = seed, batch_size, batch_size // dp
        self.dp_rank, self.dp, self.step = dp_rank, dp, 0
        example_batch(name, 1, seed=seed, **self.model_args)   # unknown name / option: fail now

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """This replica's (input, target), ``batch_size / dp`` rows of the model's batch."""
        x, y = example_batch(self.name, self.global_batch, seed=self.seed + self.step,
                             **self.model_args)                          # (B, ...), (B, ...)
        self.step += 1
        rows = slice(self.dp_rank * self.batch_size, (self.dp_rank + 1) * self.batch_size)
        return x[rows].contiguous(), y[rows].contiguous()                # (B / dp, ...)

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"step"}``."""
        return {"step": self.step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict`: the next batch is the one that followed it."""
        self.step = _position(state, "step")

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        return self.next_batch()


def token_folder(config: Config, *, ids: bool = False) -> TokenFolder:
    """The checked token folder of ``data.source = "tokens"`` (meta.json and file sizes; no
    shard mapped); with `ids`, also every shard's largest id against meta.json's and the
    model's vocabulary (`hybridpar.data.ids`: cached in the folder, so cheap after the
    first); a ValueError naming ``data.path`` and the fix."""
    if config.data.path is None:
        raise ValueError("data.path is required with data.source = 'tokens': a folder "
                         "written by hybridpar tokenize")
    try:
        folder = check_folder(config.data.path)
        if ids:
            check_ids(folder, model_vocab=model_vocab(config.model.args),
                      model=f"model {config.model.name!r}")
        return folder
    except TokenFolderError as e:
        raise ValueError(f"data.path {config.data.path!r}: {e}") from None


def validation_problem(config: Config) -> str | None:
    """Why ``split="val"`` of `config` has no batch (no window of ``data.seq_len + 1``
    tokens), as a clause naming the data and the fix; None when it has one. Cheap: it reads
    meta.json or a file's size, no token (the embedded corpus is made once per process)."""
    data = config.data
    seq_len = data.seq_len or config.model.args.get("block_size")
    if data.source == "synthetic" or not isinstance(seq_len, int) or seq_len < 1:
        return None
    if data.source == "tokens" and data.pack == "pad":   # a document per row: any will do
        folder = token_folder(config)
        return None if folder.documents("val") else (
            f"the token folder {str(folder.path)!r} has no validation document; tokenize it "
            "again with --val-fraction > 0 (e.g. 0.05)")
    if data.source == "tokens":
        return no_val_window(token_folder(config), seq_len)
    if data.source == "text" and data.path is not None:
        size, what = Path(data.path).stat().st_size, f"data.path {data.path!r}"
    elif data.source == "corpus":
        size, what = len(default_corpus()), "the embedded corpus"
    else:
        return None
    held = int(size * data.val_fraction)
    if held >= seq_len + 1:
        return None
    return (f"data.val_fraction = {data.val_fraction} holds out {held} bytes of {what}, "
            f"fewer than data.seq_len + 1 = {seq_len + 1}: no validation window; set a larger "
            "data.val_fraction")


def make_batches(config: Config, *, split: str = "train", dp_rank: int = 0, dp: int = 1,
                 inputs: bool = True, targets: bool = True
                 ) -> TokenBatches | SyntheticBatches | TokenWindows | PaddedExamples:
    """The batches of `config` for replica `dp_rank` of `dp`: ``train.batch_size`` is global.

    synthetic: `SyntheticBatches` of ``model.name`` (gpt: sequences of ``data.seq_len``);
    split="val" draws from seeds no training step uses. text / corpus: `TokenBatches` of the
    train head or the val tail (``data.val_fraction``) of the bytes. tokens: `TokenWindows`
    of the folder's split, which read x only with `inputs` and y only with `targets` (a rank
    with neither maps no shard and gets zeros of the batch's shape); with ``data.pack =
    "documents"`` x is (ids, document positions); ``"pad"``: `PaddedExamples`, a document per
    row. The train split's batches check every
    shard's ids first (`token_folder`): each rank makes them before step 1, so a shard of
    another tokenizer is an error on every rank then, not an IndexError when it is drawn.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    data, batch_size = config.data, config.train.batch_size
    _check_shard(batch_size, dp_rank, dp)
    seq_len = data.seq_len or config.model.args.get("block_size")
    if data.source == "tokens":
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"data.seq_len is not set and model {config.model.name!r} has no "
                             "block_size; set data.seq_len")
        folder = token_folder(config, ids=split == "train")
        if data.pack == "pad":
            par = config.parallel
            return PaddedExamples(folder, split, seq_len=seq_len, batch_size=batch_size,
                                  seed=data.seed, dp_rank=dp_rank, dp=dp, inputs=inputs,
                                  targets=targets, overlong=data.overlong,
                                  multiple=par.tp if par.sequence_parallel else 1)
        return TokenWindows(folder, split, seq_len=seq_len, batch_size=batch_size,
                            seed=data.seed, dp_rank=dp_rank, dp=dp, inputs=inputs,
                            targets=targets, pack=data.pack == "documents")
    if data.source == "synthetic":
        args = dict(config.model.args)
        if config.model.name == "gpt" and data.seq_len is not None:
            args["block_size"] = data.seq_len
        seed = data.seed + (_VAL_SEED_OFFSET if split == "val" else 0)
        return SyntheticBatches(config.model.name, batch_size=batch_size, seed=seed,
                                dp_rank=dp_rank, dp=dp, model_args=args)
    if data.source == "text":
        if data.path is None:
            raise ValueError("data.path is required with data.source = 'text'")
        raw, what = read_text(data.path), f"data.path {data.path!r}"
    elif data.source == "corpus":
        raw, what = default_corpus(), "the embedded corpus"
    else:
        raise ValueError(f"unknown data.source {data.source!r}; choose one of "
                         "'synthetic', 'text', 'corpus', 'tokens'")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"data.seq_len is not set and model {config.model.name!r} has no "
                         "block_size; set data.seq_len")
    train, val = split_tokens(byte_tokens(raw), val_fraction=data.val_fraction)
    tokens = train if split == "train" else val
    if len(tokens) < seq_len + 1:
        fix = ("a larger data.val_fraction, or train.eval_every = 0" if split == "val" else
               "a smaller data.val_fraction")
        raise ValueError(f"the {split} split of {what} has {len(tokens)} bytes, fewer than "
                         f"data.seq_len + 1 = {seq_len + 1}; use a longer text, a shorter "
                         f"data.seq_len, or {fix}")
    return TokenBatches(tokens, seq_len=seq_len, batch_size=batch_size, seed=data.seed,
                        dp_rank=dp_rank, dp=dp)
