"""Train / validation by documents: one random document of every 1/f, decided in order."""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np

__all__ = ["ValSplit"]

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: well-spread uint64 from consecutive ones."""
    x = x.astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _ceil_div(a: np.ndarray, b: int) -> np.ndarray:
    return -((-a) // b)


class ValSplit:
    """Which documents go to validation, decided a batch at a time, in document order.

    With f = `val_fraction` = p/q and an offset u in [0, q - p) drawn by `seed`, document i
    (0-based, counting the documents kept) lies in stratum s(i) = floor(((i + 1)·p + u) / q):
    runs of 1/f documents (rounded down or up). Stratum 0 is all training; every later
    stratum gives one document to validation, drawn by (seed, s). So the first n documents
    hold n·f of them, rounded, less at most one (the last stratum may end past the corpus),
    spread over the whole corpus; document 0 is always training. seed=0, f=0.25:

        document  0 1 2 3 4 5 6 7 8 9 10 11 12
        stratum   0 0 1 1 1 1 2 2 2 2 3  3  3
        split     t t t v t t t t v t v  t  t

    Neither the batches nor the documents after i change the decision for i.
    """

    def __init__(self, val_fraction: float, *, seed: int = 0) -> None:
        if not isinstance(val_fraction, (int, float)) or not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
        frac = Fraction(val_fraction).limit_denominator(1_000_000)
        self.p, self.q = frac.numerator, frac.denominator
        self.u = random.Random(seed).randrange(self.q - self.p) if self.p else 0
        self.key = int(_mix(np.array([seed & (2**64 - 1)], dtype=np.uint64))[0])
        self.seen = 0

    def strata(self, i: np.ndarray) -> np.ndarray:
        """The stratum of each document index: ``(n,)`` int64."""
        return ((i + 1) * self.p + self.u) // self.q

    def take(self, count: int) -> np.ndarray:
        """The next `count` documents' flags, True for validation: ``(count,)`` bool."""
        i = np.arange(self.seen, self.seen + count, dtype=np.int64)          # (count,)
        self.seen += count
        if self.p == 0:
            return np.zeros(count, dtype=bool)
        s = self.strata(i)
        start = _ceil_div(s * self.q - self.u, self.p) - 1                    # first of s
        size = _ceil_div((s + 1) * self.q - self.u, self.p) - 1 - start
        draw = _mix(s.astype(np.uint64) ^ np.uint64(self.key)) % size.astype(np.uint64)
        return (s >= 1) & (i == start + draw.astype(np.int64))
