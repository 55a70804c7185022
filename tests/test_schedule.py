"""Schedules as data: literal tables, the communication pass and the simulator."""

import pytest

from hybridpar.pipeline.schedules.schedule import (
    BACKWARD,
    COMPUTE,
    FORWARD,
    GROUP,
    INPUT,
    RECV_B,
    RECV_F,
    SCHEDULES,
    SEND_B,
    SEND_F,
    WEIGHT,
    Action,
    ScheduleError,
    end_times,
    get_schedule,
    gpipe,
    live_microbatches,
    one_f_one_b,
    render,
    zero_bubble_h1,
)
from hybridpar.pipeline.schedules.schedule_check import render_timeline, simulate, validate

SIZES = [(p, m) for p in range(1, 7) for m in range(1, 11)]


def parse(line: str) -> list[Action]:
    """'RECV_F0 F0 SEND_F0 | GROUP' -> [Action('RECV_F', 0), ..., Action('GROUP', -1)];
    a "|" marks where a compute ends a group, for the reader only."""
    actions = []
    for word in line.split():
        if word == "|":
            continue
        kind = word.rstrip("0123456789")
        actions.append(Action(kind, int(word[len(kind) :]) if kind != GROUP else -1))
    return actions


# Literal tables -----------------------------------------------------------------------------


def test_gpipe_three_stages_two_microbatches():
    assert render(gpipe(3, 2)) == [
        "F0 F1 B1 B0",
        "F0 F1 B1 B0",
        "F0 F1 B1 B0",
    ]


def test_gpipe_two_stages_four_microbatches():
    assert render(gpipe(2, 4)) == [
        "F0 F1 F2 F3 B3 B2 B1 B0",
        "F0 F1 F2 F3 B3 B2 B1 B0",
    ]


def test_one_f_one_b_four_stages_eight_microbatches():
    assert render(one_f_one_b(4, 8)) == [
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
        "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
        "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
    ]


