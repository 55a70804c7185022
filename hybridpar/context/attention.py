"""Attention of a cp rank's queries over the whole sequence: the all-gather mode.

Each rank holds its tokens' q, k, v (`split.split_sequence`); the keys and values of the
whole sequence are all-gathered over the cp group (their gradients reduce-scattered back,
`sharded.mappings.gather_grad_scatter`), and the mask is built from global token indices,
so any mask is exact: causal, a sliding window, packed documents (Megatron-LM's
``all_gather`` mode). The keys come in the ranks' order, not the sequence's; attention does
not care, since the mask says which key each query may see:

    visible(q, k) = k <= q                         causal
                    and q - k < window             a sliding window (the window's last
                                                   `window` tokens, the query's own included)
                    and document(q) == document(k) packed documents

Memory: each rank holds the whole sequence's keys and values for one layer at a time (the
ring exchange, which holds two chunks, is the other mode: not built yet).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar.sharded.mappings import all_gather_along, gather_grad_scatter

__all__ = ["context_attention", "visible"]


def visible(query_index: Tensor, key_index: Tensor, *, window: int | None = None,
            query_documents: Tensor | None = None, key_documents: Tensor | None = None
            ) -> Tensor:
    """The boolean mask (..., Tq, Tk) of which keys each query sees (module docstring):
    indices (Tq,) / (Tk,) global, documents (B, Tq) / (B, Tk) when packed."""
    q, k = query_index.unsqueeze(-1), key_index.unsqueeze(-2)          # (Tq, 1), (1, Tk)
    mask = k <= q
    if window is not None:
        mask = mask & (q - k < window)
    if query_documents is not None and key_documents is not None:
        same = query_documents.unsqueeze(-1) == key_documents.unsqueeze(-2)   # (B, Tq, Tk)
        mask = mask & same
    return mask


def context_attention(q: Tensor, k: Tensor, v: Tensor, index: Tensor,
                      group: ProcessGroup | None, *, window: int | None = None,
                      documents: Tensor | None = None, scale: float | None = None) -> Tensor:
    """Causal attention of this rank's queries q (B, H, T / cp, D) over the whole sequence's
    keys and values, whose local parts are k, v (B, H, T / cp, D) (repeat grouped-query
    heads first) at global token indices `index` (T / cp,); `window`: a sliding window;
    `documents` (B, T / cp): packed documents' ids. Returns (B, H, T / cp, D)."""
    keys = gather_grad_scatter(k, group, dim=2)                        # (B, H, T, D)
    values = gather_grad_scatter(v, group, dim=2)
    key_index = all_gather_along(index, 0, group)                      # (T,)
    key_documents = all_gather_along(documents, 1, group) if documents is not None else None
    mask = visible(index, key_index, window=window, query_documents=documents,
                   key_documents=key_documents)
    if mask.dim() == 3:                                                # (B, 1, Tq, Tk)
        mask = mask.unsqueeze(1)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
