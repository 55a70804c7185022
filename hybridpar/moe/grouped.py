"""Grouped matrix multiply: each expert's weights on its own run of rows, chosen in one place.

Rows are grouped by expert (expert 0's rows, then expert 1's, ...; `counts` says how many):

    x (N, in)      w (E, out, in)        out (N, out)
    rows 0..2  @ w[0]ᵀ   ->   rows 0..2
    rows 3..6  @ w[1]ᵀ   ->   rows 3..6        counts = [3, 4, 0, 2]
    (none)       w[2]         (none)
    rows 7..8  @ w[3]ᵀ   ->   rows 7..8

    where            implementation
    CUDA, bf16/fp16/fp32, torch has it    torch.nn.functional.grouped_mm (one kernel)
    elsewhere (CPU, float64)              a loop over the experts with rows: one F.linear each

Both give every row the product with its own expert's matrix; the loop is what transformers'
eager experts compute (so float64 parity against HF is exact), and needs the counts on the
host (one sync per layer, the CPU path has nothing to stall).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

__all__ = ["even_split", "grouped_linear", "host_counts", "uses_grouped_mm"]

_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def uses_grouped_mm(x: Tensor) -> bool:
    """Whether `grouped_linear` runs torch's grouped kernel for `x` (else the loop)."""
    return (x.is_cuda and x.dtype in _KERNEL_DTYPES
            and hasattr(torch.nn.functional, "grouped_mm"))


def host_counts(counts: Tensor, total: int) -> list[int]:
    """`counts` read on the host (a sync on a GPU). A fake or meta tensor (`hybridpar
    check`'s dry run; the "auto" tp plan following a forward on meta), which has no values,
    reads as an even split of `total` rows, the first ones one more: the balanced routing
    the dry run's memory assumes."""
    if is_fake(counts) or counts.is_meta:
        return even_split(total, counts.shape[0])
    return [int(c) for c in counts.tolist()]


def even_split(total: int, n: int) -> list[int]:
    """`total` rows over `n` groups, the first ``total % n`` one more."""
    return [total // n + (i < total % n) for i in range(n)]


def grouped_linear(x: Tensor, weight: Tensor, counts: Tensor, *,
                   transposed: bool = False) -> Tensor:
    """x (N, in) grouped by expert, weight (E, out, in) (or (E, in, out) when `transposed`,
    GPT-OSS's layout), counts (E,) int64 summing to N -> (N, out)."""
    if uses_grouped_mm(x):
        w = weight if transposed else weight.transpose(1, 2)             # (E, in, out)
        offsets = counts.cumsum(0).to(torch.int32)                       # end of each group
        return F.grouped_mm(x, w, offs=offsets)
    parts = [rows @ weight[e] if transposed else F.linear(rows, weight[e])
             for e, rows in enumerate(x.split(host_counts(counts, x.shape[0]))) if rows.shape[0]]
    if not parts:   # no rows: still a product, so the backward reaches x (and every
        # rank of an ep group runs the same all-to-alls in its backward)
        return x @ weight[0] if transposed else F.linear(x, weight[0])
    return torch.cat(parts)
