"""The plans by name: what `hybridpar schedule` simulates and `HybridPipe` runs (one stage per
rank: `schedule.SCHEDULES`' actions; several: the plan, `pipeline.schedules.layout`)."""

from __future__ import annotations

from collections.abc import Callable

from hybridpar.pipeline.schedules.interleaved import interleaved_1f1b
from hybridpar.pipeline.schedules.plan import Plan, check_size, from_schedule
from hybridpar.pipeline.schedules.schedule import SCHEDULES, gpipe, one_f_one_b
from hybridpar.pipeline.schedules.zero_bubble import zb_h1, zbv

__all__ = ["PLANS", "RUNNABLE", "get_plan"]

# name           virtual stages per rank   HybridPipe runs it
# gpipe          1                         schedule="gpipe"
# 1f1b           1                         schedule="1f1b"
# interleaved    v >= 2 (default 2)        schedule="interleaved", virtual_stages=v
# zb-h1          1                         schedule="zb-h1"
# zbv            2                         schedule="zbv"
Builder = Callable[..., Plan]   # (ranks, microbatches, *, virtual=None) -> Plan


def _fixed(fn: Callable[[int, int], Plan], v: int, name: str) -> Builder:
    def build(ranks: int, microbatches: int, *, virtual: int | None = None) -> Plan:
        if virtual is not None and virtual != v:
            raise ValueError(f"schedule {name!r} has {v} virtual stage{'s' * (v > 1)} per "
                             f"rank, got virtual={virtual}; leave it out, or use "
                             f"'interleaved' for other counts")
        return fn(ranks, microbatches)
    return build


def _interleaved(ranks: int, microbatches: int, *, virtual: int | None = None) -> Plan:
    return interleaved_1f1b(ranks, microbatches, 2 if virtual is None else virtual)


def _from(schedule: Callable[[int, int], list], name: str) -> Callable[[int, int], Plan]:
    def build(ranks: int, microbatches: int) -> Plan:
        check_size("ranks", ranks)
        return from_schedule(schedule(ranks, microbatches), name=name)
    return build


PLANS: dict[str, Builder] = {
    "gpipe": _fixed(_from(gpipe, "gpipe"), 1, "gpipe"),
    "1f1b": _fixed(_from(one_f_one_b, "1f1b"), 1, "1f1b"),
    "interleaved": _interleaved,
    "zb-h1": _fixed(zb_h1, 1, "zb-h1"),
    "zbv": _fixed(zbv, 2, "zbv"),
}
RUNNABLE = (*SCHEDULES, "interleaved", "zbv")   # what HybridPipe runs: every plan


def get_plan(name: str) -> Builder:
    """The plan builder registered under `name`: ``get_plan("zbv")(4, 8)``."""
    try:
        return PLANS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown schedule {name!r}; choose one of {', '.join(sorted(PLANS))}") from None
