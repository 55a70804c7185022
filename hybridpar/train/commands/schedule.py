"""`hybridpar schedule`: a schedule's timeline, makespan, bubble and live memory, simulated."""

from __future__ import annotations

import argparse
from typing import Any

from hybridpar.pipeline.schedules.plan import from_schedule
from hybridpar.pipeline.schedules.planned import PLANS, get_plan
from hybridpar.pipeline.schedules.schedule import one_f_one_b
from hybridpar.pipeline.schedules.simulate import render_timing, simulate_plan

__all__ = ["add_parser", "main"]


def add_parser(commands: Any) -> None:
    """Register the ``schedule`` subcommand."""
    p = commands.add_parser("schedule", help="print a schedule's timeline, bubble and memory",
                            description="Simulate one step of a pipeline schedule without "
                            "running it: each rank's timeline, the makespan, the bubble and "
                            "the peak of live micro-batches, from the schedule's data (the "
                            "tasks HybridPipe runs).")
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    p.add_argument("--chunks", type=int, required=True, help="micro-batches per step")
    p.add_argument("--schedule", choices=sorted(PLANS), default="1f1b",
                   help="the schedule (default 1f1b)")
    p.add_argument("--virtual", type=int, default=None, metavar="V",
                   help="virtual stages per rank (interleaved: default 2; zbv: 2; others: 1)")
    p.add_argument("--times", default="1,1,1", metavar="F,B,W",
                   help="time of a forward, an input-gradient backward and a weight-gradient "
                   "backward of one micro-batch on one virtual stage (a full backward takes "
                   "B + W; default 1,1,1)")
    p.add_argument("--latency", type=float, default=0.0, metavar="L",
                   help="time of a message between two ranks (default 0)")


def main(args: argparse.Namespace) -> int:
    """Simulate the plan of `args` and print its timeline, makespan, bubble and memory."""
    try:
        tf, tb, tw = (float(t) for t in args.times.split(","))
    except ValueError:
        raise ValueError(f"--times {args.times!r} must be three numbers F,B,W, e.g. 2,1,1") \
            from None
    plan = get_plan(args.schedule)(args.pp, args.chunks, virtual=args.virtual)
    timing = simulate_plan(plan, forward_time=tf, backward_time=tb, weight_time=tw,
                           latency=args.latency)
    v, m = plan.virtual, plan.microbatches
    print(f"{args.schedule}: pp {plan.ranks}, {m} micro-batches, {v} virtual stage"
          f"{'s' * (v > 1)} per rank; per stage F {tf:g}, B {tb:g}, W {tw:g}; latency "
          f"{args.latency:g}")
    for line in render_timing(timing):
        print(line)
    work = m * v * (tf + tb + tw)
    print(f"makespan {timing.makespan:g}: {work:g} of work per rank + "
          f"{timing.makespan - work:g} of bubble ({timing.bubble_fraction:.1%})")
    if args.schedule != "1f1b":
        base = simulate_plan(from_schedule(one_f_one_b(plan.ranks, m)), forward_time=v * tf,
                             backward_time=v * tb, weight_time=v * tw, latency=args.latency)
        same = "the same times" if v == 1 else f"a rank's {v} virtual stages as one stage"
        print(f"1f1b with {same}: makespan {base.makespan:g}")
    print("rank  busy  idle  bubble  peak live micro-batches")
    for r, (busy, idle, live) in enumerate(zip(timing.busy, timing.idle, timing.live)):
        print(f"{r:>4}  {busy:>4g}  {idle:>4g}  {idle / timing.makespan:>6.1%}  {live:g}")
    return 0
