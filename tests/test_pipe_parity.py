"""HybridPipe against the plain single-device model: losses and weights over several steps."""

import pytest
import torch

import hybridpar
from pipe_harness import data, mlp, pipe_worker, reference


def _assert_same(results, ref_losses, ref_state, tol=1e-5):
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=tol)
        assert list(r["state"]) == list(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=tol, rtol=0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_mlp_two_stages_matches_one_device(schedule, checkpoint):
    steps, batch = 3, 10
    xs, ys = data(steps, batch)
    ref_losses, ref_state = reference(mlp(), xs, ys)
    results = hybridpar.spawn(pipe_worker, 2, args=(
        "mlp", {}, [1, 3], (2, 1, 1), steps, batch,
        {"chunks": 4, "schedule": schedule, "checkpoint": checkpoint}), timeout=120)
    _assert_same(results, ref_losses, ref_state)
