"""Virtual stages: bad options are clear errors on every rank; a failing chunk stops every
rank promptly with its error (never a hang)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import hybridpar

from pipe_harness import mlp
from test_pipe_errors import _block, _block_of

TIMEOUT = 3.0


def _build(schedule, virtual, balance):
    topo = hybridpar.init(pp=2, timeout=30)
    try:
        hybridpar.HybridPipe(mlp(layers=8), balance, topology=topo, schedule=schedule,
                             virtual_stages=virtual)
    except Exception as e:
        return [type(e).__name__, str(e)]
    return ["no error", ""]


@pytest.mark.parametrize("schedule,virtual,balance,phrase", [
    ("1f1b", 2, [2, 2, 2, 2], "schedule '1f1b' holds one stage per rank, got virtual_stages=2"),
    ("zbv", 3, [2, 2, 2, 2], "schedule 'zbv' holds 2 stages per rank (a V), got "
                             "virtual_stages=3"),
    ("interleaved", 1, [4, 4], "needs virtual_stages >= 2 (with 1 it is schedule='1f1b')"),
    ("interleaved", 0, [4, 4], "virtual_stages must be a positive integer, got 0"),
    ("interleaved", "2", [4, 4], "virtual_stages must be a positive integer, got '2'"),
    ("interleaved", 2, [4, 4], "balance [4, 4] has 2 stages but the pipeline has "
                               "pp * virtual_stages=4"),
    ("zbv", None, [4, 4], "pp * virtual_stages=4"),
    ("zigzag", None, [4, 4], "unknown schedule 'zigzag'; choose one of 1f1b, gpipe, "
                             "interleaved, zb-h1, zbv"),
])
def test_bad_virtual_options_are_clear_errors_on_every_rank(schedule, virtual, balance, phrase):
    for kind, message in hybridpar.spawn(_build, 2, args=(schedule, virtual, balance),
                                         timeout=60):
        assert kind == "ValueError", message
        assert phrase in message, message


class Fails(nn.Module):
    def forward(self, x):
        raise KeyError("boom")


def _failing_chunk(schedule, failing):
    """pp 2 x 4 chunks of one layer; chunk `failing` raises in its first forward. Each rank
    returns (seconds until it stopped, error type, the step's block)."""
    topo = hybridpar.init(pp=2, timeout=TIMEOUT)
    layers: list[nn.Module] = [nn.Linear(4, 4) for _ in range(4)]
    layers[failing] = Fails()
    pipe = hybridpar.HybridPipe(nn.Sequential(*layers), [1, 1, 1, 1], chunks=4, topology=topo,
                                schedule=schedule, loss_fn=lambda out, y: out.pow(2).mean())
    start = time.monotonic()
    try:
        pipe.train_step(torch.randn(8, 4), torch.randn(8, 4))
        return [time.monotonic() - start, "", "no error"]
    except Exception as e:
        return [time.monotonic() - start, type(e).__name__, _block_of(e)]


@pytest.mark.parametrize("schedule,failing,rank", [
    ("interleaved", 2, 0),   # looped: chunk 2 is rank 0's second stage
    ("zbv", 2, 1),           # V: chunk 2 is rank 1's second stage
])
def test_a_failing_chunk_stops_every_rank_promptly_with_its_error(schedule, failing, rank):
    results = hybridpar.spawn(_failing_chunk, 2, args=(schedule, failing), timeout=60)
    seconds, kind, block = results[rank]
    assert kind == "KeyError", block          # the failing rank raises its own error
    head, _ = _block(block)
    assert head.startswith(f"stage {failing} (rank {rank}) failed at F(0)"), head
    other_seconds, other_kind, other_block = results[1 - rank]
    assert other_kind == "PipelineError", other_block
    assert "a peer failed first" in other_block and "boom" in other_block, other_block
    assert max(seconds, other_seconds) < TIMEOUT, results   # aborts, not the timeout


def _named_balance(name):
    topo = hybridpar.init(pp=2, timeout=30)
    pipe = hybridpar.HybridPipe(mlp(layers=8), name, topology=topo, schedule="zbv",
                                balance_sample=torch.randn(4, 8))
    return [pipe.balance, list(pipe.stages), list(pipe.layers)]


@pytest.mark.parametrize("name", ["params", "time"])
def test_named_balances_split_into_pp_times_v_stages(name):
    """A balance by name cuts the model into pp x v stages, the same on every rank."""
    (balance0, stages0, layers0), (balance1, stages1, layers1) = hybridpar.spawn(
        _named_balance, 2, args=(name,), timeout=120)
    assert balance0 == balance1 and len(balance0) == 4 and sum(balance0) == 8
    assert (stages0, stages1) == ([0, 3], [1, 2])
    assert sorted(layers0 + layers1) == list(range(8))
