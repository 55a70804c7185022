"""Bad input to HybridPipe: a clear error on every rank, never a hang."""

import time

import pytest
import torch
from torch import nn
from torchgpipe.skip import pop, skippable

import hybridpar

from pipe_harness import mlp


@skippable(pop=["nowhere"])
class PopsNothing(nn.Module):
    def forward(self, x):
        yield pop("nowhere")
        return x


def _build(case):
    topo = hybridpar.init(pp=2, timeout=30)
    model = mlp()
    ce = nn.functional.cross_entropy
    builders = {
        "not sequential": lambda: hybridpar.HybridPipe(nn.ModuleList(model), [2, 2],
                                                       topology=topo),
        "balance length": lambda: hybridpar.HybridPipe(model, [4], topology=topo),
        "balance sum": lambda: hybridpar.HybridPipe(model, [2, 3], topology=topo),
        "balance zero": lambda: hybridpar.HybridPipe(model, [4, 0], topology=topo),
        "balance type": lambda: hybridpar.HybridPipe(model, [2.0, 2.0], topology=topo),
        "chunks": lambda: hybridpar.HybridPipe(model, [2, 2], chunks=0, topology=topo),
        "checkpoint": lambda: hybridpar.HybridPipe(model, [2, 2], checkpoint="sometimes",
                                                   topology=topo),
        "schedule": lambda: hybridpar.HybridPipe(model, [2, 2], schedule="zb", topology=topo),
        "pop without stash": lambda: hybridpar.HybridPipe(
            nn.Sequential(nn.Linear(2, 2), PopsNothing()), [1, 1], topology=topo),
        "empty model": lambda: hybridpar.HybridPipe(nn.Sequential(), [1, 1], topology=topo),
        "no loss": lambda: hybridpar.HybridPipe(model, [2, 2], topology=topo).train_step(
            torch.randn(4, 8), torch.zeros(4, dtype=torch.long)),
        "rows differ": lambda: hybridpar.HybridPipe(model, [2, 2], topology=topo,
                                                    loss_fn=ce).train_step(
            torch.randn(4, 8), torch.zeros(3, dtype=torch.long)),
        "empty batch": lambda: hybridpar.HybridPipe(model, [2, 2], topology=topo,
                                                    loss_fn=ce).train_step(
            torch.randn(0, 8), torch.zeros(0, dtype=torch.long)),
        "not a tensor": lambda: hybridpar.HybridPipe(model, [2, 2], topology=topo,
                                                     loss_fn=ce).train_step(
            [1.0, 2.0], torch.zeros(2, dtype=torch.long)),
    }
    try:
        builders[case]()
    except Exception as e:
        return [type(e).__name__, str(e)]
    return ["no error", ""]


@pytest.mark.parametrize("case,error,phrase", [
    ("not sequential", "TypeError", "needs an nn.Sequential, got ModuleList"),
    ("balance length", "ValueError", "balance [4] has 1 stages but the pipeline has pp=2"),
    ("balance sum", "ValueError", "covers 5 layers but the model has 4"),
    ("balance zero", "ValueError", "has a stage with no layer"),
    ("balance type", "TypeError", "balance must hold integers"),
    ("chunks", "ValueError", "chunks must be a positive integer"),
    ("checkpoint", "ValueError", "checkpoint must be one of 'always'"),
    ("schedule", "ValueError", "unknown schedule 'zb'"),
    ("pop without stash", "TypeError", "'nowhere'"),
    ("empty model", "ValueError", "empty nn.Sequential"),
    ("no loss", "ValueError", "train_step needs a loss"),
    ("rows differ", "ValueError", "input has 4 rows but target has 3"),
    ("empty batch", "ValueError", "has no rows"),
    ("not a tensor", "TypeError", "must be a Tensor or a tuple of Tensors, got list"),
])
def test_bad_input_is_a_clear_error_on_every_rank(case, error, phrase):
    for kind, message in hybridpar.spawn(_build, 2, args=(case,), timeout=60):
        assert kind == error, message
        assert phrase in message


def _no_init():
    try:
        hybridpar.HybridPipe(mlp(), [4])
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_a_pipe_before_init_says_to_call_init():
    (message,) = hybridpar.spawn(_no_init, 1, timeout=60)
    assert "call hybridpar.init" in message


class ReturnsADict(nn.Module):
    def forward(self, x):
        return {"x": x}


def _bad_stage_output():
    topo = hybridpar.init(pp=2, timeout=300)
    pipe = hybridpar.HybridPipe(nn.Sequential(ReturnsADict(), nn.Identity()), [1, 1],
                                topology=topo, loss_fn=lambda out, y: out.sum())
    pipe.train_step(torch.randn(4, 2), torch.zeros(4))


def test_a_stage_that_fails_brings_the_job_down_promptly_with_its_error():
    start = time.monotonic()
    with pytest.raises(hybridpar.SpawnError) as info:
        hybridpar.spawn(_bad_stage_output, 2, timeout=120)
    assert info.value.rank == 0  # the original error, not the peer's wait
    assert "stage 0" in info.value.trace and "F(0)" in info.value.trace
    assert "returned dict; a stage must return a Tensor or a tuple of Tensors" in info.value.trace
    assert time.monotonic() - start < 30  # far below the 300 s wait timeout


def _stage_zero_stalls():
    topo = hybridpar.init(pp=2, timeout=2)
    pipe = hybridpar.HybridPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1],
                                topology=topo, loss_fn=lambda out, y: out.sum())
    if topo.pp_rank == 0:
        time.sleep(6)  # never sends within the 2 s timeout
        return "stalled"
    start = time.monotonic()
    try:
        pipe.train_step(torch.randn(2, 2), torch.zeros(2))
    except hybridpar.PipelineError as e:
        return [time.monotonic() - start, str(e)]
    return "no error"


def test_a_wait_past_the_topology_timeout_names_the_stage_microbatch_and_peer():
    _, (waited, message) = hybridpar.spawn(_stage_zero_stalls, 2, timeout=60)
    assert waited < 5
    assert ("stage 1 (rank 1) gave up waiting for the activation of micro-batch 0 from rank 0"
            in message)


def _named_balance(name, with_sample):
    topo = hybridpar.init(pp=2, timeout=60)
    sample = torch.randn(4, 8) if with_sample else None
    try:
        pipe = hybridpar.HybridPipe(mlp(), name, topology=topo, balance_sample=sample,
                                    loss_fn=nn.functional.cross_entropy)
    except ValueError as e:
        return str(e)
    loss = pipe.train_step(torch.randn(4, 8), torch.zeros(4, dtype=torch.long))
    return {"balance": pipe.balance, "loss": loss.item()}


@pytest.mark.parametrize("name", ["params", "uniform", "time", "size"])
def test_named_balances_give_every_rank_the_same_split(name):
    r0, r1 = hybridpar.spawn(_named_balance, 2, args=(name, True), timeout=120)
    assert r0["balance"] == r1["balance"] and sum(r0["balance"]) == 4
    assert min(r0["balance"]) >= 1 and r0["loss"] == r1["loss"]


def test_profiling_balances_need_a_sample_and_unknown_names_are_rejected():
    for message in hybridpar.spawn(_named_balance, 2, args=("time", False), timeout=60):
        assert "balance='time' profiles the model on a sample: pass balance_sample=" in message
    for message in hybridpar.spawn(_named_balance, 2, args=("fastest", True), timeout=60):
        assert "unknown balance 'fastest'" in message
