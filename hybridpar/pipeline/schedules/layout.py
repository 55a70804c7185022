"""Where a pipe's stages live: S = p * v virtual stages on p ranks, and each rank's program.

    schedule      v (virtual_stages)   placement (stage -> rank)     program of a step
    gpipe, 1f1b,  1                    stage s on rank s             `lowering.lower` of the
    zb-h1                                                            `Action` schedule
    interleaved   >= 2 (default 2)     looped: s % p                 `plan_lowering.lower_plan`
    zbv           2                    V: s, then 2p - 1 - s         of the plan, as (stage,
                                                                     action) items

The model is cut into S stages by a balance of S layer counts; a rank holds the stages its
placement gives it, and the loss is computed on the rank of stage S - 1 (`last_rank`: p - 1
looped, 0 for ZBV).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridpar.pipeline.schedules.plan import FORWARD, Task, looped, vshape
from hybridpar.pipeline.schedules.plan_lowering import lower_plan
from hybridpar.pipeline.schedules.planned import get_plan
from hybridpar.pipeline.schedules.schedule import (
    GROUP,
    SCHEDULES,
    Action,
    Comm,
    Schedule,
    ScheduleError,
)

__all__ = ["VIRTUAL", "Item", "Layout"]

Item = tuple[int, Action | Comm]   # (virtual stage, what it does): a rank's program, in order

VIRTUAL = {"interleaved": looped, "zbv": lambda ranks, virtual: vshape(ranks)}
NAMES = (*SCHEDULES, *VIRTUAL)


@dataclass(frozen=True)
class Layout:
    """A schedule's placement of the virtual stages on `ranks` ranks."""

    schedule: str
    ranks: int
    virtual: int
    placement: tuple[int, ...]

    @classmethod
    def of(cls, schedule: str, ranks: int, virtual_stages: int | None) -> Layout:
        """The layout of `schedule` over `ranks` pipeline ranks; a `ValueError` that says
        what to give for an unknown schedule or a `virtual_stages` it cannot run."""
        if schedule not in NAMES:
            raise ValueError(f"unknown schedule {schedule!r}; choose one of "
                             f"{', '.join(sorted(NAMES))}")
        v = virtual_stages
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"virtual_stages must be a positive integer, got {v!r}")
        if schedule not in VIRTUAL:
            if v not in (None, 1):
                raise ValueError(f"schedule {schedule!r} holds one stage per rank, got "
                                 f"virtual_stages={v}; use schedule='interleaved' (or 'zbv', "
                                 "v = 2) for several stages per rank")
            return cls(schedule, ranks, 1, tuple(range(ranks)))
        if schedule == "zbv" and v not in (None, 2):
            raise ValueError(f"schedule 'zbv' holds 2 stages per rank (a V), got "
                             f"virtual_stages={v}; leave it out, or use 'interleaved'")
        if schedule == "interleaved" and v == 1:
            raise ValueError("schedule 'interleaved' needs virtual_stages >= 2 (with 1 it is "
                             "schedule='1f1b')")
        v = 2 if v is None else v
        return cls(schedule, ranks, v, tuple(VIRTUAL[schedule](ranks, v)))

    @property
    def stages(self) -> int:
        """S: the number of (virtual) stages the model is cut into."""
        return len(self.placement)

    @property
    def unit(self) -> str:
        """How error messages name the stage count: ``pp=4`` or ``pp * virtual_stages=8``."""
        return "pp" if self.virtual == 1 else "pp * virtual_stages"

    @property
    def last_rank(self) -> int:
        """The pipeline rank of the last stage: it computes the loss."""
        return self.placement[-1]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` holds, in forward order."""
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def schedule_of(self, microbatches: int) -> Schedule:
        """One stage per rank: the schedule's actions of each stage."""
        return SCHEDULES[self.schedule](self.ranks, microbatches)

    def items(self, rank: int, microbatches: int, *, train: bool,
              routes: Sequence[tuple[int, int]]) -> list[Item]:
        """Virtual stages: `rank`'s program of a step, (stage, action) items in order
        (`virtual.RankStages`); without `train`, the forwards and their messages alone."""
        try:
            plan = get_plan(self.schedule)(self.ranks, microbatches, virtual=self.virtual)
        except ScheduleError as e:
            raise ValueError(f"schedule {self.schedule!r} cannot run {microbatches} "
                             f"micro-batches on pp={self.ranks}: {e}") from None
        lead = self.stages_of(rank)[0]
        items: list[Item] = []
        for item in lower_plan(plan, routes=routes)[rank]:
            backward = item.kind != FORWARD if isinstance(item, Task) else \
                item.kind.endswith("_B")
            if not train and backward:   # forward only: a compute left out ends a group
                item = Task(GROUP, -1, lead)
            if isinstance(item, Task):
                action: Action | Comm = Action(item.kind, item.microbatch)
                items.append((lead if item.kind == GROUP else item.stage, action))
            elif item.kind == GROUP:
                items.append((lead, Action(GROUP, -1)))
            else:
                items.append((item.stage, Comm(item.kind, item.microbatch, item.peer_stage)))
        return _tidy(items)


def _tidy(items: list[Item]) -> list[Item]:
    """Without GROUP marks that end no group (first, last, or after another)."""
    out: list[Item] = []
    for item in items:
        if item[1].kind == GROUP and (not out or out[-1][1].kind == GROUP):
            continue
        out.append(item)
    while out and out[-1][1].kind == GROUP:
        out.pop()
    return out

