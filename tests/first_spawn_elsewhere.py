"""A session whose first spawn starts from another folder (run alone by test_torch_floor.py).

Not a test_*.py file: pytest collects it only when named. Its one test moves to its tmp_path
and spawns a rank there, first in the session, as a test of any file may in a pytest worker;
the rank must still have the suite's warning filters (conftest.py starts the forkserver from
the checkout once the tests are collected).
"""

from __future__ import annotations

import warnings

import pytest

import hybridpar


def _warning_case() -> str:
    """Whether a FutureWarning from a torch module fails this rank (pyproject's filters)."""
    try:
        warnings.warn_explicit("deprecated", FutureWarning, "torch/x.py", 1, module="torch.x")
    except FutureWarning:
        return "raised"
    return "passed"


def test_a_rank_spawned_first_from_another_folder_has_the_filters(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert hybridpar.spawn(_warning_case, 1, timeout=60) == ["raised"]
