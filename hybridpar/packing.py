"""Packed documents: position ids that restart at each document, and the mask they give.

With ``data.pack = "documents"`` a window of T tokens holds several documents (and the
piece of one that began in the window before). Each token carries its position in its own
document; a position 0 starts a new document, so the positions alone say which tokens may
attend to which (segment = running count of zeros), and they travel with the hidden state
from stage to stage instead of a (T, T) mask:

    positions  0 1 2 0 1 0 1 2        three documents in a window of 8 tokens
    segments   1 1 1 2 2 3 3 3        cumsum(positions == 0)

    mask (row: query, column: key; x: may attend)
        0 | x . . . . . . .
        1 | x x . . . . . .
        2 | x x x . . . . .
        3 | . . . x . . . .
        4 | . . . x x . . .
        5 | . . . . . x . .
        6 | . . . . . x x .
        7 | . . . . . x x x

Causal and block-diagonal: a token attends to the earlier tokens of its own document only,
which is what each document run alone (positions from 0) computes.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["PACKED_ATTR", "PACKS", "SEQUENCE_PARALLEL_PACKED", "document_mask",
           "document_segments", "is_packed", "split_positions"]

PACKS = ("none", "documents", "pad")   # data.pack
PACKED_ATTR = "hybridpar_packed_documents"   # set on the model by models.pack_documents
# refused by the config check (parallel.sequence_parallel with data.pack) and by HybridPipe
SEQUENCE_PARALLEL_PACKED = (
    "sequence parallelism (parallel.sequence_parallel, HybridPipe(sequence_parallel=True)) "
    "does not take packed documents yet (data.pack = 'documents', pack_documents): its "
    "split of the tokens would not carry their positions; set one of them off")


def is_packed(model: object) -> bool:
    """Whether `models.packing.pack_documents` made `model` carry document positions."""
    return getattr(model, PACKED_ATTR, False) is True


def split_positions(x: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, Tensor | None]:
    """``(x, None)`` for a plain input, ``(hidden, positions)`` for a packed pair."""
    if isinstance(x, tuple):
        if len(x) != 2 or not all(isinstance(t, Tensor) for t in x):
            raise TypeError(f"a packed input is a pair (hidden or ids, positions (B, T)), got "
                            f"a tuple of {len(x)} {', '.join(type(t).__name__ for t in x)}")
        return x[0], x[1]
    return x, None


def document_segments(positions: Tensor) -> Tensor:
    """``(B, T)`` positions -> ``(B, T)`` segment numbers: ``cumsum(positions == 0)``."""
    return (positions == 0).cumsum(dim=-1)


def document_mask(positions: Tensor) -> Tensor:
    """``(B, T)`` positions -> ``(B, 1, T, T)`` bool: query i may attend to key j.

    True where j <= i and both lie in the same document: the `attn_mask` of
    ``F.scaled_dot_product_attention`` (broadcast over the heads)."""
    T = positions.shape[-1]
    segments = document_segments(positions)                             # (B, T)
    same = segments[:, :, None] == segments[:, None, :]                  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=positions.device).tril()
    return (same & causal).unsqueeze(1)                                  # (B, 1, T, T)
