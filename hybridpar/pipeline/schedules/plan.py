"""Plans: schedules with virtual stages and split backward, each rank's tasks in order."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from hybridpar.pipeline.schedules.schedule import (
    BACKWARD,
    COMPUTE,
    FORWARD,
    INPUT,
    WEIGHT,
    Schedule,
    ScheduleError,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "INPUT",
    "KINDS",
    "WEIGHT",
    "Plan",
    "Task",
    "check_size",
    "from_schedule",
    "label",
    "looped",
    "plan_of",
    "render_plan",
    "validate_plan",
    "vshape",
]

# The vocabulary of a plan. The model is cut into S = p * v virtual stages, 0 .. S - 1 in
# forward order; each rank holds v of them (`Plan.placement`). A task is one compute of one
# micro-batch i on one virtual stage s (torch.distributed.pipelining's names: I is the
# "B" of Qi et al., B is the full backward that `Action` calls B):
#
#   kind  computes                         needs (micro-batch i)            sends (if the
#                                                                           peer is another rank)
#   F     forward of stage s (+ loss if    F(i, s - 1)                      output -> s + 1
#         s = S - 1)
#   I     gradient of the input            I or B(i, s + 1), F(i, s)        input gradient -> s - 1
#   W     gradients of the weights         I(i, s) on the same rank         -
#   B     I then W at once (GPipe, 1F1B)   as I                             as I
#
# GPipe and 1F1B are the plans with v = 1 (stage s on rank s), F and B only: `from_schedule`.
KINDS = (FORWARD, INPUT, WEIGHT, BACKWARD)


class Task(NamedTuple):
    """One compute: `kind` (F, I, W, B) of micro-batch `microbatch` on virtual stage `stage`."""

    kind: str
    microbatch: int
    stage: int

    def __str__(self) -> str:
        """torch.distributed.pipelining's spelling: ``4F0`` = stage 4, forward, micro-batch 0."""
        return f"{self.stage}{self.kind}{self.microbatch}"


def check_size(name: str, value: int) -> None:
    """Raise `ValueError` unless `value` is a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def looped(ranks: int, virtual: int) -> tuple[int, ...]:
    """Megatron's placement: rank r holds stages r, r + p, ..., r + (v - 1)p.

        looped(2, 2) == (0, 1, 0, 1)       stage  0 1 2 3
                                           rank   0 1 0 1
    """
    return tuple(s % ranks for s in range(ranks * virtual))


def vshape(ranks: int) -> tuple[int, ...]:
    """ZBV's placement: rank r holds stages r and 2p - 1 - r (the loss is on rank 0, and
    stage p - 1 hands its output to stage p on the same rank, without a message).

        vshape(3) == (0, 1, 2, 2, 1, 0)    stage  0 1 2 3 4 5
                                           rank   0 1 2 2 1 0
    """
    return tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks))


@dataclass(frozen=True)
class Plan:
    """Each rank's compute tasks in order (`tasks[r]`) and where each virtual stage lives
    (`placement[s]` = the rank holding stage s)."""

    tasks: tuple[tuple[Task, ...], ...]
    placement: tuple[int, ...]
    microbatches: int
    name: str = ""

    @property
    def ranks(self) -> int:
        """p: the number of ranks (pipeline stages in the `Action` sense)."""
        return len(self.tasks)

    @property
    def stages(self) -> int:
        """S = p * v: the number of virtual stages."""
        return len(self.placement)

    @property
    def virtual(self) -> int:
        """v: virtual stages per rank."""
        return self.stages // max(self.ranks, 1)

    def stages_of(self, rank: int) -> list[int]:
        """The virtual stages `rank` holds, in forward order."""
        return [s for s, r in enumerate(self.placement) if r == rank]


def from_schedule(schedule: Schedule, *, name: str = "") -> Plan:
    """A schedule of `Action`s (GPipe, 1F1B) as a plan: v = 1, stage s on rank s, F and B."""
    tasks = tuple(tuple(Task(a.kind, a.microbatch, s) for a in actions if a.kind in COMPUTE)
                  for s, actions in enumerate(schedule))
    microbatches = sum(t.kind == FORWARD for t in tasks[0]) if tasks else 0
    return Plan(tasks, tuple(range(len(schedule))), microbatches, name)


def label(task: Task, plan: Plan) -> str:
    """How tables show a task: ``F0`` when every rank holds one stage, ``4F0`` otherwise."""
    return f"{task.kind}{task.microbatch}" if plan.virtual == 1 else str(task)


def render_plan(plan: Plan) -> list[str]:
    """The tasks of each rank as one line: ``["F0 F1 I0 W0 I1 W1", ...]`` (`render` of plans)."""
    return [" ".join(label(t, plan) for t in tasks) for tasks in plan.tasks]


def _check_placement(plan: Plan) -> None:
    p = plan.ranks
    if p < 1:
        raise ScheduleError("a plan needs at least one rank")
    counts = [sum(r == rank for r in plan.placement) for rank in range(p)]
    if any(not isinstance(r, int) or not 0 <= r < p for r in plan.placement) \
            or len(set(counts)) != 1 or counts[0] < 1:
        raise ScheduleError(f"placement {plan.placement} must give each of the {p} ranks the "
                            f"same number (>= 1) of virtual stages")


def validate_plan(plan: Plan) -> None:
    """Raise `ScheduleError` unless every rank runs, for each micro-batch of each stage it
    holds, F once and then either B, or I and later W (deadlocks: `simulate.simulate_plan`)."""
    _check_placement(plan)
    m = plan.microbatches
    for r, tasks in enumerate(plan.tasks):
        done: set[tuple[str, int, int]] = set()
        for task in tasks:
            kind, i, s = task
            where = f"rank {r}: {task}"
            if kind not in KINDS:
                raise ScheduleError(f"{where}: unknown kind {kind!r}; use one of {KINDS}")
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < m:
                raise ScheduleError(f"{where}: micro-batch must be an integer in [0, {m})")
            if not isinstance(s, int) or not 0 <= s < plan.stages or plan.placement[s] != r:
                raise ScheduleError(f"{where}: rank {r} holds stages {plan.stages_of(r)}, "
                                    f"not {s}")
            if (kind, i, s) in done:
                raise ScheduleError(f"{where} appears twice")
            needs = {INPUT: FORWARD, BACKWARD: FORWARD, WEIGHT: INPUT}.get(kind)
            if needs is not None and (needs, i, s) not in done:
                raise ScheduleError(f"{where} comes before {Task(needs, i, s)} on the same rank")
            if kind in (INPUT, BACKWARD) and {(INPUT, i, s), (BACKWARD, i, s)} & done:
                raise ScheduleError(f"{where}: stage {s} already ran the backward of "
                                    f"micro-batch {i}")
            done.add(task)
        for s in plan.stages_of(r):
            for i in range(m):
                if (FORWARD, i, s) not in done:
                    raise ScheduleError(f"rank {r}: {Task(FORWARD, i, s)} is missing")
                if (BACKWARD, i, s) not in done and (WEIGHT, i, s) not in done:
                    missing = Task(WEIGHT if (INPUT, i, s) in done else BACKWARD, i, s)
                    raise ScheduleError(f"rank {r}: {missing} is missing (micro-batch {i} is "
                                        f"forwarded on stage {s}, never fully backwarded)")


def plan_of(ranks: Sequence[Sequence[Task]], placement: Sequence[int], microbatches: int,
            *, name: str = "") -> Plan:
    """A validated plan from per-rank task lists."""
    plan = Plan(tuple(map(tuple, ranks)), tuple(placement), microbatches, name)
    validate_plan(plan)
    return plan
