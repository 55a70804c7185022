"""Training windows of a token folder: seq_len + 1 tokens read through its memmaps, resumable.

A split's shards are cut into windows shard by shard: window j of a shard of n tokens starts
at token j * T (T = seq_len) and holds T + 1 tokens (x = its first T, y = its last T), for
j < (n - 1) // T; the tail of a shard too short for a window is not trained on. Windows do
not cross shards, and may cross documents (each ends with the EOS id, as in GPT-2 training).
The windows are numbered over the shards in order; epoch e visits them in the order
``randperm(windows, generator seeded with seed + e)`` (`WindowOrder`), a global batch is the next
`batch_size` of that endless stream, and replica r of dp keeps rows [r * B / dp, (r+1) * B / dp).

    shards of 9 and 7 tokens, T = 4:   shard 0 | w0 = t[0:5]  w1 = t[4:9]
                                       shard 1 | w2 = t[0:5]  (t[4:7] too short: skipped)

The position (epoch, index into its order) is the same on every replica and independent of
dp, so a resume under another dp continues the same sequence. Only a rank that reads opens
the shards (`open_tokens`, on its first batch): inputs on the first pipeline stage, targets
on the last; another rank moves the position alone and gets zeros of the batch's shape.

``pack=True`` (``data.pack = "documents"``) gives each window's document positions with its
inputs, x = (ids, positions): from the shard's .idx (the documents' end offsets, not the EOS
ids, which a document's own text may hold), 0 at each document start and at the window's
first token (a document that began in the window before restarts: the window holds its
tail as a document of its own, which is what that tail run alone computes;
`document_positions`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hybridpar.data.shards import SPLITS, Shard, TokenFolder, open_tokens

__all__ = ["IGNORE_INDEX", "OVERLONG", "PaddedExamples", "TokenWindows", "WindowOrder",
           "check_folder", "document_positions", "no_val_window"]

IGNORE_INDEX = -100     # a target the loss does not count (the losses' ignore_index)
OVERLONG = ("truncate", "drop")     # data.pack = "pad": a document longer than seq_len + 1


def check_folder(path: str | os.PathLike[str]) -> TokenFolder:
    """The folder's meta.json and file sizes checked, nothing mapped (``splits`` is empty)."""
    return open_tokens(path, mmap=False)


