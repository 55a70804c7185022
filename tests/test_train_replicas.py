"""`parallel.check_replicas = N`: the trainer compares the copies of every replicated parameter
after the backward of steps N, 2N, ...; copies that agree train on, copies that drift stop the
run on every rank with `ReplicaMismatchError` naming the step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
from spawn_cases import spawn_cases

from hybridpar.pipe import HybridPipe
from hybridpar.train import load_config
from hybridpar.train.metrics import read_metrics
from hybridpar.train.trainer import train

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.toml"
TIMEOUT = 90

# a tiny GPT on one stage, tp=2 x dp=2: every replicated parameter has a tp copy and a dp copy
BASE = ["model.block_size=8", "model.n_embd=16", "model.n_layer=1", "model.n_head=2",
        "data.source=synthetic", "parallel.pp=1", "parallel.tp=2", "parallel.dp=2",
        "parallel.chunks=1", "parallel.timeout=60", "train.batch_size=4", "train.log_every=1",
        "train.sample_tokens=0", "checkpoint.every=0"]
NORM = "2.weight"          # the final LayerNorm's weight: replicated over tp and dp


def _train(cfg, run_dir, drift_at):
    """Train `cfg`; with `drift_at`, rank 0 nudges the final norm's gradient after that step's
    backward, as a gradient that is only its rank's part would. What `train` raised, as
    "Type: message", else None."""
    real = HybridPipe.train_step
    calls = 0

    def drifting(self, *args, **kwargs):
        nonlocal calls
        loss = real(self, *args, **kwargs)
        calls += 1
        if calls == drift_at and dist.get_rank() == 0:
            dict(self.named_parameters())[NORM].grad.add_(1e-3)
        return loss

    HybridPipe.train_step = drifting          # this rank's process only
    try:
        train(cfg, run_dir, progress=False)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        HybridPipe.train_step = real
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs on the same 4 ranks: every step checked, copies equal; checked every 2nd
    step, rank 0's copy nudged at step 3 (the drift lands in the values at step 4)."""
    root = tmp_path_factory.mktemp("replicas")
    cases = {
        "equal": (load_config(QUICKSTART, [*BASE, "train.steps=3",
                                           "parallel.check_replicas=1"]),
                  str(root / "equal"), 0),
        "drift": (load_config(QUICKSTART, [*BASE, "train.steps=5", "parallel.check_replicas=2"]),
                  str(root / "drift"), 3),
    }
    return root, spawn_cases(_train, 4, cases, timeout=TIMEOUT)


def test_a_run_checked_every_step_at_tp2_dp2_trains_and_logs_no_difference(runs):
    root, results = runs
    assert results["equal"] == [None] * 4
    records = read_metrics(root / "equal" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["replica_diff"] for r in records] == [0.0] * 3


def test_copies_that_drift_stop_the_run_on_every_rank_at_the_next_checked_step(runs):
    root, results = runs
    errors = results["drift"]
    assert all(e is not None and e.startswith("ReplicaMismatchError: step 4 "
                                              "(parallel.check_replicas = 2") for e in errors)
    assert f"'{NORM}' differs in values by" in errors[0]   # rank 0 names its parameter
    records = read_metrics(root / "drift" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]       # stopped before step 4's update
    assert [("replica_diff" in r) for r in records] == [False, True, False]
