"""HybridPipe against the plain single-device model: losses and weights over several steps."""

import pytest
import torch

import hybridpar

from pipe_harness import data, mlp, pipe_worker, reference, skipnet


def _assert_same(results, ref_losses, ref_state, tol=1e-5):
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=tol)
        assert list(r["state"]) == list(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=tol, rtol=0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_mlp_two_stages_matches_one_device(schedule, checkpoint):
    steps, batch = 3, 10
    xs, ys = data(steps, batch)
    ref_losses, ref_state = reference(mlp(), xs, ys)
    results = hybridpar.spawn(pipe_worker, 2, args=(
        "mlp", {}, [1, 3], (2, 1, 1), steps, batch,
        {"chunks": 4, "schedule": schedule, "checkpoint": checkpoint}), timeout=120)
    _assert_same(results, ref_losses, ref_state)


@pytest.mark.parametrize("layout,balance,schedule", [
    ((4, 1, 1), [1, 1, 1, 1], "1f1b"),
    ((2, 1, 2), [2, 2], "gpipe"),
    ((2, 1, 2), [3, 1], "1f1b"),
    ((4, 1, 1), [1, 1, 1, 1], "zb-h1"),
    ((2, 1, 2), [3, 1], "zb-h1"),          # dp buckets armed before the last W
])
def test_mlp_layouts_match_one_device(layout, balance, schedule):
    steps, batch = 3, 8
    dp = layout[2]
    xs, ys = data(steps, batch * dp)
    ref_losses, ref_state = reference(mlp(), xs, ys, optimizer="adamw")
    results = hybridpar.spawn(pipe_worker, layout[0] * layout[1] * dp, args=(
        "mlp", {}, balance, layout, steps, batch,
        {"chunks": 4, "schedule": schedule}, "adamw"), timeout=120)
    _assert_same(results, ref_losses, ref_state)


@pytest.mark.parametrize("batch,chunks,schedule", [
    (7, 4, "1f1b"), (3, 4, "1f1b"), (1, 4, "1f1b"), (7, 4, "zb-h1"), (3, 4, "zb-h1")])
def test_uneven_and_small_batches_match_one_device(batch, chunks, schedule):
    steps = 2
    xs, ys = data(steps, batch)
    ref_losses, ref_state = reference(mlp(), xs, ys)
    results = hybridpar.spawn(pipe_worker, 4, args=(
        "mlp", {}, [1, 1, 1, 1], (4, 1, 1), steps, batch,
        {"chunks": chunks, "schedule": schedule}), timeout=120)
    _assert_same(results, ref_losses, ref_state)


@pytest.mark.parametrize("balance,checkpoint,schedule", [
    (balance, checkpoint, "1f1b") for balance in ([1, 6], [2, 2, 3], [1, 1, 1, 4])
    for checkpoint in ("always", "never")] + [
    ([2, 2, 3], "always", "zb-h1"), ([1, 1, 1, 4], "never", "zb-h1")])
def test_skips_across_stages_match_one_device(balance, checkpoint, schedule):
    steps, batch = 3, 8
    xs, ys = data(steps, batch)
    ref_losses, ref_state = reference(skipnet(), xs, ys)
    results = hybridpar.spawn(pipe_worker, len(balance), args=(
        "skipnet", {}, balance, (len(balance), 1, 1), steps, batch,
        {"chunks": 4, "schedule": schedule, "checkpoint": checkpoint}), timeout=120)
    _assert_same(results, ref_losses, ref_state)
