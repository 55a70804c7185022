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
from hybridpar.comm import p2p as comm
from hybridpar.pipeline.failures.watchdog import Watchdog


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
    pipe._executor.watchdog.publish = lambda _: None     # (publishing: tested below)
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
    from hybridpar.pipe.build import watchdog_timeout
    from hybridpar.topology import ParallelDims, Topology

    topo = Topology(ParallelDims(), 0, None, timeout=datetime.timedelta(seconds=7))
    assert watchdog_timeout(None, topo) is None            # gloo: every wait is bounded
    # before NCCL's own watchdog, which fires at the process groups' timeout
    assert watchdog_timeout(True, topo) == datetime.timedelta(seconds=7 * 0.9)
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
    pipe._executor.watchdog.publish = lambda _: None     # (publishing: tested below)
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


# the whole step as the host sees it, the device's part, a lost store, the report published ----

def test_entries_nest_and_the_devices_part_is_watched_after_the_host_left():
    seen: list[str] = []
    done: list[bool] = []
    dog = Watchdog(datetime.timedelta(seconds=0.3), describe=lambda stuck: f"host done "
                   f"{dog.host_done}", on_hang=seen.append, poll=0.05)
    dog.enter()                 # train_step
    dog.enter()                 # its schedule
    dog.leave()                 # the schedule ended: still inside train_step
    assert dog.armed and not dog.host_done
    dog.leave(until=lambda: bool(done))   # the host left; the device has queued work
    assert dog.armed and dog.host_done
    time.sleep(0.6)             # the device never finishes: reported
    assert seen == ["host done True"]
    dog.enter()
    dog.leave(until=lambda: bool(done))
    done.append(True)           # the device finishes: disarmed, nothing reported
    time.sleep(0.5)
    dog.close()
    assert seen == ["host done True"] and not dog.armed


def test_a_lost_store_is_reported_once_and_a_hang_is_still_seen():
    seen: list[str] = []
    warnings: list[str] = []

    def store_gone() -> str | None:
        raise RuntimeError("Connection reset by peer")

    dog = Watchdog(datetime.timedelta(seconds=0.3), describe=lambda stuck: "stuck",
                   peer_failed=store_gone, on_hang=seen.append, on_warning=warnings.append,
                   poll=0.05)
    dog.enter()
    time.sleep(0.6)
    dog.close()
    assert len(warnings) == 1 and "the rendezvous store is unreachable (RuntimeError: " \
        "Connection reset by peer)" in warnings[0]
    assert seen == ["stuck"]


def test_an_own_hang_is_published_and_a_peers_is_not():
    published: list[str] = []
    own = Watchdog(datetime.timedelta(seconds=0.1), describe=lambda stuck: "mine",
                   on_hang=lambda _: None, publish=published.append, poll=0.05)
    peer = Watchdog(datetime.timedelta(seconds=60), describe=lambda stuck: "mine",
                    peer_failed=lambda: "theirs", on_hang=lambda _: None,
                    publish=published.append, poll=0.05)
    own.enter()
    peer.enter()
    time.sleep(0.4)
    own.close()
    peer.close()
    assert published == ["mine"]


def _stall_before_dp(folder: str):
    """dp=2 on gloo with a 1 s watchdog (30 s timeouts): rank 1 stops for 4 s after its
    schedule, before the dp all-reduce of the gradients, without dying."""
    topo = hybridpar.init(dp=2, timeout=30)
    torch.manual_seed(0)
    pipe = hybridpar.HybridPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [2],
                                chunks=2, topology=topo, loss_fn=lambda o, y: o.pow(2).mean(),
                                watchdog=1.0)
    report = Path(folder) / f"rank{topo.rank}.txt"
    pipe._executor.watchdog.on_hang = report.write_text  # instead of exiting the process
    if topo.rank == 1:
        finish = pipe._dp_buckets.finish
        pipe._dp_buckets.finish = lambda: (time.sleep(4), finish())[1]
    x = torch.randn(4, 4)
    pipe.train_step(x, x)
    pipe.close()
    return report.read_text() if report.exists() else ""


