"""Counting the bytes a rank reads from safetensors files: `counting_reads` wraps the
``safe_open`` of `hybridpar.hf.shard_load` (every per-rank load goes through it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hybridpar.hf import shard_load as shard_load_module


class Counting:
    """A ``safe_open`` handle that adds the bytes of every tensor read to `counter[0]`."""

    def __init__(self, handle, counter):
        self.handle, self.counter = handle, counter

    def __enter__(self):
        self.f = self.handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        return self._count(self.f.get_tensor(name))

    def get_slice(self, name):
        return CountingSlice(self.f.get_slice(name), self)

    def _count(self, t):
        self.counter[0] += t.numel() * t.element_size()
        return t


class CountingSlice:
    def __init__(self, inner, owner):
        self.inner, self.owner = inner, owner

    def get_shape(self):
        return self.inner.get_shape()

    def get_dtype(self):
        return self.inner.get_dtype()

    def __getitem__(self, index):
        return self.owner._count(self.inner[index])


@contextmanager
def counting_reads() -> Iterator[list[int]]:
    """``with counting_reads() as counter:`` the bytes read in the block, in ``counter[0]``."""
    counter = [0]
    opener = shard_load_module._safe_open
    shard_load_module._safe_open = lambda path: Counting(opener(path), counter)
    try:
        yield counter
    finally:
        shard_load_module._safe_open = opener
