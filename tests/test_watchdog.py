"""The watchdog: a stage stuck past its timeout is reported from a thread (what NCCL needs,
since its waits do not time out on the host), and a peer's published abort stops it."""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import hybridpar
from hybridpar import comm
from hybridpar.pipeline.watchdog import Watchdog


def test_no_progress_past_the_timeout_is_reported_once():
    seen: list[str] = []
    dog = Watchdog(datetime.timedelta(seconds=0.2), describe=lambda stuck: f"stuck {stuck:.1f}",
                   on_hang=seen.append, poll=0.05)
    dog.enter()
    time.sleep(0.6)
    dog.close()
    assert len(seen) == 1 and seen[0].startswith("stuck 0.")


def test_beats_and_completed_operations_count_as_progress_and_leave_disarms():
    seen: list[str] = []
    pending = ["a", "b", "c", "d", "e", "f", "g", "h"]
    dog = Watchdog(datetime.timedelta(seconds=0.3), describe=lambda stuck: "stuck",
                   pending=lambda: pending, on_hang=seen.append, poll=0.05)
    dog.enter()
    for _ in range(4):          # the host beats: 0.8 s in all, never 0.3 s without progress
        time.sleep(0.2)
        dog.beat()
    for _ in range(4):          # the device completes operations
        time.sleep(0.2)
        pending.pop()
    dog.leave()
    time.sleep(0.5)             # not armed between steps
    dog.close()
    assert seen == []


def test_a_peer_failure_is_reported_without_waiting_for_the_timeout():
    seen: list[str] = []
    failed: list[str] = []
    dog = Watchdog(datetime.timedelta(seconds=60), describe=lambda stuck: "stuck",
                   peer_failed=lambda: failed[0] if failed else None, on_hang=seen.append,
                   poll=0.05)
    dog.enter()
    time.sleep(0.15)
    failed.append("a peer failed first")
    time.sleep(0.3)
    dog.close()
    assert seen == ["a peer failed first"]


def _watched(folder: str, mode: str):
    """pp=2 on gloo with a 1 s watchdog (a 30 s topology timeout); stage 1 stalls 4 s before
    its step (mode "stall"), or first publishes an abort of the step ("abort")."""
    topo = hybridpar.init(pp=2, timeout=30)
    torch.manual_seed(0)
    pipe = hybridpar.HybridPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1],
                                chunks=2, topology=topo, loss_fn=lambda o, y: o.pow(2).mean(),
                                watchdog=1.0)
    report = Path(folder) / f"rank{topo.rank}.txt"
    pipe._executor.watchdog.on_hang = report.write_text  # instead of exiting the process
    x = torch.randn(4, 4)
    if topo.pp_rank == 1:
        if mode == "abort":
            comm.publish_abort(0, origin_rank=1, origin_stage=1,
                               message="stage 1 (rank 1) failed at F(0): boom")
        time.sleep(4)
    pipe.train_step(x, x)
    pipe._executor.watchdog.close()
    return report.read_text() if report.exists() else ""


@pytest.mark.parametrize("mode", ["stall", "abort"])
def test_a_watched_stage_reports_where_it_waits_while_its_peer_stalls(tmp_path, mode):
    stage0, stage1 = hybridpar.spawn(_watched, 2, args=(str(tmp_path), mode), timeout=60)
    assert stage1 == ""                              # stage 1 itself made progress
    if mode == "stall":
        # GPipe on stage 0: F0 F1 run, B1 waits for stage 1's gradient
        assert stage0.startswith("stage 0 (rank 0) is stuck at B(1) of train_step: no "
                                 "progress for "), stage0
        assert "(watchdog, timeout 0:00:01)" in stage0
        assert "  waiting for:    receive the gradient of micro-batch 1 from stage 1 (rank 1)" \
            in stage0
    else:
        assert stage0.startswith("stage 0 (rank 0) stopped at B(1) of train_step; a peer "
                                 "failed first: stage 1 (rank 1) failed at F(0): boom"), stage0
        assert "rank 1's abort in the store (watchdog)" in stage0


def test_watchdog_values_are_checked():
    from hybridpar.pipeline.build import watchdog_timeout
    from hybridpar.topology import ParallelDims, Topology

    topo = Topology(ParallelDims(), 0, None, timeout=datetime.timedelta(seconds=7))
    assert watchdog_timeout(None, topo) is None            # gloo: every wait is bounded
    assert watchdog_timeout(True, topo) == datetime.timedelta(seconds=7)
    assert watchdog_timeout(2.5, topo) == datetime.timedelta(seconds=2.5)
    with pytest.raises(ValueError, match="watchdog must be True, False, None or positive"):
        watchdog_timeout(-1, topo)


def _watched_virtual(folder: str):
    """ZBV on pp=2 with a 1 s watchdog: rank 1 stalls 4 s before its step; rank 0 (stages 0
    and 3) reports the stage it is stuck in, not its first."""
    topo = hybridpar.init(pp=2, timeout=30)
    torch.manual_seed(0)
    pipe = hybridpar.HybridPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]),
                                [1, 1, 1, 1], chunks=2, topology=topo, schedule="zbv",
                                loss_fn=lambda o, y: o.pow(2).mean(), watchdog=1.0)
    report = Path(folder) / f"rank{topo.rank}.txt"
    pipe._executor.watchdog.on_hang = report.write_text  # instead of exiting the process
    x = torch.randn(4, 4)
    if topo.pp_rank == 1:
        time.sleep(4)
    pipe.train_step(x, x)
    pipe._executor.watchdog.close()
    return report.read_text() if report.exists() else ""


def test_a_watched_rank_of_virtual_stages_reports_the_stage_it_waits_in(tmp_path):
    rank0, rank1 = hybridpar.spawn(_watched_virtual, 2, args=(str(tmp_path),), timeout=60)
    assert rank1 == ""
    # ZBV rank 0: 0F0 0F1, then stage 3's F0 waits for stage 2's activation (rank 1)
    assert rank0.startswith("stage 3 (rank 0) is stuck at F(0) of train_step"), rank0
    assert "receive the activation of micro-batch 0 from stage 2 (rank 1)" in rank0, rank0
