"""Only a stage with @skippable layers runs its computes under a skip tracker; a stage without
one (the last of skipnet split [6, 1], or any MLP stage) skips that set-up, and both train
exactly as one device does (1F1B and GPipe, 3 SGD steps)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridpar

from pipe_harness import data, make_optimizer, mlp, reference, skipnet

BUILDERS = {"mlp": mlp, "skipnet": skipnet}


def _worker(model_name, balance, schedule):
    topo = hybridpar.init(pp=2, timeout=60)
    pipe = hybridpar.HybridPipe(BUILDERS[model_name](), balance, chunks=4, topology=topo,
                                schedule=schedule, loss_fn=nn.functional.cross_entropy)
    opt = make_optimizer("sgd", pipe.parameters())
    losses = []
    for x, y in zip(*data(3, 8)):
        opt.zero_grad()
        losses.append(pipe.train_step(x, y).item())
        opt.step()
    return {"skippable": pipe._executor.skippable, "losses": losses,
            "state": pipe.consolidated_state_dict()}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("model_name, balance, skippable", [
    ("skipnet", [6, 1], [True, False]),      # both skips end in stage 0; stage 1: a Linear
    ("skipnet", [3, 4], [True, True]),       # the skips cross to stage 1
    ("mlp", [2, 2], [False, False]),
])
@pytest.mark.timeout(120)
def test_a_stage_without_skippable_layers_runs_without_a_tracker_and_matches_one_device(
        schedule, model_name, balance, skippable):
    results = hybridpar.spawn(_worker, 2, args=(model_name, balance, schedule), timeout=90)
    ref_losses, ref_state = reference(BUILDERS[model_name](), *data(3, 8))
    assert [r["skippable"] for r in results] == skippable
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-6, rtol=0)
