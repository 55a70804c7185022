"""NCCL's point-to-point rules for plans: every new schedule, lowered per rank, progresses.

`plan_lowering.check_plan` lowers a (dp, pp, tp) grid of a plan the way `lowering` does for
`Action` schedules (each message in its producer's slot, one group per slot) and replays it
under NCCL's matching and rendezvous rules (`replay`).
"""

from __future__ import annotations

import pytest

from hybridpar.pipeline.schedules.interleaved import interleaved_1f1b
from hybridpar.pipeline.schedules.lowering import lower, lower_stage
from hybridpar.pipeline.schedules.plan import from_schedule
from hybridpar.pipeline.schedules.plan_lowering import Hop, check_plan, lower_plan, lower_plan_rank
from hybridpar.pipeline.schedules.replay import NCCLOrderError
from hybridpar.pipeline.schedules.schedule import RECV_F, SEND_F, gpipe, one_f_one_b
from hybridpar.pipeline.schedules.zero_bubble import zb_h1, zbv

MICROBATCHES = range(1, 33)


def _plans(p, m):
    """Every new schedule at (p, m) (interleaved: m a multiple of p or not)."""
    plans = [zb_h1(p, m), zbv(p, m)]
    plans += [interleaved_1f1b(p, m, v) for v in ((2, 3, 4) if p <= 4 else (2,))]
    return plans


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_every_new_schedule_progresses_under_nccl_rules(p):
    for m in MICROBATCHES:
        for plan in _plans(p, m):
            for new_shapes in (False, True):
                result = check_plan(plan, new_shapes=new_shapes)
                # per micro-batch and boundary between ranks: activation (+ header), gradient
                boundaries = plan.stages - 1 - (plan.name == "zbv")   # ZBV's p - 1 -> p: none
                assert result.pairs == m * boundaries * (2 + new_shapes), (plan.name, p, m)


def test_dp_and_tp_replicas_progress_together():
    for plan in (zb_h1(4, 8), zbv(4, 8), interleaved_1f1b(4, 8, 2)):
        for tp, dp in ((2, 1), (1, 2), (2, 2)):
            result = check_plan(plan, tp=tp, dp=dp, new_shapes=True)
            assert len(result.groups) == 4 * tp * dp


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
def test_a_v1_plan_lowers_to_the_groups_the_executor_issues_today(schedule):
    """From the same slots, `lower_plan` gives `lowering.lower`'s groups (skips aside):
    the same ops to the same peers, group by group."""
    for p in range(1, 6):
        for m in (1, 2, 3, 5, 8):
            for new_shapes in (False, True):
                old = [[(op.kind, op.peer, op.numel) for op in group]
                       for s, actions in enumerate(lower(schedule(p, m)))
                       for group in lower_stage(actions, s, rank_of=lambda r: r,
                                                new_shapes=new_shapes)]
                new = [[(op.kind, op.peer, op.numel) for op in group]
                       for items in lower_plan(from_schedule(schedule(p, m)))
                       for group in lower_plan_rank(items, rank_of=lambda r: r,
                                                    new_shapes=new_shapes,
                                                    headers_apart=False)]
                assert new == old, (p, m, new_shapes)


def test_zbv_lowered_two_ranks_one_microbatch():
    # stage 1 -> 2 stays on rank 1: no message; GROUP ends a slot with no task after it
    assert [" ".join(map(str, items)) for items in lower_plan(zbv(2, 1))] == [
        "0F0 0SEND_F0 GROUP 3RECV_F0 3F0 3I0 3SEND_B0 3W0 0RECV_B0 0I0 0W0",
        "1RECV_F0 1F0 2F0 2SEND_F0 GROUP 2RECV_B0 2I0 2W0 1I0 1SEND_B0 1W0",
    ]


def test_interleaved_lowered_two_ranks_two_microbatches():
    # rank 1's stage 1 sends to rank 0's stage 2, which sends to rank 1's stage 3
    assert [" ".join(map(str, items)) for items in lower_plan(interleaved_1f1b(2, 2, 2))] == [
        "0F0 0SEND_F0 0F1 0SEND_F1 2RECV_F0 2F0 2SEND_F0 2RECV_F1 2F1 2SEND_F1 GROUP "
        "2RECV_B0 2B0 2SEND_B0 GROUP 2RECV_B1 2B1 2SEND_B1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 3RECV_F0 3F0 3RECV_F1 3B0 3SEND_B0 3F1 "
        "1RECV_B0 3B1 3SEND_B1 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1",
    ]


def test_messages_go_to_the_rank_holding_the_neighbouring_stage():
    plan = zbv(4, 2)
    for r, items in enumerate(lower_plan(plan)):
        for hop in items:
            if isinstance(hop, Hop) and hop.kind in (SEND_F, RECV_F):
                neighbour = hop.stage + 1 if hop.kind == SEND_F else hop.stage - 1
                assert hop.peer == plan.placement[neighbour] != r


@pytest.mark.parametrize("plan", [interleaved_1f1b(2, 2, 2), interleaved_1f1b(4, 4, 2),
                                  zbv(2, 3), zbv(4, 8)])
def test_headers_sent_with_their_activation_deadlock_once_activations_go_round_a_cycle(plan):
    """With new shapes, `lowering.lower_stage` sends a header and its activation in one
    group and receives the activation in a group of its own. With v >= 2 the activations
    of one slot can go round a cycle of ranks (looped: rank p - 1 -> rank 0; ZBV: r <-> r +
    1): each rank's first group then waits for a peer's second group. Both ends must
    exchange headers first and activations in a second group (`headers_apart`)."""
    with pytest.raises(NCCLOrderError, match="deadlock"):
        check_plan(plan, new_shapes=True, headers_apart=False)
    assert check_plan(plan, new_shapes=True).pairs > 0