def no_val_window(folder: TokenFolder, seq_len: int) -> str | None:
    """Why the val split of `folder` has no window of ``seq_len + 1`` tokens (a clause naming
    the folder and the fix), or None when it has one; meta.json only."""
    counts = [int(s["tokens"]) for s in folder.meta["splits"]["val"]["shards"]]
    if any((n - 1) // seq_len > 0 for n in counts):
        return None
    fraction = folder.meta.get("split", {}).get("val_fraction")
    why = (f"it was tokenized with --val-fraction {fraction}" if fraction == 0 else
           f"its val split holds {sum(counts):,} tokens in {len(counts)} shard(s)")
    return (f"the token folder {str(folder.path)!r} has no validation window of data.seq_len "
            f"+ 1 = {seq_len + 1} tokens ({why}); tokenize it again with --val-fraction > 0 "
            "(e.g. 0.05)")


def document_positions(ends: np.ndarray, start: int, length: int) -> np.ndarray:
    """Positions ``(length,)`` int64 of tokens ``start .. start + length - 1`` of a shard whose
    documents end at `ends` (its .idx): 0 at the first token and at each document start.

        ends 3 5 9, start 2, length 6:   token     2 3 4 5 6 7
                                         document  0 1 1 2 2 2
                                         position  0 0 1 0 1 2   (token 2: the window's first)
    """
    tokens = np.arange(start, start + length, dtype=np.uint64)              # (length,)
    ended = np.searchsorted(ends, tokens, side="right")    # documents ended by each token
    begins = np.where(ended > 0, ends[np.maximum(ended - 1, 0)], 0).astype(np.int64)
    return tokens.astype(np.int64) - np.maximum(begins, start)              # (length,)


class WindowOrder:
    """Epoch e visits window ids ``randperm(windows, generator seeded with seed + e)``; the
    stream runs on into the next epoch. A subclass calls `place`, sets ``windows`` and calls
    `start_order`; (``epoch``, ``index`` into its order) is the position it saves."""

    windows: int
    seed: int
    epoch: int
    index: int
    folder: TokenFolder
    unit = "windows"        # what the ids count, for the messages
    kind: tuple[tuple[str, str], ...] = ()   # what tells these batches from windows

    def place(self, folder: TokenFolder, split: str, *, seq_len: int, seed: int,
              batch_size: int, dp_rank: int, dp: int, inputs: bool, targets: bool) -> None:
        """Set what every batch of a split of `folder` shares: this replica's share of the
        global batch, and what this rank reads (x with `inputs`, y with `targets`)."""
        if dp < 1 or not 0 <= dp_rank < dp or batch_size < 1 or batch_size % dp:
            raise ValueError(f"batch_size={batch_size} over dp={dp} (dp_rank={dp_rank}): use a "
                             f"positive multiple of dp and 0 <= dp_rank < dp")
        self.folder, self.split, self.seq_len, self.seed = folder, split, seq_len, seed
        self.global_batch, self.batch_size = batch_size, batch_size // dp
        self.dp_rank, self.dp = dp_rank, dp
        self.inputs, self.targets = inputs, targets

    @property
    def reads(self) -> bool:
        return self.inputs or self.targets

    def identity(self) -> dict[str, Any]:
        """What the batches are: the tokens' fingerprint, the tokenizer's hash, seq_len, seed
        (and `kind`): a resume compares it."""
        return {"fingerprint": self.folder.fingerprint,
                "tokenizer": str(self.folder.meta["tokenizer"]["sha256"]),
                "seq_len": self.seq_len, "seed": self.seed, **dict(self.kind)}

    def start_order(self) -> None:
        """Position 0 of epoch 0."""
        self.epoch, self.index = 0, 0
        self._order_epoch, self._order = -1, torch.empty(0, dtype=torch.int64)

    def order(self, epoch: int) -> Tensor:
        """The window ids of `epoch` in visiting order: ``(windows,)``."""
        if epoch != self._order_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._order, self._order_epoch = torch.randperm(self.windows, generator=g), epoch
        return self._order

    def state_dict(self) -> dict[str, int]:
        """The position: ``{"epoch", "index"}`` (plain ints, the same on every replica)."""
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict`: the next batch is the one that followed it."""
        epoch, index = state.get("epoch"), state.get("index")
        for key, value in (("epoch", epoch), ("index", index)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"data state {dict(state)!r} has no valid {key!r} (an integer "
                                 ">= 0); was it saved by a different kind of batches?")
        assert isinstance(epoch, int) and isinstance(index, int)
        if index >= self.windows:
            raise ValueError(f"data state index={index} is past the {self.windows} {self.unit} "
                             f"of {self.folder.path}; did the corpus or seq_len change?")
        self.epoch, self.index = epoch, index

    def _take(self, count: int) -> Tensor:
        """The next `count` window ids of the stream, advancing the position."""
        parts = []
        while count:
            n = min(count, self.windows - self.index)
            parts.append(self.order(self.epoch)[self.index:self.index + n])
            self.index, count = self.index + n, count - n
            if self.index == self.windows:
                self.epoch, self.index = self.epoch + 1, 0
        return torch.cat(parts)


class TokenWindows(WindowOrder):
    """This replica's batches of the windows of one split of a token folder (see the module).

    `folder`: a `check_folder` or `open_tokens` result; `inputs` / `targets`: whether this
    rank reads x / y (a rank with neither opens no shard). `opened` counts shard openings.
    `pack`: x is (ids, document positions), see the module.
    """

    def __init__(self, folder: TokenFolder, split: str = "train", *, seq_len: int,
                 batch_size: int, seed: int = 0, dp_rank: int = 0, dp: int = 1,
                 inputs: bool = True, targets: bool = True, pack: bool = False) -> None:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        self.place(folder, split, seq_len=seq_len, seed=seed, batch_size=batch_size,
                   dp_rank=dp_rank, dp=dp, inputs=inputs, targets=targets)
        self.pack = pack
        counts = [int(s["tokens"]) for s in folder.meta["splits"][split]["shards"]]
        per = np.array([max(n - 1, 0) // seq_len for n in counts], dtype=np.int64)  # (shards,)
        self.ends = np.cumsum(per)   # shard s holds window ids [ends[s - 1], ends[s])
        self.windows = int(self.ends[-1]) if len(per) else 0
        if self.windows == 0:
            longest = max(counts, default=0)
            raise ValueError(f"the {split} split of {folder.path} has no window of seq_len + 1 "
                             f"= {seq_len + 1} tokens (its longest shard holds {longest}); use "
                             "a shorter data.seq_len or a larger corpus"
                             + (" (or more --val-fraction)" if split == "val" else ""))
        self.opened = 0
        self._shards: list[Shard] | None = None
        self.start_order()

    def shards(self) -> list[Shard]:
        """The split's shards, memory-mapped on the first call."""
        if self._shards is None:
            self._shards = open_tokens(self.folder.path).splits[self.split]
            self.opened += 1
        return self._shards

    def _place(self, i: int) -> tuple[Shard, int]:
        """Window `i`'s shard and first token in it."""
        s = int(np.searchsorted(self.ends, i, side="right"))
        return self.shards()[s], (i - (int(self.ends[s - 1]) if s else 0)) * self.seq_len

    def window(self, i: int) -> np.ndarray:
        """Window `i`: ``(seq_len + 1,)`` of the shard's dtype, read through its memmap."""
        shard, start = self._place(i)
        return np.asarray(shard.tokens[start:start + self.seq_len + 1])

    def counted(self, i: int) -> np.ndarray:
        """The loss mask of window `i`'s targets (a folder of conversations): ``(seq_len,)``
        bool, True where the loss counts the target token."""
        shard, start = self._place(i)
        assert shard.mask is not None
        return np.asarray(shard.mask[start + 1:start + self.seq_len + 1]) != 0

    def positions(self, i: int) -> np.ndarray:
        """The document positions of window `i`'s inputs: ``(seq_len,)`` int64."""
        shard, start = self._place(i)
        return document_positions(shard.ends, start, self.seq_len)

    def next_batch(self) -> tuple[Tensor | tuple[Tensor, Tensor], Tensor]:
        """This replica's (x, y), each ``(batch_size / dp, seq_len)`` int64; y is x shifted.

        A folder of conversations has `IGNORE_INDEX` in y where its loss mask is 0. With
        `pack`, x is (ids, positions), both of that shape. On a rank that reads neither,
        zeros of the shapes (the pipe needs the shapes only); positions only where x is read.
        """
        ids = self._take(self.global_batch)                              # (B,)
        b, r = self.batch_size, self.dp_rank
        zeros = torch.zeros(b, self.seq_len, dtype=torch.int64)          # (B / dp, T)
        if not self.reads:
            return ((zeros, zeros.clone()) if self.pack else zeros), zeros.clone()
        mine = [int(i) for i in ids[r * b:(r + 1) * b]]
        rows = np.stack([self.window(i) for i in mine])
        chunk = torch.from_numpy(rows.astype(np.int64))                  # (B / dp, T + 1)
        x, y = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()     # (B / dp, T) twice
        if self.targets and self.folder.masked:
            counted = torch.from_numpy(np.stack([self.counted(i) for i in mine]))
            y = y.masked_fill(~counted, IGNORE_INDEX)                    # (B / dp, T)
        if not self.pack:
            return x, y
        positions = torch.from_numpy(np.stack([self.positions(i) for i in mine])) \
            if self.inputs else zeros                                    # (B / dp, T)
        return (x, positions), y

    def __iter__(self) -> Iterator[tuple[Tensor | tuple[Tensor, Tensor], Tensor]]:
        return self

    def __next__(self) -> tuple[Tensor | tuple[Tensor, Tensor], Tensor]:
        return self.next_batch()


class PaddedExamples(WindowOrder):
    """One document per row (``data.pack = "pad"``): this replica's rows of each global batch,
    padded on the right to the batch's longest, the padding's targets `IGNORE_INDEX`.

    The documents of the split are visited in the seeded order of `WindowOrder`. A document
    of n tokens gives n - 1 (input, target) pairs; past ``seq_len`` it is cut to its first
    ``seq_len + 1`` tokens (``overlong="truncate"``) or left out (``"drop"``), both counted
    (`truncated`, `dropped`). A batch's length L is its longest row rounded up to
    `multiple` (the layout's need, e.g. tp under sequence parallelism), the same on every
    replica (every rank reads the documents' lengths, from the .idx files), so the stages'
    shapes agree; it may change from batch to batch. The padding goes after each document:
    causal attention never reaches it from a real token, and its targets count for nothing.
    Targets a loss mask leaves out are `IGNORE_INDEX` too.

        documents of 4, 6, 3 tokens, B = 3:  x  a a a .     y  a a a -
                                                 b b b b b       b b b b b
                                                 c c . .         c c - -   (L = 5)
    """

    unit = "documents"
    kind = (("pack", "pad"),)   # in the identity: windows and rows are other batches

    def __init__(self, folder: TokenFolder, split: str = "train", *, seq_len: int,
                 batch_size: int, seed: int = 0, dp_rank: int = 0, dp: int = 1,
                 inputs: bool = True, targets: bool = True, multiple: int = 1,
                 overlong: str = "truncate") -> None:
        if overlong not in OVERLONG:
            raise ValueError(f"overlong must be one of {', '.join(OVERLONG)}, got {overlong!r}")
        if seq_len < 1 or multiple < 1:
            raise ValueError(f"seq_len and multiple must be positive, got {seq_len}, {multiple}")
        self.place(folder, split, seq_len=seq_len, seed=seed, batch_size=batch_size,
                   dp_rank=dp_rank, dp=dp, inputs=inputs, targets=targets)
        self.multiple = multiple
        self.shards = open_tokens(folder.path).splits[split]   # every rank: the lengths
        sizes = [np.diff(np.asarray(s.ends, dtype=np.int64), prepend=0) for s in self.shards]
        where = [(k, int(e) - int(n)) for k, (s, z) in enumerate(zip(self.shards, sizes))
                 for e, n in zip(np.asarray(s.ends), z)]                  # (shard, start)
        pairs = np.concatenate(sizes) - 1 if sizes else np.zeros(0, dtype=np.int64)
        keep = (pairs >= 1) & ((pairs <= seq_len) if overlong == "drop" else True)
        self.dropped = int(((pairs > seq_len) & (overlong == "drop")).sum())
        self.truncated = int(((pairs > seq_len) & (overlong == "truncate")).sum())
        self.places = [w for w, k in zip(where, keep) if k]
        self.pairs = np.minimum(pairs[keep], seq_len)                    # (documents,)
        self.windows = len(self.places)
        if self.windows == 0:
            raise ValueError(f"the {split} split of {folder.path} has no document of 2 tokens "
                             f"or more" + (f" and at most seq_len + 1 = {seq_len + 1}"
                                           if overlong == "drop" else "")
                             + "; give more documents, or data.overlong = 'truncate'")
        self.start_order()

    def document(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Document `i`'s first ``pairs + 1`` tokens and their loss mask (None: all count)."""
        k, start = self.places[i]
        shard, n = self.shards[k], int(self.pairs[i]) + 1
        mask = None if shard.mask is None else np.asarray(shard.mask[start:start + n]) != 0
        return np.asarray(shard.tokens[start:start + n]).astype(np.int64), mask

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """This replica's (x, y), each ``(batch_size / dp, L)`` int64 (see the class)."""
        ids = [int(i) for i in self._take(self.global_batch)]            # (B,)
        longest = max(int(self.pairs[i]) for i in ids)
        length = -(-longest // self.multiple) * self.multiple              # L
        b, r = self.batch_size, self.dp_rank
        if not self.reads:                        # zeros of the shape the stages agree on
            zeros = torch.zeros(b, length, dtype=torch.int64)
            return zeros, zeros.clone()
        x = torch.full((b, length), self.folder.eos_id, dtype=torch.int64)  # (B / dp, L)
        y = torch.full((b, length), IGNORE_INDEX, dtype=torch.int64)
        for row, i in enumerate(ids[r * b:(r + 1) * b]):
            tokens, mask = self.document(i)
            n = len(tokens) - 1
            x[row, :n] = torch.from_numpy(tokens[:-1])
            target = torch.from_numpy(tokens[1:])
            if mask is not None:
                target = target.masked_fill(torch.from_numpy(~mask[1:]), IGNORE_INDEX)
            y[row, :n] = target
        return x, y

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        return self.next_batch()
