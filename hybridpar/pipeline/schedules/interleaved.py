"""Interleaved 1F1B: v virtual stages per rank, Megatron's order (Narayanan et al. 2021)."""

from __future__ import annotations

import functools

from hybridpar.pipeline.schedules.plan import (
    BACKWARD,
    FORWARD,
    Plan,
    Task,
    check_size,
    looped,
    plan_of,
)
from hybridpar.pipeline.schedules.schedule import ScheduleError
from hybridpar.pipeline.schedules.simulate import unit_ends

__all__ = ["interleaved_1f1b"]


@functools.lru_cache(maxsize=64, typed=True)
def interleaved_1f1b(ranks: int, microbatches: int, virtual: int = 2) -> Plan:
    """1F1B over v virtual stages per rank, placed looped (rank r holds r, r + p, ...).

    Each rank counts its m * v forwards k = 0, 1, ...: they go in groups of p micro-batches
    through its stages in turn (stage (k // p) % v of its own, micro-batch
    (k // pv) p + k % p); its backwards go the same way through the stages in reverse. Rank r
    runs 2(p - r - 1) + (v - 1)p warm-up forwards (at most m v), then one forward, one
    backward (full: I then W), then the remaining backwards.
    The bubble is 1F1B's divided by v: (p - 1)(t_F + t_B + t_W) / v with each stage taking
    1 / v of a rank's times. ranks=2, microbatches=4, virtual=2, unit F and B (``2F0`` =
    stage 2, forward, micro-batch 0):

        rank 0 | 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 .   2B2 .   2B3 0B2 0B3
        rank 1 | .   1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 .
    With m not a multiple of p the last group holds the m % p micro-batches left, and the
    warm-ups grow by the least number of forwards (the same on every rank) that makes the
    order free of deadlock: correct, with more live micro-batches than Megatron's bound
    (which needs m a multiple of p).
    """
    for name, value in (("ranks", ranks), ("microbatches", microbatches),
                        ("virtual", virtual)):
        check_size(name, value)
    p, m, v = ranks, microbatches, virtual
    if v < 2:
        raise ScheduleError("interleaved_1f1b needs virtual >= 2 stages per rank; with one "
                            "it is one_f_one_b")
    total = m * v
    for extra in range(total + 1):   # 0 when m is a multiple of p: Megatron's warm-ups
        tasks = []
        for r in range(p):
            forwards, backwards = _order(FORWARD, r, p, m, v), _order(BACKWARD, r, p, m, v)
            warmup = min(2 * (p - r - 1) + (v - 1) * p + extra, total)
            order = forwards[:warmup]
            for j in range(total - warmup):
                order += [forwards[warmup + j], backwards[j]]
            order += backwards[total - warmup:]
            tasks.append(order)
        plan = plan_of(tasks, looped(p, v), m, name="interleaved")
        try:
            unit_ends(plan)   # raises on a deadlock
        except ScheduleError:
            continue
        return plan
    raise AssertionError("unreachable: warm-ups of every forward (GPipe) never deadlock")


def _order(kind: str, rank: int, p: int, m: int, v: int) -> list[Task]:
    """A rank's forwards (or backwards) in order: micro-batches in groups of p (the last
    holds what is left), each group through the rank's stages in turn (backwards: in
    reverse)."""
    out = []
    for group in range(0, m, p):
        for local in (range(v) if kind == FORWARD else reversed(range(v))):
            out += [Task(kind, i, local * p + rank) for i in range(group, min(group + p, m))]
    return out
