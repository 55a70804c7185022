"""Exact contiguous min-max partition of a cost sequence into k non-empty blocks.

torchgpipe's `blockpartition.solve` is a heuristic (1.6x off the optimum on 14 layers split 6
ways, DESIGN §5). Here the split is exact, by dynamic programming in two passes:

    pass  computes                                     recurrence (block [a, b))
    1     M* = the least possible slowest block        best[j][b] = min_a max(best[j-1][a], t(a, b))
    2     among splits with every block <= M*, the     rest[j][a] = min_b t(a, b)^2 + rest[j-1][b]
          least sum of squared block costs (the most   (blocks with t > M* or memory > cap
          even one); ties: the smallest first block,    are not allowed)
          then the smallest second, ... (lexicographic)

where ``t(a, b) = costs[a] + ... + costs[b-1] + boundary[b-1]`` (no boundary for the last
block, b = n). The second criterion cannot be folded into pass 1: a prefix with a larger
maximum but a smaller sum of squares can win once a later block dominates the maximum, so
it is its own exact pass under the constraint ``t <= M*``. Block sums are accumulated left to
right, exactly as ``sum(costs[a:b])`` rounds, so the optimum matches a brute force bit for
bit; integer costs are summed exactly. O(k n^2) time, O(k n) memory: n of a few hundred
layers solves in well under a second.

A memory cap (`max_block_memory`) forbids blocks whose memory exceeds it; when no split
fits, the ValueError names the smallest cap that works: the min-max split of the memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["block_costs", "min_cap", "solve"]

Number = float | int


def _check(values: Sequence[Number], n: int, what: str) -> list[Number]:
    out = list(values)
    if len(out) != n:
        raise ValueError(f"{what} has {len(out)} entries but costs has {n}; give one per layer")
    bad = [v for v in out if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0)]
    if bad:
        raise ValueError(f"{what} must be finite non-negative numbers, got {bad[0]!r}")
    return out


def block_costs(costs: Sequence[Number], counts: Sequence[int], *,
                boundary: Sequence[Number] | None = None) -> list[Number]:
    """The cost of every block of `counts`: its layers' costs plus its boundary (not the last)."""
    out, start, n = [], 0, len(costs)
    for count in counts:
        stop = start + count
        total: Number = sum(costs[start:stop])
        if boundary is not None and stop < n:
            total += boundary[stop - 1]
        out.append(total)
        start = stop
    return out


def min_cap(memory: Sequence[Number], k: int) -> Number:
    """The smallest per-block cap that `k` blocks of `memory` can meet (its min-max split)."""
    return max(block_costs(memory, solve(memory, k)))


def _minmax(costs: list[Number], k: int, bnd: list[Number],
            mem: list[Number] | None, cap: Number | None) -> Number | None:
    """Pass 1: the least slowest block over all splits that respect the cap (None: none fit)."""
    n = len(costs)
    inf = math.inf
    prev: list[Number] = [0] + [inf] * n  # best[0][b]: zero blocks cover only b = 0
    for j in range(1, k + 1):
        cur: list[Number] = [inf] * (n + 1)
        # block j covers [a, b); a >= j-1 earlier layers, leave n-b >= k-j layers after it
        for a in range(j - 1, n - (k - j)):
            before = prev[a]
            if before == inf:
                continue
            s: Number = 0
            m: Number = 0
            for b in range(a + 1, n - (k - j) + 1):
                s += costs[b - 1]
                if mem is not None and cap is not None:
                    m += mem[b - 1]
                    if m > cap:
                        break  # non-negative memory: longer blocks only grow
                t = s + bnd[b - 1] if b < n else s
                cand = before if before >= t else t
                if cand < cur[b]:
                    cur[b] = cand
        prev = cur
    return None if prev[n] == inf else prev[n]


def _even(costs: list[Number], k: int, bnd: list[Number], limit: Number,
          mem: list[Number] | None, cap: Number | None) -> list[int]:
    """Pass 2: the least sum of squares with every block <= limit; lexicographic ties."""
    n = len(costs)
    inf = math.inf
    # rest[a]: least sum of squares splitting costs[a:] into the j blocks of this round
    rest: list[float] = [inf] * n + [0.0]  # j = 0: only the empty suffix
    choice: list[list[int]] = []
    for j in range(1, k + 1):
        cur = [inf] * (n + 1)
        pick = [-1] * (n + 1)
        for a in range(k - j, n - j + 1):  # k-j blocks before a need >= k-j layers
            s: Number = 0
            m: Number = 0
            for b in range(a + 1, n - (j - 1) + 1):
                s += costs[b - 1]
                if mem is not None and cap is not None:
                    m += mem[b - 1]
                    if m > cap:
                        break
                t = s + bnd[b - 1] if b < n else s
                if t > limit:
                    if s > limit:
                        break  # non-negative costs: longer blocks only grow
                    continue  # only this boundary is too costly; a longer block may fit
                tail = rest[b]
                if tail == inf:
                    continue
                val = float(t) * float(t) + tail
                if val < cur[a]:  # strict: the smallest b wins ties (lexicographic)
                    cur[a], pick[a] = val, b
        rest = cur
        choice.append(pick)
    counts, a = [], 0
    for j in range(k, 0, -1):
        b = choice[j - 1][a]
        counts.append(b - a)
        a = b
    return counts


def solve(costs: Sequence[Number], k: int, *, memory: Sequence[Number] | None = None,
          max_block_memory: Number | None = None,
          boundary: Sequence[Number] | None = None) -> list[int]:
    """Split `costs` into `k` contiguous non-empty blocks minimizing the costliest block.

    Returns the number of layers in every block (a `balance`). `boundary[i]` is added to a
    block that ends at layer i (the cost of sending layer i's output to the next stage), never
    to the last block. With `max_block_memory`, every block's `memory` sum must be at most the
    cap; a ValueError names the smallest cap that works when none fits. See the module
    docstring for the algorithm and the tie-breaking.
    """
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"the number of blocks must be an int, got {k!r}")
    n = len(costs)
    if n == 0:
        raise ValueError("cannot partition an empty cost list; give one cost per layer")
    if k < 1 or k > n:
        raise ValueError(f"cannot split {n} layers into {k} non-empty stages; "
                         f"choose a number of stages between 1 and {n}")
    values = _check(costs, n, "costs")
    bnd: list[Number] = _check(boundary, n, "boundary") if boundary is not None else [0] * n
    mem: list[Number] | None = None
    if max_block_memory is not None:
        if memory is None:
            raise ValueError("max_block_memory needs the per-layer memory= list")
        if not (isinstance(max_block_memory, (int, float)) and max_block_memory >= 0):
            raise ValueError(f"max_block_memory must be a non-negative number, "
                             f"got {max_block_memory!r}")
        mem = _check(memory, n, "memory")
    elif memory is not None:
        _check(memory, n, "memory")
    best = _minmax(values, k, bnd, mem, max_block_memory)
    if best is None:
        assert mem is not None
        need = min_cap(mem, k)
        raise ValueError(
            f"no split of {n} layers into {k} stages keeps every stage within "
            f"{max_block_memory} of memory; the smallest cap that works is {need} "
            f"(raise the cap to at least that, or use more stages)"
        )
    return _even(values, k, bnd, best, mem, max_block_memory)