def test_one_f_one_b_three_stages_four_microbatches():
    assert render(one_f_one_b(3, 4)) == [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def test_zero_bubble_h1_three_stages_four_microbatches():
    # 1F1B's forwards with I for B; stage s runs W(j) after I(j + s), its last s W's at the end
    assert render(zero_bubble_h1(3, 4)) == [
        "F0 F1 F2 I0 W0 F3 I1 W1 I2 W2 I3 W3",
        "F0 F1 I0 F2 I1 W0 F3 I2 W1 I3 W2 W3",
        "F0 I0 F1 I1 F2 I2 W0 F3 I3 W1 W2 W3",
    ]


def test_zero_bubble_h1_fills_the_drain_and_keeps_1f1b_s_peak_on_every_stage():
    for p, m in ((2, 4), (3, 4), (4, 8), (8, 16)):
        zb = zero_bubble_h1(p, m)
        # unit F, I, W: the bubble (p - 1)(t_F + t_B - t_W) against 1F1B's 3(p - 1)
        assert simulate(zb, weight_time=1.0).makespan == 3 * m + (p - 1)
        assert simulate(one_f_one_b(p, m), weight_time=1.0).makespan == 3 * (m + p - 1)
        assert live_microbatches(zb) == [min(p, m)] * p
        assert live_microbatches(one_f_one_b(p, m)) == [min(p - s, m) for s in range(p)]


def test_a_split_backward_needs_every_i_then_its_w():
    (stage,) = zero_bubble_h1(1, 2)
    with pytest.raises(ScheduleError, match=r"micro-batches \[1\] have I without W"):
        validate([[a for a in stage if a != Action(WEIGHT, 1)]])
    with pytest.raises(ScheduleError, match="W0 comes before I0 on the same stage"):
        validate([[Action(FORWARD, 0), Action(WEIGHT, 0), Action(INPUT, 0)]])
    with pytest.raises(ScheduleError, match="B0: micro-batch 0 is already backwarded"):
        validate([[Action(FORWARD, 0), Action(INPUT, 0), Action(BACKWARD, 0),
                   Action(WEIGHT, 0)]])


def test_one_f_one_b_with_fewer_microbatches_than_stages():
    assert render(one_f_one_b(4, 2)) == [
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 B0 F1 B1",
    ]
    assert render(one_f_one_b(4, 1)) == ["F0 B0"] * 4


def test_gpipe_two_stages_two_microbatches_full_action_lists():
    # each message in the slot its producer ends in; GROUP: two slots with no compute between
    assert gpipe(2, 2) == [
        parse("F0 | SEND_F0 | F1 | SEND_F1 GROUP RECV_B1 | B1 | RECV_B0 | B0"),
        parse("RECV_F0 | F0 | RECV_F1 | F1 | B1 | SEND_B1 | B0 | SEND_B0"),
    ]


def test_one_f_one_b_three_stages_two_microbatches_full_action_lists():
    assert one_f_one_b(3, 2) == [
        parse("F0 | SEND_F0 | F1 | SEND_F1 GROUP RECV_B0 | B0 | RECV_B1 | B1"),
        parse("RECV_F0 | F0 | RECV_F1 SEND_F0 | F1 | SEND_F1 GROUP RECV_B0 | B0 | SEND_B0 GROUP "
              "RECV_B1 | B1 | SEND_B1"),
        parse("RECV_F0 | F0 | RECV_F1 | B0 | SEND_B0 | F1 | B1 | SEND_B1"),
    ]


def test_one_stage_has_no_communication():
    assert gpipe(1, 3) == [parse("F0 F1 F2 B2 B1 B0")]
    assert one_f_one_b(1, 3) == [parse("F0 B0 F1 B1 F2 B2")]


# Pictures -----------------------------------------------------------------------------------


def test_gpipe_timeline_shows_the_fill_and_drain():
    assert render_timeline(gpipe(3, 2)) == [
        "stage 0 | F0 F1 .  .  .  .  B1 B0",
        "stage 1 | .  F0 F1 .  .  B1 B0 .",
        "stage 2 | .  .  F0 F1 B1 B0 .  .",
    ]


def test_one_f_one_b_timeline_with_fewer_microbatches_than_stages():
    assert render_timeline(one_f_one_b(4, 2)) == [
        "stage 0 | F0 F1 .  .  .  .  .  B0 .  B1",
        "stage 1 | .  F0 F1 .  .  .  B0 .  B1 .",
        "stage 2 | .  .  F0 F1 .  B0 .  B1 .  .",
        "stage 3 | .  .  .  F0 B0 F1 B1 .  .  .",
    ]


def test_timeline_pads_two_digit_microbatches_and_stages():
    lines = render_timeline(gpipe(11, 11))
    assert lines[0].startswith("stage  0 | F0  F1  F2 ")
    assert lines[10].startswith("stage 10 | .   .   ")


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
def test_docstring_picture_is_the_simulated_timeline(schedule):
    lines = [line.strip() for line in schedule.__doc__.splitlines()]
    picture = [line for line in lines if line.startswith("stage ")]
    first = picture[0].split("|")[1].split()
    stages, microbatches = len(picture), sum(cell.startswith("F") for cell in first)
    assert render_timeline(schedule(stages, microbatches)) == picture


# The communication pass ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_messages_sit_in_the_slot_their_producer_ends_in(name):
    """A send right after its producer (only communication between); a receive in the group
    of the slot its producer ends in on the peer stage, before the compute that needs it;
    both ends of a message in the same slot."""
    for p, m in SIZES:
        schedule = get_schedule(name)(p, m)
        ends = end_times([[a for a in actions if a.kind in COMPUTE] for actions in schedule])
        for s, actions in enumerate(schedule):
            compute = [a for a in actions if a.kind in COMPUTE]

            def gradient(i):   # B of micro-batch i, or its I under a split backward
                return next(a for a in compute if a.kind in (BACKWARD, INPUT)
                            and a.microbatch == i)

            for k, action in enumerate(actions):
                i = action.microbatch
                if action.kind in (SEND_F, SEND_B):
                    producer = Action(FORWARD, i) if action.kind == SEND_F else gradient(i)
                    between = actions[actions.index(producer) + 1:k]
                    assert all(a.kind not in COMPUTE for a in between)
                elif action.kind in (RECV_F, RECV_B):
                    consumer = Action(FORWARD, i) if action.kind == RECV_F else gradient(i)
                    assert k < actions.index(consumer)
                    peer = s - 1 if action.kind == RECV_F else s + 1
                    slot = ends[peer, consumer]            # when the peer's producer ends
                    before = [ends[s, a] - 1 for a in actions[:k] if a in compute]
                    after = [ends[s, a] - 1 for a in actions[k:] if a in compute]
                    assert all(t < slot for t in before) and all(t >= slot for t in after)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_first_and_last_stage_only_talk_inwards(name):
    for p, m in SIZES:
        schedule = get_schedule(name)(p, m)
        assert not {a.kind for a in schedule[0]} & {RECV_F, SEND_B}
        assert not {a.kind for a in schedule[-1]} & {SEND_F, RECV_B}


# The simulator ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_size_pairs_all_messages_and_finishes(name):
    for p, m in SIZES:
        schedule = get_schedule(name)(p, m)
        validate(schedule)
        result = simulate(schedule)
        per_microbatch = 3 if name == "zb-h1" else 2   # F and B, or F, I and W
        assert [len(spans) for spans in result.spans] == [per_microbatch * m] * p


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_step_time_is_m_plus_p_minus_one_times_forward_plus_backward(name):
    for p, m in SIZES:
        result = simulate(get_schedule(name)(p, m), forward_time=1.0, backward_time=1.0)
        assert result.makespan == (m + p - 1) * 2.0, (p, m)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("tf, tb", [(1.0, 2.0), (3.0, 1.0)])
def test_step_time_bound_holds_for_unequal_forward_and_backward(name, tf, tb):
    for p, m in SIZES:
        result = simulate(get_schedule(name)(p, m), forward_time=tf, backward_time=tb)
        assert result.makespan == pytest.approx((m + p - 1) * (tf + tb)), (p, m)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_busy_idle_and_bubble_fraction(name):
    p, m, tf, tb = 4, 6, 2.0, 3.0
    result = simulate(get_schedule(name)(p, m), forward_time=tf, backward_time=tb)
    assert result.busy == [m * (tf + tb)] * p
    assert result.idle == [result.makespan - m * (tf + tb)] * p
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))


