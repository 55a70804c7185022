"""Many cases in one `hybridpar.spawn`: starting the ranks (and, for the Hugging Face tests,
importing a model family and building its first model) costs far more than a small case.

`spawn_cases(fn, nprocs, cases)` runs ``fn(*args)`` for every named case in turn on the same
ranks (each case calls `hybridpar.init` again, which reuses the process group) and returns
``{case: [rank 0's result, rank 1's, ...]}``, so a test per case can assert on its own case. A
case that raises fails the spawn with its name in the traceback (``in case '<name>'``). Only
cases that leave no message unmatched belong together: never a pipeline stopped mid-step.

`selected_ids(request, test)` names the cases a module fixture needs: the parametrize ids of
`test` that this session runs (`--tier`, ``-k``), so a matrix split between the suite and the
campaign (tests/tiers.py) computes only its own corners; `layout_id` names a layout case so
(``pp2tp2dp1-1f1b-always``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import pytest

import hybridpar


def each_case(fn: Callable[..., Any], cases: Mapping[str, Sequence[Any]]) -> dict[str, Any]:
    """In a rank: ``{name: fn(*args)}`` over `cases`, in order."""
    out = {}
    for name, args in cases.items():
        try:
            out[name] = fn(*args)
        except BaseException as e:
            e.add_note(f"in case {name!r}")
            raise
    return out


def selected_ids(request: pytest.FixtureRequest, test: str) -> set[str]:
    """The parametrize ids of the tests named `test`, in the requesting fixture's module,
    that this session runs (``{""}``: a test without parameters that it runs)."""
    return {getattr(getattr(item, "callspec", None), "id", "") for item in request.session.items
            if item.path == request.path and getattr(item, "originalname", None) == test}


def layout_id(layout: Sequence[int], options: Mapping[str, Any]) -> str:
    """A layout case's parametrize id: ``pp{pp}tp{tp}dp{dp}-{schedule}-{checkpoint}``."""
    pp, tp, dp = layout
    return f"pp{pp}tp{tp}dp{dp}-{options.get('schedule', 'gpipe')}-" \
           f"{options.get('checkpoint', 'except_last')}"


def spawn_cases(fn: Callable[..., Any], nprocs: int, cases: Mapping[str, Sequence[Any]], *,
                timeout: float) -> dict[str, list[Any]]:
    """`fn` over every case on one set of `nprocs` ranks; each case's results in rank order."""
    ranks = hybridpar.spawn(each_case, nprocs, args=(fn, dict(cases)), timeout=timeout)
    return {name: [r[name] for r in ranks] for name in cases}


def spawn_by_world(fn: Callable[..., Any], cases: Mapping[str, tuple[int, Sequence[Any]]], *,
                   timeout: float) -> dict[str, list[Any]]:
    """`spawn_cases` of ``{name: (world size, args)}``: one spawn per world size, smallest
    first."""
    out: dict[str, list[Any]] = {}
    for world in sorted({w for w, _ in cases.values()}):
        out.update(spawn_cases(fn, world, {name: args for name, (w, args) in cases.items()
                                           if w == world}, timeout=timeout))
    return out
