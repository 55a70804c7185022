"""Zero-bubble schedules: the backward split into I and W, W filling the bubble (Qi et al.)."""

from __future__ import annotations

import functools

from hybridpar.pipeline.schedules.plan import (
    FORWARD,
    INPUT,
    WEIGHT,
    Plan,
    Task,
    check_size,
    from_schedule,
    plan_of,
    validate_plan,
    vshape,
)
from hybridpar.pipeline.schedules.schedule import zero_bubble_h1

__all__ = ["zb_h1", "zbv"]


@functools.lru_cache(maxsize=64, typed=True)
def zb_h1(ranks: int, microbatches: int) -> Plan:
    """ZB-H1 (Qi et al., ICLR 2024): 1F1B's order and memory, each W deferred to the tail.

    The plan of `schedule.zero_bubble_h1`, the order HybridPipe(schedule="zb-h1") runs:
    each rank r runs 1F1B with the backward split: min(p - r - 1, m) warm-up forwards, then F, I
    pairs, then the remaining I's; the W of micro-batch j comes right after the I of
    micro-batch j + r, and the last r W's at the end. So r more micro-batches stay alive than
    1F1B keeps on rank r (p - r): p on every rank, 1F1B's peak. The later ranks, whose I's
    finish first, fill the drain with their deferred W's. For m >= p the step takes
    m(t_F + t_B + t_W) + (p - 1)(t_F + t_B - min(t_W, t_F, t_B)): the paper's
    (p - 1)(t_F + t_B - t_W) when t_W <= t_F and t_W <= t_B. ranks=3, microbatches=4, unit
    F, I and W:

        rank 0 | F0 F1 F2 .  .  I0 W0 F3 I1 W1 I2 W2 I3 W3
        rank 1 | .  F0 F1 .  I0 F2 I1 W0 F3 I2 W1 I3 W2 W3
        rank 2 | .  .  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3
    """
    check_size("ranks", ranks)
    check_size("microbatches", microbatches)
    plan = from_schedule(zero_bubble_h1(ranks, microbatches), name="zb-h1")
    validate_plan(plan)
    return plan


def _numbered(script: list[tuple[str, int]], microbatches: int) -> list[Task]:
    """Tasks from (kind, stage) steps: the k-th step of a kind on a stage is micro-batch k;
    steps of micro-batches >= `microbatches` are dropped."""
    seen: dict[tuple[str, int], int] = {}
    tasks = []
    for kind, stage in script:
        i = seen[kind, stage] = seen.get((kind, stage), -1) + 1
        if i < microbatches:
            tasks.append(Task(kind, i, stage))
    return tasks


@functools.lru_cache(maxsize=64, typed=True)
def zbv(ranks: int, microbatches: int) -> Plan:
    """ZBV: two virtual stages per rank placed as a V (rank r holds r and 2p - 1 - r), the
    backward split, W's in the fill and drain (torch.distributed.pipelining's order).

    Rank r, with a = its stage r and b = its stage 2p - 1 - r:

        phase     tasks
        warm-up   2(p - r) - 1 F(a); r times F(b) F(a); p - r times F(b) I(b) W(b)
        steady    F(a) I(a) W(a) F(b) I(b) W(b) until every forward ran
        drain     r times I(a) I(b); p - r times I(a) W(a); the W's left, b's first

    (the warm-up counts as if m >= 2p - 1; with fewer micro-batches the missing ones are
    left out). Peak live: p micro-batches of a rank's share of the model (2p half stages),
    1F1B's peak. With t_F = t_B = t_W = t and m >= 2p - 1, no rank idles between its first
    and its last task: the step takes 2m(t_F + t_B + t_W) + (p - 1)t, the (p - 1)t being the
    fill every schedule pays (micro-batch 0 needs p - 1 stages before rank p - 1 can start),
    against 1F1B's 6(p - 1)t on the same stages. ranks=2, microbatches=3, unit F, I and W
    (a parallelogram: rank 1 starts one step late, rank 0 ends one step early):

        rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2 .
        rank 1 | .   1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2
    """
    check_size("ranks", ranks)
    check_size("microbatches", microbatches)
    p, m = ranks, microbatches
    n = max(2 * p - 1, m)   # the warm-up is shaped for at least 2p - 1 micro-batches
    tasks = []
    for r in range(p):
        a, b = r, 2 * p - 1 - r
        fa, ia, wa = (FORWARD, a), (INPUT, a), (WEIGHT, a)
        fb, ib, wb = (FORWARD, b), (INPUT, b), (WEIGHT, b)
        script = [fa] * (2 * (p - r) - 1) + [fb, fa] * r + [fb, ib, wb] * (p - r)
        for k in range(n - p):   # steady: stage a runs out of forwards first
            script += [fa] * (k < n - 2 * p + r + 1) + [ia, wa, fb, ib, wb]
        script += [ia, ib] * r + [ia, wa] * (p - r)
        script += [wb] * (n - script.count(wb)) + [wa] * (n - script.count(wa))
        tasks.append(_numbered(script, m))
    return plan_of(tasks, vshape(p), m, name="zbv")
