"""The timed simulator of plans: the closed forms of each schedule, exactly, and live memory.

Times are sums of halves and integers, so every makespan is exact in floating point and the
tests compare with ==. SIZES are the brief's: p in {2, 4, 8}, m in {p, 2p, 4p}.
"""

import pytest

from hybridpar.pipeline.schedules.interleaved import interleaved_1f1b
from hybridpar.pipeline.schedules.plan import Plan, Task, from_schedule
from hybridpar.pipeline.schedules.schedule import ScheduleError, gpipe, one_f_one_b
from hybridpar.pipeline.schedules.schedule_check import simulate
from hybridpar.pipeline.schedules.simulate import simulate_plan
from hybridpar.pipeline.schedules.zero_bubble import zb_h1, zbv

SIZES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]
# (t_F, t_B, t_W): equal; W the cheapest (the papers' case); and each of F, B, W the largest
TIMES = [(1.0, 1.0, 1.0), (2.0, 1.5, 0.5), (3.0, 2.0, 1.0), (1.0, 2.0, 0.5), (1.0, 1.0, 2.0),
         (2.0, 1.0, 1.5)]


def _run(plan, tf, tb, tw, **kw):
    return simulate_plan(plan, forward_time=tf, backward_time=tb, weight_time=tw, **kw)


# A v = 1 plan times as its schedule does ----------------------------------------------------


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
def test_plans_of_gpipe_and_1f1b_time_like_the_schedule_simulator(schedule):
    for p in range(1, 6):
        for m in range(1, 9):
            for tf, tb, latency in ((1.0, 1.0, 0.0), (1.0, 2.0, 0.5), (3.0, 1.0, 0.25)):
                old = simulate(schedule(p, m), forward_time=tf, backward_time=tb,
                               transfer_time=latency)
                new = _run(from_schedule(schedule(p, m)), tf, tb, 0.0, latency=latency)
                assert new.makespan == old.makespan
                assert [[(s.start, s.end) for s in r] for r in new.spans] == \
                       [[(s.start, s.end) for s in r] for r in old.spans]


# Closed forms, zero latency -----------------------------------------------------------------


@pytest.mark.parametrize("tf, tb, tw", TIMES)
def test_1f1b_bubble_is_p_minus_1_full_microbatches(tf, tb, tw):
    for p, m in SIZES:
        t = _run(from_schedule(one_f_one_b(p, m)), tf, tb, tw)
        assert t.makespan - m * (tf + tb + tw) == (p - 1) * (tf + tb + tw), (p, m)


@pytest.mark.parametrize("tf, tb, tw", [t for t in TIMES if t[2] <= min(t[:2])])
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w(tf, tb, tw):
    """Qi et al.'s (p - 1)(t_F + t_B - t_W), under their assumption t_W <= t_F, t_B."""
    for p, m in SIZES:
        t = _run(zb_h1(p, m), tf, tb, tw)
        assert t.makespan - m * (tf + tb + tw) == (p - 1) * (tf + tb - tw), (p, m)


@pytest.mark.parametrize("tf, tb, tw", [t for t in TIMES if t[2] > min(t[:2])])
def test_zb_h1_bubble_when_w_is_not_the_cheapest(tf, tb, tw):
    """The W's cannot hide everything: rank p - 1 starts (p - 1)t_F late and rank 0 waits
    (p - 1)t_B for the first I to come back, so the bubble is (p - 1) max(t_F, t_B) at
    least, and ZB-H1 reaches that: (p - 1)(t_F + t_B - min(t_W, t_F, t_B))."""
    for p, m in SIZES:
        t = _run(zb_h1(p, m), tf, tb, tw)
        bubble = t.makespan - m * (tf + tb + tw)
        assert bubble == (p - 1) * (tf + tb - min(tw, tf, tb)) == (p - 1) * max(tf, tb)
        assert bubble > (p - 1) * (tf + tb - tw)


@pytest.mark.parametrize("v", [2, 3, 4])
@pytest.mark.parametrize("tf, tb, tw", TIMES)
def test_interleaved_bubble_is_1f1b_s_divided_by_v(tf, tb, tw, v):
    """Each virtual stage takes 1 / v of a rank's times: (tf, tb, tw) per virtual stage is a
    rank's T = v (tf, tb, tw), and the bubble is (p - 1)(T_F + T_B + T_W) / v."""
    for p, m in SIZES:
        t = _run(interleaved_1f1b(p, m, v), tf, tb, tw)
        assert t.makespan - m * v * (tf + tb + tw) == (p - 1) * (tf + tb + tw), (p, m)


@pytest.mark.parametrize("unit", [1.0, 0.5, 3.0])
def test_zbv_with_equal_times_has_no_bubble_inside_any_rank_s_span(unit):
    """t_F = t_B = t_W = t, m >= 2p: every rank computes without a gap from its first task to
    its last (a parallelogram: rank r starts rt late and ends (p - 1 - r)t early). What is
    left is the fill no schedule avoids: rank p - 1 has nothing to do before micro-batch 0
    crossed p - 1 stages, so the makespan is the 2m(t_F + t_B + t_W) of work + (p - 1)t."""
    for p, m in SIZES:
        if m < 2 * p:
            continue
        t = _run(zbv(p, m), unit, unit, unit)
        assert t.makespan == 6 * m * unit + (p - 1) * unit, (p, m)
        for r, spans in enumerate(t.spans):
            assert spans[0].start == r * unit
            assert spans[-1].end == t.makespan - (p - 1 - r) * unit
            assert spans[-1].end - spans[0].start == t.busy[r]   # no gap inside


