"""HybridPipe against the plain single-device model: losses and weights over several steps.

Every run is a case of one spawn per world size (the `runs` module fixture: 2, 3 and 4 ranks;
a case calls `hybridpar.init` with its own layout), and each keeps its own test asserting
its own case against the single-device reference.
"""

import pytest
import torch
from spawn_cases import spawn_by_world

from pipe_harness import data, mlp, pipe_worker, reference, skipnet


def _assert_same(results, ref_losses, ref_state, tol=1e-5):
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=tol)
        assert list(r["state"]) == list(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=tol, rtol=0)


SCHEDULES = ["gpipe", "1f1b", "zb-h1"]
CHECKPOINTS = ["always", "except_last", "never"]
LAYOUTS = [
    ((4, 1, 1), [1, 1, 1, 1], "1f1b"),
    ((2, 1, 2), [2, 2], "gpipe"),
    ((2, 1, 2), [3, 1], "1f1b"),
    ((4, 1, 1), [1, 1, 1, 1], "zb-h1"),
    ((2, 1, 2), [3, 1], "zb-h1"),          # dp buckets armed before the last W
]
SMALL = [(7, 4, "1f1b"), (3, 4, "1f1b"), (1, 4, "1f1b"), (7, 4, "zb-h1"), (3, 4, "zb-h1")]
SKIPS = [(balance, checkpoint, "1f1b") for balance in ([1, 6], [2, 2, 3], [1, 1, 1, 4])
         for checkpoint in ("always", "never")] + [
    ([2, 2, 3], "always", "zb-h1"), ([1, 1, 1, 4], "never", "zb-h1")]


@pytest.fixture(scope="module")
def runs():
    """Every test's pipe_worker arguments as a named case, run on the ranks of its world."""
    cases = {}   # name -> (world size, pipe_worker's arguments)
    for schedule in SCHEDULES:
        for checkpoint in CHECKPOINTS:
            cases[f"mlp {schedule} {checkpoint}"] = (2, (
                "mlp", {}, [1, 3], (2, 1, 1), 3, 10,
                {"chunks": 4, "schedule": schedule, "checkpoint": checkpoint}))
    for layout, balance, schedule in LAYOUTS:
        cases[f"layout {layout} {balance} {schedule}"] = (layout[0] * layout[1] * layout[2], (
            "mlp", {}, balance, layout, 3, 8, {"chunks": 4, "schedule": schedule}, "adamw"))
    for batch, chunks, schedule in SMALL:
        cases[f"small {batch} {chunks} {schedule}"] = (4, (
            "mlp", {}, [1, 1, 1, 1], (4, 1, 1), 2, batch,
            {"chunks": chunks, "schedule": schedule}))
    for balance, checkpoint, schedule in SKIPS:
        cases[f"skips {balance} {checkpoint} {schedule}"] = (len(balance), (
            "skipnet", {}, balance, (len(balance), 1, 1), 3, 8,
            {"chunks": 4, "schedule": schedule, "checkpoint": checkpoint}))
    return spawn_by_world(pipe_worker, cases, timeout=240)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_mlp_two_stages_matches_one_device(schedule, checkpoint, runs):
    steps, batch = 3, 10
    xs, ys = data(steps, batch)
    ref_losses, ref_state = reference(mlp(), xs, ys)
    _assert_same(runs[f"mlp {schedule} {checkpoint}"], ref_losses, ref_state)


@pytest.mark.parametrize("layout,balance,schedule", LAYOUTS)
def test_mlp_layouts_match_one_device(layout, balance, schedule, runs):
    steps, batch = 3, 8
    dp = layout[2]
    xs, ys = data(steps, batch * dp)
    ref_losses, ref_state = reference(mlp(), xs, ys, optimizer="adamw")
    _assert_same(runs[f"layout {layout} {balance} {schedule}"], ref_losses, ref_state)


@pytest.mark.parametrize("batch,chunks,schedule", SMALL)
def test_uneven_and_small_batches_match_one_device(batch, chunks, schedule, runs):
    steps = 2
    xs, ys = data(steps, batch)
    ref_losses, ref_state = reference(mlp(), xs, ys)
    _assert_same(runs[f"small {batch} {chunks} {schedule}"], ref_losses, ref_state)


@pytest.mark.parametrize("balance,checkpoint,schedule", SKIPS)
def test_skips_across_stages_match_one_device(balance, checkpoint, schedule, runs):
    steps, batch = 3, 8
    xs, ys = data(steps, batch)
    ref_losses, ref_state = reference(skipnet(), xs, ys)
    _assert_same(runs[f"skips {balance} {checkpoint} {schedule}"], ref_losses, ref_state)
