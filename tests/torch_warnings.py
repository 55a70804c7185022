"""The suite's warning filters (pyproject.toml's `filterwarnings`) in every spawned rank.

pytest applies its `filterwarnings` in the pytest process only; `hybridpar.spawn`'s ranks fork
from a forkserver, a process of its own. conftest.py has the forkserver import this module,
last of its preloads, and the filters it sets here are inherited by every rank it forks: a
FutureWarning / DeprecationWarning from torch then fails a rank (a `SpawnError`) as it fails
a test in the pytest process.
"""

from __future__ import annotations

import builtins
import tomllib
import warnings
from pathlib import Path

__all__ = ["FILTERS", "apply"]

with open(Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
    FILTERS: list[str] = tomllib.load(f)["tool"]["pytest"]["ini_options"]["filterwarnings"]


def apply() -> None:
    """Add every ``action:message:category:module`` line of `FILTERS` (the message and
    module are regular expressions, as pytest reads them from its configuration)."""
    for line in FILTERS:
        action, message, category, module = (line.split(":") + [""] * 4)[:4]
        warnings.filterwarnings(action, message, getattr(builtins, category or "Warning"),
                                module)


apply()