def test_zbv_with_m_equal_to_p_idles_inside_the_spans():
    """The warm-up is shaped for 2p - 1 micro-batches in flight on stage 0; with m = p the
    steady phase never starts, rank r idles 2(p - 1 - r)t between its first and last task,
    and the step takes 2(p - 1)t more than the work."""
    for p in (2, 4, 8):
        t = _run(zbv(p, p), 1.0, 1.0, 1.0)
        assert t.makespan == 6 * p + 2 * (p - 1)
        assert [s[-1].end - s[0].start - b for s, b in zip(t.spans, t.busy)] == \
               [2 * (p - 1 - r) for r in range(p)]


def test_zbv_beats_1f1b_on_the_same_model_by_the_fill():
    # 1F1B with a rank's two half stages as one: stage times 2t, bubble 6(p - 1)t
    for p, m in SIZES:
        ones = _run(from_schedule(one_f_one_b(p, m)), 2.0, 2.0, 2.0)
        assert ones.makespan - _run(zbv(p, m), 1.0, 1.0, 1.0).makespan == \
               (5 * (p - 1) if m >= 2 * p else 4 * (p - 1))


# Live activations ---------------------------------------------------------------------------


def test_peak_live_microbatches_per_rank():
    """In full-stage micro-batches: a (micro-batch, virtual stage) pair lives from F to its
    W (or B) and counts 1 / v."""
    for p, m in SIZES:
        assert _run(from_schedule(one_f_one_b(p, m)), 1, 1, 1).live == [p - r for r in range(p)]
        assert _run(zb_h1(p, m), 1, 1, 1).live == [p] * p           # 1F1B's peak, every rank
        live = _run(zbv(p, m), 1, 1, 1).live
        assert max(live) <= p
        assert live == ([p] * p if m >= 2 * p else [(p + 1 + r) / 2 for r in range(p)])
        for v in (2, 3):   # Megatron's warm-up holds more than 1F1B on the first ranks
            warmup = [min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1) for r in range(p)]
            assert _run(interleaved_1f1b(p, m, v), 1, 1, 1).live == [w / v for w in warmup]


# Latency, per-stage times, errors -----------------------------------------------------------


def test_latency_is_paid_between_ranks_only():
    # zbv(2, 1): stages 0 and 3 on rank 0, 1 and 2 on rank 1; 1 -> 2 stays on rank 1
    t = _run(zbv(2, 1), 1.0, 1.0, 1.0, latency=0.5)
    assert [[(str(s.task), s.start, s.end) for s in r] for r in t.spans] == [
        [("0F0", 0.0, 1.0), ("3F0", 4.0, 5.0), ("3I0", 5.0, 6.0), ("3W0", 6.0, 7.0),
         ("0I0", 10.0, 11.0), ("0W0", 11.0, 12.0)],
        [("1F0", 1.5, 2.5), ("2F0", 2.5, 3.5), ("2I0", 6.5, 7.5), ("2W0", 7.5, 8.5),
         ("1I0", 8.5, 9.5), ("1W0", 9.5, 10.5)],
    ]   # four messages (0>1, 2>3, 3>2, 1>0) of 0.5 each; 1F0 -> 2F0 none
    assert t.makespan == 12.0 and t.busy == [6.0, 6.0] and t.idle == [6.0, 6.0]


def test_times_can_differ_per_virtual_stage():
    # gpipe(2, 1): stage 1 forwards in 3; B = I + W per stage
    t = simulate_plan(from_schedule(gpipe(2, 1)), forward_time=[1.0, 3.0],
                      backward_time=[1.0, 2.0], weight_time=0.5)
    assert [[(s.start, s.end) for s in r] for r in t.spans] == [[(0.0, 1.0), (6.5, 8.0)],
                                                                [(1.0, 4.0), (4.0, 6.5)]]


def test_bubble_fractions_per_rank_and_overall():
    t = _run(zb_h1(4, 8), 1.0, 1.0, 1.0)
    assert t.makespan == 27.0 and t.busy == [24.0] * 4
    assert t.bubble_fractions == [3 / 27] * 4 and t.bubble_fraction == 3 / 27


@pytest.mark.parametrize("kw, message", [
    (dict(forward_time=[1.0]), r"forward_time must be one time >= 0, or one per virtual "
                               r"stage \(4\)"),
    (dict(weight_time=-1.0), "weight_time must be >= 0"),
    (dict(latency=-0.5), "latency must be >= 0"),
])
def test_bad_times_are_rejected(kw, message):
    with pytest.raises(ValueError, match=message):
        simulate_plan(zbv(2, 2), **kw)


def test_a_cycle_of_waits_is_reported_as_deadlock():
    plan = Plan(((Task("F", 0, 0), Task("B", 0, 0), Task("F", 1, 0), Task("B", 1, 0)),
                 (Task("F", 1, 1), Task("B", 1, 1), Task("F", 0, 1), Task("B", 0, 1))),
                (0, 1), 2)
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits at 0B0 for I or B of "
                       r"micro-batch 0 on stage 1; rank 1 waits at 1F1 for F of micro-batch 1"):
        simulate_plan(plan)