def test_a_rank_stopped_after_its_schedule_is_reported_where_the_step_waits(tmp_path):
    rank0, rank1 = hybridpar.spawn(_stall_before_dp, 2, args=(str(tmp_path),), timeout=60)
    # rank 0 waits in a dp all-reduce after the schedule (its gradient buckets went out during
    # the backward, so the loss's), or reads rank 1's published report first; rank 1 reports
    # itself stuck on the host, or rank 0's report
    waits = "over dp (ranks [0, 1])" in rank0 and "waiting for:    the all-reduce of the " \
        in rank0
    told = "a peer failed first: stage 0 (rank 1) is stuck at the end of train_step" in rank0
    assert waits or told, rank0
    assert "stage 0 (rank 1) is stuck at the end of train_step" in rank1 or \
        "a peer failed first: stage 0 (rank 0) is stuck" in rank1, rank1


# a rank stuck in its own compute (issue 40 point 12) --------------------------------------------

class _Stall(nn.Module):
    """A linear layer whose first forward on rank 1 stalls 4 s (before its `all_reduce`
    over the world, in mode "collective")."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.linear, self.mode, self.calls = nn.Linear(4, 4), mode, 0

    def forward(self, x):
        import torch.distributed as dist

        self.calls += 1
        if self.calls == 1 and dist.get_rank() == 1:
            time.sleep(4)
        if self.mode == "collective" and self.calls == 1:
            x = x.clone()
            dist.all_reduce(x)               # rank 0 waits here for rank 1
        return self.linear(x)


def _stuck_in_compute(folder: str, mode: str):
    """mode "layer": pp=2, stage 1's layer 1 stalls in F(0) after its receive completed;
    mode "collective": dp=2, rank 0 blocks in a collective inside layer 0 that rank 1 joins
    4 s late. A 1 s watchdog; each rank's report (or "")."""
    topo = hybridpar.init(**({"pp": 2} if mode == "layer" else {"dp": 2}), timeout=30)
    torch.manual_seed(0)
    layers = [nn.Linear(4, 4), _Stall(mode)] if mode == "layer" else [_Stall(mode)]
    pipe = hybridpar.HybridPipe(nn.Sequential(*layers), [1, 1] if mode == "layer" else [1],
                                chunks=2, topology=topo, loss_fn=lambda o, y: o.pow(2).mean(),
                                watchdog=1.0)
    report = Path(folder) / f"rank{topo.rank}.txt"
    pipe._executor.watchdog.on_hang = report.write_text  # instead of exiting the process
    pipe._executor.watchdog.publish = lambda _: None
    x = torch.randn(4, 4)
    pipe.train_step(x, x)
    pipe.close()
    return report.read_text() if report.exists() else ""


def test_a_rank_stuck_in_its_own_layer_says_so_and_blames_no_peer(tmp_path):
    # before: "waiting for: receive the activation of micro-batch 0 from stage 0 (rank 0)",
    # a receive that had completed: it blamed a healthy peer
    _, stage1 = hybridpar.spawn(_stuck_in_compute, 2, args=(str(tmp_path), "layer"),
                                timeout=60)
    assert stage1.startswith("stage 1 (rank 1) is stuck in its own compute at F(0) of "
                             "train_step: no progress for "), stage1
    assert "waiting for:    nothing from a peer: no communication of the pipeline is " \
        "pending" in stage1, stage1
    assert "computing:      the forward of micro-batch 0 on stage 1, in layer 1 (_Stall)\n" \
        in stage1, stage1
    assert "receive the activation" not in stage1, stage1


def test_a_rank_blocked_in_a_collective_inside_its_layer_names_it(tmp_path):
    rank0, rank1 = hybridpar.spawn(_stuck_in_compute, 2, args=(str(tmp_path), "collective"),
                                   timeout=60)
    assert rank0.startswith("stage 0 (rank 0) is stuck in its own compute at F(0)"), rank0
    assert "in layer 0 (_Stall), blocked in torch.distributed's all_reduce" in rank0, rank0
    assert "in layer 0 (_Stall)\n" in rank1, rank1        # rank 1 sleeps in it
