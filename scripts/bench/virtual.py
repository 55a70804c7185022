"""Benchmark 9: virtual stages, the step-time ladder 1F1B -> interleaved -> ZB-H1 -> ZBV.

Benchmark 8's protocol and stages (`zero_bubble.SleepStage`: T_F in forward, T_B in the
input-gradient backward, T_W in the weight-gradient backward; 20 / 10 / 10 ms), now with
v = 2 model chunks per rank: the model is p v chunks, each sleeping T_F / v, T_B / v and
T_W / v, so a rank's work per micro-batch is the same as one full stage's. Where they sit:

    schedule      chunks   placement (rank r holds)   torch.distributed.pipelining
    1F1B          p        r                          (benchmark 8 runs its Schedule1F1B)
    interleaved   2p       r and r + p  (looped)      ScheduleInterleaved1F1B
    ZB-H1         p        r                          ScheduleInterleavedZeroBubble, 1 stage
    ZBV           2p       r and 2p - 1 - r  (V)      ScheduleZBVZeroBubble
    (peer only)   2p       r and r + p  (looped)      ScheduleInterleavedZeroBubble, 2 stages

`timed_round_robin` times every schedule of both libraries in turn, per (p, m). The bound of
each is the timed simulator's makespan of its plan with the per-chunk sleeps (virtual stage
0 sleeps no T_B: its input gradient is never computed, in either library). The closed forms
(BENCH.md): 1F1B (m + p - 1)(T_F + T_B + T_W); interleaved m(T_F + T_B + T_W) +
(p - 1)(T_F + T_B + T_W) / v; ZB-H1 m(T_F + T_B + T_W) + (p - 1)(T_F + T_B - T_W).

Torch's requirements, read from its schedules.py: Interleaved1F1B and InterleavedZeroBubble
need m to be a multiple of their rounds, max(1, m // p) (m = 2p and 4p are); ZBV needs
exactly two stages per rank and takes any m (its warm-up counts as if m >= 2p - 1); with V
placement rank 0 holds both stage 0 and the loss, so its `step` takes the input and the
target. The sweep, m in {2p, 4p}, runs every schedule of both.

``HYBRIDPAR_BENCH_PEER_ONLY=1`` leaves out hybridpar's interleaved and ZBV steps (their
cells read "—"): the peer's side on its own, with hybridpar's 1F1B and ZB-H1 as the ladder's
base. Without it, a HybridPipe that cannot run `virtual_stages` raises, as it should.

On 2 shared cores the full sweep took 4 minutes with that flag (about 5.5 expected with all
eight schedules), quick 1.3 minutes, smoke seconds.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

import hybridpar
from hybridpar.pipeline.schedules.plan import looped, vshape
from hybridpar.pipeline.schedules.planned import get_plan
from hybridpar.pipeline.schedules.simulate import simulate_plan

from .common import fmt, load, markdown_table
from .zero_bubble import HIDDEN, ROWS, SEQ, SleepStage, _loss, timed_sleeps
from .zero_bubble import _peer_step as _one_stage_peer_step

__all__ = ["NAME", "TITLE", "run"]

NAME = "virtual"
TITLE = "9. Virtual stages: 1F1B, interleaved, ZB-H1 and ZBV against their simulation and " \
        "torch pipelining"

V = 2                                  # chunks per rank (interleaved, ZBV)
# p: ranks; m: micro-batches for each p (2p and 4p in full); t: T_F, T_B, T_W in seconds
SETTINGS = {
    "full": {"p": [2, 4], "m": {2: [4, 8], 4: [8, 16]}, "t": (0.020, 0.010, 0.010), "warmup": 3,
             "iters": 6, "repeats": 3},
    "quick": {"p": [2, 4], "m": {2: [8], 4: [8]}, "t": (0.020, 0.010, 0.010), "warmup": 2,
              "iters": 4, "repeats": 3},
    "smoke": {"p": [2], "m": {2: [4]}, "t": (0.002, 0.001, 0.001), "warmup": 1, "iters": 1,
              "repeats": 1},
}
SCHEDULES = {   # key: (label, chunks per rank, hybridpar's schedule, the peer's)
    "1f1b":           ("1F1B",        1, "1f1b",        None),
    "interleaved":    ("interleaved", V, "interleaved", "interleaved"),
    "zb_h1":          ("ZB-H1",       1, "zb-h1",       "zb"),
    "zbv":            ("ZBV",         V, "zbv",         "zbv"),
    "interleaved_zb": ("interleaved ZB (peer only)", V, None, "interleaved_zb"),
}
VIRTUAL = ("interleaved", "zbv")       # hybridpar's schedules that HYBRIDPAR_BENCH_PEER_ONLY skips
PEER_ONLY_ENV = "HYBRIDPAR_BENCH_PEER_ONLY"


def _peer_only() -> bool:
    return os.environ.get(PEER_ONLY_ENV, "") not in ("", "0")


def _chunk_times(t: tuple[float, float, float], v: int) -> tuple[float, float, float]:
    return (t[0] / v, t[1] / v, t[2] / v)


def _hybridpar_step(topo: Any, p: int, m: int, key: str, t: tuple[float, float, float],
                    x: Tensor, y: Tensor) -> Any:
    """One HybridPipe training step of `key` on p v sleep chunks."""
    _, v, schedule, _ = SCHEDULES[key]
    model = nn.Sequential(*[SleepStage(*_chunk_times(t, v), peer=False) for _ in range(p * v)])
    extra = {"virtual_stages": v} if schedule == "interleaved" else {}   # ZBV: always 2
    pipe = hybridpar.HybridPipe(model, [1] * (p * v), chunks=m, topology=topo,
                                schedule=schedule, checkpoint="never", loss_fn=_loss, **extra)
    return lambda: pipe.train_step(x, y)


def _peer_step(p: int, m: int, key: str, t: tuple[float, float, float], x: Tensor,
               y: Tensor) -> Any:
    """One step of torch.distributed.pipelining's multi-stage schedule `key` on this rank's
    chunks (the placement of hybridpar's plan: looped, or V for ZBV)."""
    from torch.distributed.pipelining import (
        PipelineStage,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
    )

    _, v, _, peer = SCHEDULES[key]
    if v == 1:
        return _one_stage_peer_step(p, m, peer, t, x, y)   # benchmark 8's
    rank = torch.distributed.get_rank()
    placement = vshape(p) if peer == "zbv" else looped(p, v)
    mine = [s for s, owner in enumerate(placement) if owner == rank]
    stages = [PipelineStage(SleepStage(*_chunk_times(t, v), peer=True), s, p * v,
                            torch.device("cpu")) for s in mine]
    cls = {"interleaved": ScheduleInterleaved1F1B, "interleaved_zb": ScheduleInterleavedZeroBubble,
           "zbv": ScheduleZBVZeroBubble}[peer]
    sched = cls(stages, n_microbatches=m, loss_fn=_loss)
    inputs = (x,) if 0 in mine else ()                   # stage 0: rank 0
    loss = p * v - 1 in mine                             # looped: rank p - 1; V: rank 0

    def step() -> None:
        sched.step(*inputs, **({"target": y, "losses": []} if loss else {}))
    return step


def _bound(key: str, p: int, m: int, t: tuple[float, float, float]) -> float:
    """The timed simulator's makespan of `key`'s plan with each chunk's sleeps (virtual stage
    0's input gradient is never needed: it sleeps no T_B, in both libraries)."""
    _, v, schedule, _ = SCHEDULES[key]
    t_f, t_b, t_w = _chunk_times(t, v)
    plan = get_plan(schedule)(p, m, virtual=v)
    stages = len(plan.placement)
    return simulate_plan(plan, forward_time=t_f, backward_time=[0.0] + [t_b] * (stages - 1),
                         weight_time=t_w).makespan


def _worker(p: int, cfg: dict[str, Any], peer_only: bool) -> list[dict[str, Any]]:
    topo = hybridpar.init(pp=p, timeout=120)
    t = cfg["t"]
    rows = []
    for m in cfg["m"][p]:
        gen = torch.Generator().manual_seed(m)
        x = torch.randn(m * ROWS, SEQ, HIDDEN, generator=gen)          # (m b, s, h)
        y = torch.randn(m * ROWS, SEQ, HIDDEN, generator=gen)
        steps = {}
        for key, (_, _, schedule, _) in SCHEDULES.items():
            if schedule is not None and not (peer_only and key in VIRTUAL):
                steps[f"hybridpar {key}"] = _hybridpar_step(topo, p, m, key, t, x, y)
        for key, (_, _, _, peer) in SCHEDULES.items():
            if peer is not None:
                steps[f"peer {key}"] = _peer_step(p, m, key, t, x, y)
        times, stretch = timed_sleeps(steps, cfg)
        one = times["hybridpar 1f1b"]["median"]
        row: dict[str, Any] = {"p": p, "m": m, "v": V, "t": list(t), "stretch": stretch,
                               "peer_only": peer_only}
        for key, (_, _, schedule, _) in SCHEDULES.items():
            ours, theirs = times.get(f"hybridpar {key}"), times.get(f"peer {key}")
            bound = _bound(key, p, m, t) if schedule is not None else None
            this = theirs if schedule is None else ours   # the peer's where hybridpar has none
            row.update({
                f"bound_{key}_s": bound, f"hybridpar_{key}_s": ours, f"peer_{key}_s": theirs,
                f"{key}_efficiency": bound / ours["median"] if bound and ours else None,
                f"{key}_slept_efficiency":
                    bound * stretch / ours["median"] if bound and ours else None,
                f"peer_{key}_efficiency": bound / theirs["median"] if bound and theirs else None,
                f"peer_over_hybridpar_{key}":
                    theirs["median"] / ours["median"] if ours and theirs else None,
                f"1f1b_over_{key}": one / this["median"] if this else None})
        rows.append(row)
    return rows if topo.rank == 0 else []


def _cell(value: Any, form: str) -> str:
    if value is None:
        return "—"
    return fmt(value, 1e3) if isinstance(value, dict) else format(value, form)


def table(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        for key, (label, v, _, _) in SCHEDULES.items():
            body.append([r["p"], r["m"], label, v,
                         _cell(r[f"bound_{key}_s"] and 1e3 * r[f"bound_{key}_s"], ".0f"),
                         _cell(r[f"hybridpar_{key}_s"], ""), _cell(r[f"peer_{key}_s"], ""),
                         _cell(r[f"{key}_efficiency"], ".3f"),
                         _cell(r[f"{key}_slept_efficiency"], ".3f"),
                         _cell(r[f"peer_{key}_efficiency"], ".3f"),
                         _cell(r[f"peer_over_hybridpar_{key}"], ".3f"),
                         _cell(r[f"1f1b_over_{key}"], ".3f")])
    return markdown_table(["p", "m", "schedule", "v", "bound ms", "hybridpar ms", "peer ms",
                           "eff.", "eff. (slept)", "peer eff.", "peer / hybridpar time",
                           "1F1B / this time"], body)


def _measured(rows: list[dict[str, Any]], column: str) -> list[tuple[dict[str, Any], str, float]]:
    """(row, schedule key, value) of `column` (``{key}`` in it) wherever it was measured."""
    return [(r, key, r[column.format(key=key)]) for r in rows for key in SCHEDULES
            if r[column.format(key=key)] is not None]


def run(mode: str = "full") -> dict[str, Any]:
    cfg = SETTINGS[mode]
    peer_only = _peer_only()
    rows: list[dict[str, Any]] = []
    loads = [load()]
    for p in cfg["p"]:
        rows += hybridpar.spawn(_worker, p, args=(p, cfg, peer_only), timeout=1800)[0]
        loads.append(load())
    notes = []
    eff = _measured(rows, "{key}_efficiency")
    if eff:
        r, key, worst = min(eff, key=lambda e: e[2])
        slept = min(e[2] for e in _measured(rows, "{key}_slept_efficiency"))
        notes.append(f"worst efficiency {worst:.3f} ({SCHEDULES[key][0]}, p={r['p']} "
                     f"m={r['m']}; target 0.97), {slept:.3f} with the sleeps as they lasted.")
    notes.append("1F1B / this step time (hybridpar's; the peer's for its interleaved ZB): " +
                 "; ".join(f"p={r['p']} m={r['m']} " + ", ".join(
                     f"{SCHEDULES[key][0].split(' (')[0]} {r[f'1f1b_over_{key}']:.3f}"
                     for key in SCHEDULES if key != "1f1b" and r[f"1f1b_over_{key}"])
                     for r in rows) +
                 " (closed forms: 1F1B (m + p − 1)T, interleaved mT + (p − 1)T / v, ZB-H1 "
                 "mT + (p − 1)(T_F + T_B − T_W), T = T_F + T_B + T_W).")
    slower = [(r, key, ratio) for r, key, ratio in _measured(rows, "peer_over_hybridpar_{key}")
              if ratio < 1.0]
    if slower:
        notes.append("hybridpar slower than the peer in " + ", ".join(
            f"{SCHEDULES[key][0]} p={r['p']} m={r['m']} ({100 * (1 - ratio):.1f}%)"
            for r, key, ratio in slower))
    elif _measured(rows, "peer_over_hybridpar_{key}"):
        notes.append("hybridpar is nowhere slower than the peer.")
    if peer_only:
        notes.append(f"{PEER_ONLY_ENV}=1: hybridpar's interleaved and ZBV were not run.")
    return {"name": NAME, "title": TITLE, "config": cfg, "rows": rows, "table": table(rows),
            "notes": notes, "load_average_1m": loads,
            "columns": "ms: median of the repeats' median step (± half the range of repeats); "
                       "bound: the timed simulator's makespan of the schedule with each "
                       "chunk's sleeps; eff.: bound / hybridpar's median (peer eff.: the "
                       "peer's); peer / hybridpar "
                       "> 1: hybridpar faster; 1F1B / this > 1: faster than hybridpar's 1F1B"}
