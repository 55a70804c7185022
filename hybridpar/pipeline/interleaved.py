"""Interleaved 1F1B: v virtual stages per rank, Megatron's order (Narayanan et al. 2021)."""

from __future__ import annotations

import functools

from hybridpar.pipeline.plan import BACKWARD, FORWARD, Plan, Task, check_size, looped, plan_of
from hybridpar.pipeline.schedule import ScheduleError

__all__ = ["interleaved_1f1b"]


@functools.lru_cache(maxsize=64, typed=True)
def interleaved_1f1b(ranks: int, microbatches: int, virtual: int = 2) -> Plan:
    """1F1B over v virtual stages per rank, placed looped (rank r holds r, r + p, ...).

    Each rank counts its m * v forwards k = 0, 1, ...: they go in groups of p micro-batches
    through its stages in turn (stage (k // p) % v of its own, micro-batch
    (k // pv) p + k % p); its backwards go the same way through the stages in reverse. Rank r
    runs 2(p - r - 1) + (v - 1)p warm-up forwards (at most m v), then one forward, one
    backward (full: I then W), then the remaining backwards. m must be a multiple of p.
    The bubble is 1F1B's divided by v: (p - 1)(t_F + t_B + t_W) / v with each stage taking
    1 / v of a rank's times. ranks=2, microbatches=4, virtual=2, unit F and B (``2F0`` =
    stage 2, forward, micro-batch 0):

        rank 0 | 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 .   2B2 .   2B3 0B2 0B3
        rank 1 | .   1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 .
    """
    for name, value in (("ranks", ranks), ("microbatches", microbatches),
                        ("virtual", virtual)):
        check_size(name, value)
    p, m, v = ranks, microbatches, virtual
    if v < 2:
        raise ScheduleError("interleaved_1f1b needs virtual >= 2 stages per rank; with one "
                            "it is one_f_one_b")
    if m % p:
        raise ScheduleError(
            f"interleaved_1f1b needs a number of micro-batches that is a multiple of the "
            f"{p} ranks (Megatron's groups of p), got {m}; use {m - m % p or p} or "
            f"{m + p - m % p}")
    total = m * v

    def task(kind: str, rank: int, k: int) -> Task:
        local = (k // p) % v if kind == FORWARD else v - 1 - (k // p) % v
        return Task(kind, (k // (p * v)) * p + k % p, local * p + rank)

    tasks = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        order = [task(FORWARD, r, k) for k in range(warmup)]
        for j in range(total - warmup):
            order += [task(FORWARD, r, warmup + j), task(BACKWARD, r, j)]
        order += [task(BACKWARD, r, j) for j in range(total - warmup, total)]
        tasks.append(order)
    return plan_of(tasks, looped(p, v), m, name="interleaved")
