"""The trainer reads the loss and gradient norm on the host only every `train.log_every`
steps (one read of all the steps since), so a GPU step never waits for the host; with
``train.nonfinite = "skip"`` a step decides on its own values: one read per step."""

from __future__ import annotations

import collections

import pytest
from host_reads import watching_reads
from test_train_run import config

import hybridpar
from hybridpar.train.trainer import train


def _counting(reads: collections.Counter):
    """Count host reads of tensor values made by the loop (hybridpar/train/trainer.py) and its
    step (train/step.py), by function."""
    def count(name, caller):
        if caller.co_filename.endswith(("train/trainer.py", "train/step.py")):
            reads[f"{caller.co_name}:{name}"] += 1
    return watching_reads(count)


def _run(run_dir: str, nonfinite: str):
    cfg = config("train.steps=6", "train.log_every=3", "checkpoint.every=0",
                 "train.grad_clip=1.0", f"train.nonfinite={nonfinite}")
    reads: collections.Counter = collections.Counter()
    with _counting(reads):
        summary = train(cfg, run_dir, progress=False)
    return dict(reads), summary["losses"]


@pytest.mark.parametrize("nonfinite,expected", [
    ("stop", {"resolve:tolist": 2}),                         # steps 3 and 6
    ("skip", {"resolve:tolist": 2, "train_step:tolist": 6}),  # and each step's own check
])
def test_the_host_reads_the_loss_only_every_log_every_steps(tmp_path, nonfinite, expected):
    results = hybridpar.spawn(_run, 4, args=(str(tmp_path / nonfinite), nonfinite), timeout=120)
    for reads, losses in results:
        per_step = {k: n for k, n in reads.items()   # not the start (resume, build) nor the end
                    if k.split(":")[0] in ("train", "train_step", "resolve", "step")}
        assert per_step == expected, reads
        assert len(losses) == 6 and all(isinstance(v, float) for v in losses)