def test_spans_give_start_and_end_of_each_compute():
    result = simulate(gpipe(2, 1), forward_time=1.0, backward_time=2.0, transfer_time=0.5)
    assert [[(str(a), t0, t1) for a, t0, t1 in spans] for spans in result.spans] == [
        [("F0", 0.0, 1.0), ("B0", 5.0, 7.0)],
        [("F0", 1.5, 2.5), ("B0", 2.5, 4.5)],
    ]
    assert result.makespan == 7.0


def test_gpipe_keeps_every_microbatch_alive_on_every_stage():
    for p, m in SIZES:
        assert live_microbatches(gpipe(p, m)) == [m] * p


def test_one_f_one_b_keeps_at_most_p_minus_s_microbatches_alive():
    for p, m in SIZES:
        assert live_microbatches(one_f_one_b(p, m)) == [min(p - s, m) for s in range(p)]


# Broken schedules are caught ----------------------------------------------------------------


def test_swapped_receive_order_is_an_error_not_silently_wrong_numbers():
    schedule = gpipe(2, 2)
    schedule[1] = parse("RECV_F1 RECV_F0 F0 F1 B1 SEND_B1 B0 SEND_B0")
    with pytest.raises(ScheduleError, match=r"stage 1: RECV_F1 is receive #0 from stage 0.*F0"):
        simulate(schedule)


def test_missing_send_is_named():
    schedule = gpipe(2, 2)
    schedule[0].remove(Action(SEND_F, 1))
    with pytest.raises(ScheduleError, match="stage 1: RECV_F1 has no matching SEND_F1 on stage 0"):
        validate(schedule)


def test_missing_gradient_send_is_named():
    schedule = one_f_one_b(3, 2)
    schedule[2].remove(Action(SEND_B, 0))
    with pytest.raises(ScheduleError, match="stage 1: RECV_B0 has no matching SEND_B0 on stage 2"):
        validate(schedule)


def test_a_cycle_of_waits_is_reported_as_deadlock():
    schedule = [
        parse("F0 RECV_B0 B0 SEND_F0"),  # waits for B0's gradient before sending F0
        parse("RECV_F0 F0 B0 SEND_B0"),
    ]
    validate(schedule)  # every message pairs up: only running it shows the cycle
    with pytest.raises(
        ScheduleError,
        match=r"deadlock: stage 0 waits at B0 for SEND_B0 of stage 1; "
        r"stage 1 waits at F0 for SEND_F0 of stage 0",
    ):
        simulate(schedule)


@pytest.mark.parametrize(
    "schedule, message",
    [
        ([parse("B0 F0")], "stage 0: B0 comes before F0"),
        ([parse("F0 SEND_F0 RECV_B0 B0"), parse("F0 B0 SEND_B0")], "stage 1: F0 needs RECV_F0"),
        ([parse("SEND_F0 F0 B0"), parse("RECV_F0 F0 B0")], "stage 0: SEND_F0 comes before F0"),
        ([parse("RECV_F0 F0 B0")], "stage 0: RECV_F0: stage 0 of 1 has no peer"),
        ([parse("F0 F0 B0")], "stage 0: F0 appears twice"),
        ([parse("F0 F1 B0")], r"micro-batches \[1\] are forwarded, never backwarded"),
        ([parse("X0")], "unknown kind 'X'"),
        ([[Action(FORWARD, -1)]], "micro-batch must be an integer >= 0"),
        ([], "at least one stage"),
    ],
)
def test_local_rules_are_checked(schedule, message):
    with pytest.raises(ScheduleError, match=message):
        validate(schedule)


def test_stages_that_disagree_on_microbatches_are_rejected():
    schedule = [parse("F0 SEND_F0 RECV_B0 B0"), parse("RECV_F0 RECV_F1 F0 B0 SEND_B0 F1 B1")]
    with pytest.raises(ScheduleError, match=r"stage 1 computes micro-batches \[0, 1\]"):
        validate(schedule)


# Arguments ----------------------------------------------------------------------------------


def test_schedules_are_registered_by_name():
    assert get_schedule("gpipe") is gpipe
    assert get_schedule("1f1b") is one_f_one_b


def test_unknown_schedule_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown schedule 'zb'; choose one of 1f1b, gpipe"):
        get_schedule("zb")


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
@pytest.mark.parametrize(
    "stages, microbatches, message",
    [
        (0, 4, "stages must be a positive integer, got 0"),
        (2, 0, "microbatches must be a positive integer, got 0"),
        (-1, 4, "stages must be a positive integer, got -1"),
        (2.0, 4, "stages must be a positive integer, got 2.0"),
        (True, 4, "stages must be a positive integer, got True"),
    ],
)
def test_bad_sizes_are_rejected(schedule, stages, microbatches, message):
    with pytest.raises(ValueError, match=message):
        schedule(stages, microbatches)
