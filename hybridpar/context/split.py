"""The sequence split of context parallelism, balanced for causal attention.

A causal mask makes late tokens attend to more keys than early ones, so the sequence is cut
into 2·cp equal chunks and rank r holds chunks r and 2·cp − 1 − r (one early, one late): every
rank then does the same attention work. cp = 2, 8 tokens:

    chunks     c0  c1  c2  c3        (2 tokens each)
    rank 0     c0          c3        tokens 0 1 6 7
    rank 1         c1  c2            tokens 2 3 4 5

`split_sequence` cuts any tensor along its sequence dim (ids, positions, labels, masks),
`sequence_index` gives the global index of each local token (what masks and rotary
embeddings read), `unsplit_sequence` puts every rank's part back in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["sequence_index", "split_sequence", "unsplit_sequence"]


def _chunks(length: int, cp: int) -> int:
    """The chunk length; a `ValueError` when 2·cp does not divide `length`."""
    if cp < 1:
        raise ValueError(f"cp must be a positive integer, got {cp}")
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} tokens does not split over cp={cp}: context "
                         f"parallelism cuts it into 2·cp = {2 * cp} equal chunks; use a "
                         f"sequence length divisible by {2 * cp}")
    return length // (2 * cp)


def split_sequence(x: Tensor, cp: int, rank: int, *, dim: int = 1) -> Tensor:
    """Rank `rank`'s part of `x` along `dim`: chunks rank and 2·cp − 1 − rank, in order."""
    size = _chunks(x.shape[dim], cp)
    first = x.narrow(dim, rank * size, size)
    second = x.narrow(dim, (2 * cp - 1 - rank) * size, size)
    return torch.cat([first, second], dim=dim)


def sequence_index(length: int, cp: int, rank: int, *,
                   device: torch.device | str | None = None) -> Tensor:
    """The global index (int64, (length / cp,)) of each of rank `rank`'s tokens."""
    return split_sequence(torch.arange(length, device=device).unsqueeze(0), cp, rank)[0]


def unsplit_sequence(parts: Sequence[Tensor], *, dim: int = 1) -> Tensor:
    """The whole sequence from every rank's part (`parts[r]`: rank r's), in global order."""
    cp = len(parts)
    size = parts[0].shape[dim] // 2
    chunks: list[Tensor | None] = [None] * (2 * cp)
    for r, part in enumerate(parts):
        chunks[r] = part.narrow(dim, 0, size)
        chunks[2 * cp - 1 - r] = part.narrow(dim, size, size)
    return torch.cat([c for c in chunks if c is not None], dim=dim)
