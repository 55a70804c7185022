"""After a caught failure the processes go on: `hybridpar.init` rebuilds the process groups
(gloo) and a new pipe trains exactly; the broken pipe refuses at once, saying how to recover.

torchgpipe's test sequence in one process pair: an in-place error in a checkpointed stage
(test_inplace.py), then a pipe balanced by time (test_balance.py) in the same processes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridpar
from hybridpar.process import generation

from pipe_harness import attempt, checked_step, data, mlp, reference


def _sum(output, target):
    return output.sum()


def _worker():
    topo = hybridpar.init(pp=2, timeout=10)
    r = {}
    # 1. stage 1's input is a leaf that requires grad; ReLU(inplace=True) on it raises there,
    #    and stage 0 gets a PipelineError (its wait is broken: the gloo pairs close)
    torch.manual_seed(0)
    broken = hybridpar.HybridPipe(nn.Sequential(nn.Linear(1, 1), nn.ReLU(inplace=True)),
                                  [1, 1], checkpoint="always", topology=topo, loss_fn=_sum)
    r["failure"] = attempt(lambda: broken.train_step(torch.rand(1, 1), torch.zeros(1)))
    # 2. the broken pipe, and a new pipe on the old topology, refuse at once
    r["old pipe"] = attempt(lambda: broken.train_step(torch.rand(1, 1), torch.zeros(1)))
    r["old topology"] = attempt(lambda: hybridpar.HybridPipe(
        nn.Sequential(nn.Linear(1, 1), nn.ReLU()), [1, 1], topology=topo))
    # 3. init again: a new generation of process groups; a pipe balanced by time trains as
    #    on one device
    topo = hybridpar.init(pp=2, timeout=10)
    r["generation"] = topo.generation
    xs, ys = data(3, 8)
    pipe = hybridpar.HybridPipe(mlp(), "time", chunks=2, topology=topo, balance_sample=xs[0],
                                loss_fn=nn.functional.cross_entropy, schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    r["balance"] = pipe.balance
    r["losses"] = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        r["losses"].append(checked_step(pipe, x, y))
        opt.step()
    r["state"] = pipe.consolidated_state_dict()
    return r


@pytest.fixture(scope="module")
def results():
    return hybridpar.spawn(_worker, 2, timeout=120)


def test_the_failure_is_raised_on_both_ranks(results):
    assert results[1]["failure"][0] == "RuntimeError"          # the in-place op's own error
    assert results[0]["failure"][0] == "PipelineError"


def test_a_pipe_on_broken_groups_refuses_at_once_and_says_how_to_recover(results):
    for r in results:
        for key, what in (("old pipe", "train_step"), ("old topology", "HybridPipe(...)")):
            kind, message = r[key]
            assert kind == "GroupsBroken", (key, message)
            assert message.startswith(f"{what} cannot run: the process groups are unusable "
                                      "after a failed step (train_step failed: "), message
            assert "call hybridpar.init(...) again on every rank" in message
            assert "hybridpar run --max-restarts N" in message


def test_init_rebuilds_the_groups_and_a_pipe_balanced_by_time_trains_exactly(results):
    xs, ys = data(3, 8)
    ref_losses, ref_state = reference(mlp(), xs, ys, chunks=2)
    for r in results:
        assert r["generation"] == 1 and sum(r["balance"]) == len(mlp())
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-6, rtol=0, msg=k)


def test_on_nccl_the_way_back_is_a_restart(monkeypatch):
    monkeypatch.setattr(generation.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(generation.dist, "get_backend", lambda: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(generation, "_broken", "train_step failed: PipelineError: stuck")
    with pytest.raises(generation.GroupsBroken, match=r"restart the processes \(hybridpar run "
                       r"--max-restarts N resumes from the last checkpoint\): NCCL's "
                       r"communicators cannot be rebuilt in-process"):
        generation.check_usable(generation.current(), "train_step")


class _Boom(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom in the last layer")


def _one_rank_never_comes_back():
    """pp=3: the last stage's layer raises; ranks 0 and 1 call hybridpar.init again (a 3 s
    timeout), rank 2 does not (it goes on with something else, as a rank whose script let
    the error end its loop)."""
    topo = hybridpar.init(pp=3, timeout=10)
    pipe = hybridpar.HybridPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), _Boom()),
                                [1, 1, 1], topology=topo, loss_fn=_sum)
    failed = attempt(lambda: pipe.train_step(torch.rand(2, 2), torch.zeros(2)))
    if topo.rank == 2:
        return failed, ["not called", ""]
    return failed, attempt(lambda: hybridpar.init(pp=3, timeout=3))


def test_a_rank_that_never_calls_init_again_is_named_with_the_remedy():
    # issue 40 point 11: before, the ranks that came back ended with a bare
    # "DistStoreError: wait timeout ..., keys: /hybridpar/generation/1/...", naming no rank
    results = hybridpar.spawn(_one_rank_never_comes_back, 3, timeout=90)
    assert results[2][0][0] == "RuntimeError"                    # the layer's own error
    for rank in (0, 1):
        kind, message = results[rank][1]
        assert kind == "GroupsBroken", message
        assert message.startswith(f"hybridpar.init on rank {rank} waited 0:00:03 for every "
                                  "rank to rebuild the process groups after the failed step; "
                                  "rank(s) [2] of 3 did not call hybridpar.init again."), message
        assert "each must catch it and call hybridpar.init(...) again" in message
        assert "hybridpar run --max-restarts N" in message
