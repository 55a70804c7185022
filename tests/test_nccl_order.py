"""NCCL's point-to-point rules, replayed on CPU: the lowering of every schedule progresses.

`lowering.check_schedule` lowers a whole (dp, pp, tp) grid the way the executor issues it
and replays it under NCCL's matching and rendezvous rules (`replay`, tested on literal groups
in test_replay.py). The real gloo runs are recorded and replayed in test_p2p_order.py.
"""

from __future__ import annotations

import pytest

from hybridpar.pipeline.schedules.lowering import check_schedule, lower_stage
from hybridpar.pipeline.schedules.replay import NCCLOrderError, P2POp, replay
from hybridpar.pipeline.schedules.schedule import SCHEDULES, one_f_one_b


def send(peer, label="x", numel=4, dtype="float"):
    return P2POp("send", peer, numel, dtype, label)


def recv(peer, label="x", numel=4, dtype="float"):
    return P2POp("recv", peer, numel, dtype, label)


# the rule that moved the loss after the schedule --------------------------------------

def test_a_receive_posted_before_the_schedule_deadlocks():
    # the loss receive posted first on stage 0 holds its stream: its send of F0 never goes
    groups = {0: [[recv(1, "loss", 1)], [send(1, "F0")]],
              1: [[recv(0, "F0")], [send(0, "loss", 1)]]}
    with pytest.raises(NCCLOrderError, match="deadlock"):
        replay(groups)


# every schedule, lowered as the executor issues it ---------------------------------------

def _skips(p):
    """No skips; one over the whole pipeline; several, adjacent and not."""
    if p == 1:
        return [()]
    return [(), ((0, p - 1),), ((0, 1), (0, p - 1), (1, p - 1), (p // 2, p - 1))]


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_every_schedule_progresses_under_nccl_rules_with_skips_and_new_shapes(name, p):
    for m in (1, 2, 3, 4, 5, 7, 8, 16, 32):
        for routes in _skips(p):
            for new_shapes in (False, True):
                result = check_schedule(SCHEDULES[name](p, m), routes=routes,
                                        new_shapes=new_shapes)
                assert result.pairs > 0 or p == 1


@pytest.mark.parametrize("name", SCHEDULES)
def test_dp_and_tp_replicas_progress_together(name):
    for tp, dp in ((2, 1), (1, 2), (2, 2), (4, 2)):
        result = check_schedule(SCHEDULES[name](4, 8), routes=((0, 3),), tp=tp, dp=dp,
                                new_shapes=True)
        assert len(result.groups) == 4 * tp * dp


def test_skips_riding_on_their_micro_batch_s_activation_deadlock_without_their_own_slot():
    """Receiving a skip with the activation of its micro-batch (the schedule's placement,
    which knows no skips) deadlocks once a skip crosses stages under 1F1B; `lower`, which
    gives every skip message the slot of its producer, does not."""
    schedule, routes = one_f_one_b(4, 4), ((0, 3),)
    naive = {s: lower_stage(actions, s, routes=routes, rank_of=lambda r: r)
             for s, actions in enumerate(schedule)}
    with pytest.raises(NCCLOrderError, match="deadlock"):
        replay(naive, check_labels=True)
    assert check_schedule(schedule, routes=routes).pairs > 0
