"""Plans (virtual stages, split backward): literal tables, placements, checks and lookup."""

import pytest

from hybridpar.pipeline.schedules.interleaved import interleaved_1f1b
from hybridpar.pipeline.schedules.plan import (
    BACKWARD,
    FORWARD,
    INPUT,
    WEIGHT,
    Plan,
    Task,
    from_schedule,
    looped,
    render_plan,
    validate_plan,
    vshape,
)
from hybridpar.pipeline.schedules.planned import PLANS, RUNNABLE, get_plan
from hybridpar.pipeline.schedules.schedule import (
    SCHEDULES,
    ScheduleError,
    gpipe,
    one_f_one_b,
    render,
)
from hybridpar.pipeline.schedules.simulate import render_timing, simulate_plan
from hybridpar.pipeline.schedules.zero_bubble import zb_h1, zbv

# Placements ---------------------------------------------------------------------------------


def test_looped_placement_puts_stage_s_on_rank_s_mod_p():
    assert looped(4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert looped(2, 3) == (0, 1, 0, 1, 0, 1)


def test_v_placement_folds_the_stages_back_to_rank_0():
    assert vshape(4) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert vshape(1) == (0, 0)


def test_a_plan_knows_ranks_virtual_stages_and_which_stages_a_rank_holds():
    plan = zbv(4, 8)
    assert (plan.ranks, plan.stages, plan.virtual) == (4, 8, 2)
    assert plan.stages_of(1) == [1, 6]
    assert interleaved_1f1b(4, 8, 3).stages_of(1) == [1, 5, 9]


# GPipe and 1F1B are the plans with v = 1 and full backwards ---------------------------------


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
def test_schedules_of_actions_are_plans_with_one_stage_per_rank(schedule):
    for p in range(1, 6):
        for m in range(1, 9):
            plan = from_schedule(schedule(p, m))
            assert plan.placement == tuple(range(p)) and plan.virtual == 1
            assert plan.microbatches == m
            assert render_plan(plan) == render(schedule(p, m))
            assert {t.kind for ts in plan.tasks for t in ts} == {FORWARD, BACKWARD}


def test_a_task_is_spelled_stage_kind_microbatch():
    assert str(Task(INPUT, 3, 5)) == "5I3"
    assert render_plan(zbv(2, 1)) == ["0F0 3F0 3I0 3W0 0I0 0W0", "1F0 2F0 2I0 2W0 1I0 1W0"]


# Literal tables -----------------------------------------------------------------------------


def test_zb_h1_four_ranks_eight_microbatches():
    # 1F1B's F / I order; rank r defers each W by r micro-batches, to the drain
    assert render_plan(zb_h1(4, 8)) == [
        "F0 F1 F2 F3 I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7",
        "F0 F1 F2 I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7",
        "F0 F1 I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7",
        "F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7",
    ]


def test_zb_h1_with_fewer_microbatches_than_ranks():
    assert render_plan(zb_h1(4, 2)) == [
        "F0 F1 I0 W0 I1 W1",
        "F0 F1 I0 I1 W0 W1",
        "F0 F1 I0 I1 W0 W1",
        "F0 I0 F1 I1 W0 W1",
    ]


def test_interleaved_four_ranks_eight_microbatches_two_virtual_stages():
    assert render_plan(interleaved_1f1b(4, 8, 2)) == [
        "0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4 4B2 "
        "4F5 4B3 4F6 0B0 4F7 0B1 0B2 0B3 4B4 4B5 4B6 4B7 0B4 0B5 0B6 0B7",
        "1F0 1F1 1F2 1F3 5F0 5F1 5F2 5F3 1F4 5B0 1F5 5B1 1F6 5B2 1F7 5B3 "
        "5F4 1B0 5F5 1B1 5F6 1B2 5F7 1B3 5B4 5B5 5B6 5B7 1B4 1B5 1B6 1B7",
        "2F0 2F1 2F2 2F3 6F0 6F1 6F2 6B0 6F3 6B1 2F4 6B2 2F5 6B3 2F6 2B0 "
        "2F7 2B1 6F4 2B2 6F5 2B3 6F6 6B4 6F7 6B5 6B6 6B7 2B4 2B5 2B6 2B7",
        "3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1 7F2 7B2 7F3 7B3 3F4 3B0 3F5 3B1 "
        "3F6 3B2 3F7 3B3 7F4 7B4 7F5 7B5 7F6 7B6 7F7 7B7 3B4 3B5 3B6 3B7",
    ]


def test_zbv_four_ranks_four_microbatches():
    assert render_plan(zbv(4, 4)) == [
        "0F0 0F1 0F2 0F3 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3 "
        "0I0 0W0 0I1 0W1 0I2 0W2 0I3 0W3",
        "1F0 1F1 1F2 1F3 6F0 6F1 6I0 6W0 6F2 6I1 6W1 6F3 6I2 6W2 1I0 1W0 "
        "6I3 6W3 1I1 1W1 1I2 1W2 1I3 1W3",
        "2F0 2F1 2F2 5F0 2F3 5F1 5F2 5I0 5W0 5F3 5I1 5W1 2I0 2W0 5I2 5W2 "
        "2I1 2W1 5I3 5W3 2I2 2W2 2I3 2W3",
        "3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3I0 3W0 4I1 4W1 3I1 3W1 "
        "4I2 4W2 3I2 3W2 4I3 4W3 3I3 3W3",
    ]


# Pictures: each docstring holds the simulated timeline --------------------------------------


@pytest.mark.parametrize("fn, plan, times", [
    (interleaved_1f1b, interleaved_1f1b(2, 4, 2), dict(weight_time=0.0)),
    (zb_h1, zb_h1(3, 4), dict(weight_time=1.0)),
    (zbv, zbv(2, 3), dict(weight_time=1.0)),
])
def test_docstring_picture_is_the_simulated_timeline(fn, plan, times):
    rows = [line.strip() for line in fn.__doc__.splitlines() if line.strip().startswith("rank ")]
    assert rows == render_timing(simulate_plan(plan, **times))


def test_zb_h1_timeline_three_ranks_four_microbatches():
    assert render_timing(simulate_plan(zb_h1(3, 4), weight_time=1.0)) == [
        "rank 0 | F0 F1 F2 .  .  I0 W0 F3 I1 W1 I2 W2 I3 W3",
        "rank 1 | .  F0 F1 .  I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
        "rank 2 | .  .  F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3",
    ]


def test_zbv_timeline_is_a_parallelogram():
    assert render_timing(simulate_plan(zbv(2, 3), weight_time=1.0)) == [
        "rank 0 | 0F0 0F1 0F2 3F0 3I0 3W0 3F1 3I1 3W1 0I0 0W0 3F2 3I2 3W2 0I1 0W1 0I2 0W2 .",
        "rank 1 | .   1F0 2F0 1F1 2F1 2I0 2W0 1F2 1I0 1W0 2F2 2I1 2W1 1I1 2I2 1I2 1W1 2W2 1W2",
    ]


def test_interleaved_timeline_two_ranks_two_virtual_stages():
    assert render_timing(simulate_plan(interleaved_1f1b(2, 4, 2), weight_time=0.0)) == [
        "rank 0 | 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 .   2B2 .   2B3 0B2 0B3",
        "rank 1 | .   1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3 .",
    ]


def test_a_full_backward_spans_the_time_of_i_and_w():
    # makespan (m + p - 1)(t_F + t_B + t_W) = 3 x 3
    assert render_timing(simulate_plan(from_schedule(one_f_one_b(2, 2)), weight_time=1.0)) == [
        "rank 0 | F0 F1 .  .  B0 -  .  B1 -",
        "rank 1 | .  F0 B0 -  F1 B1 -  .  .",
    ]


# Every plan is complete and ordered ---------------------------------------------------------


def test_every_new_schedule_runs_each_microbatch_once_per_stage():
    for p in (1, 2, 3, 4, 8):
        for m in range(1, 17):
            plans = [zb_h1(p, m), zbv(p, m)]
            plans += [interleaved_1f1b(p, m, v) for v in (2, 3) if m % p == 0]
            for plan in plans:
                validate_plan(plan)   # F, then B or I then W, for every (i, s); nothing twice
                assert sum(map(len, plan.tasks)) == m * plan.stages * (
                    2 if plan.name == "interleaved" else 3)


@pytest.mark.parametrize("plan, message", [
    (Plan(((Task("F", 0, 0), Task("I", 0, 0)),), (0,), 1), r"rank 0: 0W0 is missing"),
    (Plan(((Task("I", 0, 0), Task("F", 0, 0)),), (0,), 1), r"0I0 comes before 0F0"),
    (Plan(((Task("F", 0, 0), Task("W", 0, 0)),), (0,), 1), r"0W0 comes before 0I0"),
    (Plan(((Task("F", 0, 1), Task("B", 0, 1)), (Task("F", 0, 0), Task("B", 0, 0))), (0, 1), 1),
     r"rank 0: 1F0: rank 0 holds stages \[0\], not 1"),
    (Plan(((Task("F", 0, 0), Task("I", 0, 0), Task("B", 0, 0)),), (0,), 1),
     r"already ran the backward of micro-batch 0"),
    (Plan(((Task("F", 0, 0), Task("F", 0, 0)),), (0,), 1), r"0F0 appears twice"),
    (Plan(((Task("X", 0, 0),),), (0,), 1), r"unknown kind 'X'"),
    (Plan(((Task("F", 1, 0),),), (0,), 1), r"micro-batch must be an integer in \[0, 1\)"),
    (Plan(((), ()), (0, 0, 1), 1), r"the same number"),
])
def test_broken_plans_are_named(plan, message):
    with pytest.raises(ScheduleError, match=message):
        validate_plan(plan)


# Arguments and lookup -----------------------------------------------------------------------


def test_interleaved_runs_any_number_of_microbatches():
    """m a multiple of p: Megatron's warm-ups exactly (1F1B's bubble / v); otherwise the
    last group is partial and the warm-ups grow just enough to be free of deadlock."""
    for p in (2, 4):
        for m in range(1, 3 * p + 1):
            for v in (2, 3):
                plan = interleaved_1f1b(p, m, v)
                # each stage 1 / v of a rank's share: F 1, B 2 per stage, 3v per rank
                timing = simulate_plan(plan, forward_time=1, backward_time=2, weight_time=0)
                per_rank = 3 * m * v
                assert timing.makespan >= per_rank
                if m % p == 0:   # the closed form: 1F1B's bubble (p - 1) 3v, divided by v
                    assert timing.makespan == pytest.approx(per_rank + 3 * (p - 1))


def test_interleaved_needs_two_virtual_stages_or_more():
    with pytest.raises(ScheduleError, match="virtual >= 2"):
        interleaved_1f1b(4, 8, 1)


@pytest.mark.parametrize("fn", [zb_h1, zbv])
def test_bad_sizes_are_rejected(fn):
    with pytest.raises(ValueError, match="ranks must be a positive integer, got 0"):
        fn(0, 4)
    with pytest.raises(ValueError, match=r"microbatches must be a positive integer, got 2\.0"):
        fn(2, 2.0)


def test_every_plan_runs_one_stage_per_rank_ones_as_action_schedules():
    assert sorted(PLANS) == sorted(RUNNABLE) == ["1f1b", "gpipe", "interleaved", "zb-h1", "zbv"]
    assert sorted(SCHEDULES) == ["1f1b", "gpipe", "zb-h1"]
    assert get_plan("zb-h1")(4, 8) is zb_h1(4, 8)
    assert get_plan("zbv")(4, 8, virtual=2) is zbv(4, 8)
    assert get_plan("interleaved")(4, 8) is interleaved_1f1b(4, 8, 2)
    assert get_plan("interleaved")(4, 8, virtual=3).virtual == 3
    assert get_plan("1f1b")(3, 4).tasks == from_schedule(one_f_one_b(3, 4)).tasks


def test_a_schedule_with_a_fixed_count_of_virtual_stages_rejects_another():
    with pytest.raises(ValueError, match="'zbv' has 2 virtual stages per rank, got virtual=3"):
        get_plan("zbv")(4, 8, virtual=3)
    with pytest.raises(ValueError, match="'zb-h1' has 1 virtual stage per rank"):
        get_plan("zb-h1")(4, 8, virtual=2)


def test_unknown_plan_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="choose one of 1f1b, gpipe, interleaved, zb-h1, zbv"):
        get_plan("zb-h2")


def test_w_and_i_are_the_split_of_b():
    assert (FORWARD, INPUT, WEIGHT, BACKWARD) == ("F", "I", "W", "B")
