"""Benchmark 8: ZB-H1 against its timed simulation, 1F1B, and torch pipelining's zero bubble.

BENCH.md's zero-bubble protocol: each stage sleeps T_F in forward, T_B in the input-gradient
backward and T_W in the weight-gradient backward (20 / 10 / 10 ms), ``OMP_NUM_THREADS=1``,
a barrier around each step, warm-up steps, then repeats of timed rounds (`timed_round_robin`:
every schedule takes one step in turn, so a slow spell of the shared machine hits all alike).

A stage is ``y = linear(sleep(x), w)`` with a (H, H) weight. Where the sleeps sit:

    sleep      hybridpar                                 torch.distributed.pipelining
    T_F        the forward of `sleep`                    the same
    T_B        the backward of `sleep` (on the input's   the same
               path: I, or B)
    T_W        w's accumulate hook: hybridpar's split    the backward of an identity on w's
               accumulates dW in W (B when not split)    path, which its W (`autograd.grad`
                                                         for the weights) traverses

The two libraries split a backward differently (hybridpar: the linear's own weight GEMM;
torch: the autograd graph cut at the weights), so the W sleep goes where each one runs the
weight gradient; the work per micro-batch and stage is T_F + T_B + T_W in both, except on
the first stage, whose input gradient neither computes (T_F + T_W there).

The bound of each schedule is the timed simulator's makespan of its order with the sleeps
(`pipeline.schedules.simulate.simulate_plan`), with the sleeps as they lasted (``time.sleep``
overshoots on a busy machine) in the "slept" column. Peers in the same run: torch's
``Schedule1F1B`` and ``ScheduleInterleavedZeroBubble`` with one stage per rank (its
zero-bubble order for v = 1).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hybridpar
from hybridpar.pipeline.schedules.planned import get_plan
from hybridpar.pipeline.schedules.simulate import simulate_plan

from .common import fmt, load, markdown_table, timed_round_robin

__all__ = ["NAME", "TITLE", "run", "timed_sleeps"]

NAME = "zero_bubble"
TITLE = "8. Zero bubble: ZB-H1 against its simulation, 1F1B and torch pipelining"

SETTINGS = {
    #        stages       micro-batches   T_F     T_B     T_W   warm-up iters repeats
    "full": {"p": [2, 4], "m": [4, 8, 16], "t": (0.020, 0.010, 0.010), "warmup": 3, "iters": 6,
             "repeats": 3},
    "quick": {"p": [2, 4], "m": [8], "t": (0.020, 0.010, 0.010), "warmup": 2, "iters": 4,
              "repeats": 3},
    "smoke": {"p": [2], "m": [4], "t": (0.002, 0.001, 0.001), "warmup": 1, "iters": 1,
              "repeats": 1},
}
ROWS, SEQ, HIDDEN = 2, 16, 64          # one micro-batch (b, s, h)
_SLEPT = [0.0, 0.0]                    # seconds asked, seconds slept: this process's


def _sleep(seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    _SLEPT[0] += seconds
    _SLEPT[1] += time.perf_counter() - start


class _Sleep(torch.autograd.Function):
    """Identity that sleeps `t_f` in forward and `t_b` in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, t_f: float, t_b: float) -> Tensor:
        _sleep(t_f)
        ctx.t_b = t_b
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        _sleep(ctx.t_b)
        return grad, None, None


class SleepStage(nn.Module):
    """``linear(sleep(x), w)``; `peer` puts the T_W sleep on w's path (torch's W traverses
    it), otherwise in w's accumulate hook (hybridpar's W accumulates there)."""

    def __init__(self, t_f: float, t_b: float, t_w: float, *, peer: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.eye(HIDDEN))
        self.t_f, self.t_b, self.t_w, self.peer = t_f, t_b, t_w, peer
        if not peer:
            self.w.register_post_accumulate_grad_hook(lambda _: _sleep(t_w))

    def forward(self, x: Tensor) -> Tensor:
        w = _Sleep.apply(self.w, 0.0, self.t_w) if self.peer else self.w
        return F.linear(_Sleep.apply(x, self.t_f, self.t_b), w)


def _loss(out: Tensor, target: Tensor) -> Tensor:
    return (out - target).pow(2).mean()


def _peer_step(p: int, m: int, schedule: str, t: tuple[float, float, float], x: Tensor,
               y: Tensor) -> Any:
    """One training step of torch.distributed.pipelining on the same stage."""
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleavedZeroBubble,
    )

    rank = torch.distributed.get_rank()
    stage = PipelineStage(SleepStage(*t, peer=True), rank, p, torch.device("cpu"))
    if schedule == "1f1b":
        sched: Any = Schedule1F1B(stage, n_microbatches=m, loss_fn=_loss)
    else:
        sched = ScheduleInterleavedZeroBubble([stage], n_microbatches=m, loss_fn=_loss)

    def step() -> None:
        if rank == 0:
            sched.step(x)
        elif rank == p - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
    return step


def timed_sleeps(steps: dict[str, Any], cfg: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """`timed_round_robin` of `steps` with `cfg`'s counts, and the stretch of the sleeps:
    seconds slept / seconds asked, over every rank (``time.sleep`` overshoots when busy)."""
    _SLEPT[:] = [0.0, 0.0]
    times = timed_round_robin(steps, warmup=cfg["warmup"], iters=cfg["iters"],
                              repeats=cfg["repeats"])
    slept = torch.tensor(_SLEPT, dtype=torch.float64)
    torch.distributed.all_reduce(slept)
    return times, float(slept[1] / slept[0]) if slept[0] else 1.0


def _bound(name: str, p: int, m: int, t: tuple[float, float, float]) -> float:
    """The timed simulator's makespan of `name` with these sleeps (1F1B's B = I + W; the
    first stage's input gradient is never needed, so it sleeps no T_B, in both libraries)."""
    t_f, t_b, t_w = t
    return simulate_plan(get_plan(name)(p, m), forward_time=t_f,
                         backward_time=[0.0] + [t_b] * (p - 1), weight_time=t_w).makespan


def _worker(p: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    topo = hybridpar.init(pp=p, timeout=120)
    t = cfg["t"]
    rows = []
    for m in cfg["m"]:
        gen = torch.Generator().manual_seed(m)
        x = torch.randn(m * ROWS, SEQ, HIDDEN, generator=gen)          # (m b, s, h)
        y = torch.randn(m * ROWS, SEQ, HIDDEN, generator=gen)
        steps = {}
        for schedule in ("1f1b", "zb-h1"):
            model = nn.Sequential(*[SleepStage(*t, peer=False) for _ in range(p)])
            pipe = hybridpar.HybridPipe(model, [1] * p, chunks=m, topology=topo,
                                        schedule=schedule, checkpoint="never", loss_fn=_loss)
            steps[f"hybridpar {schedule}"] = lambda pipe=pipe, x=x, y=y: pipe.train_step(x, y)
        steps["peer 1f1b"] = _peer_step(p, m, "1f1b", t, x, y)
        steps["peer zb"] = _peer_step(p, m, "zb", t, x, y)
        times, stretch = timed_sleeps(steps, cfg)
        bounds = {s: _bound(s, p, m, t) for s in ("1f1b", "zb-h1")}
        zb, one = times["hybridpar zb-h1"], times["hybridpar 1f1b"]
        rows.append({
            "p": p, "m": m, "t": list(t), "stretch": stretch,
            "bound_1f1b_s": bounds["1f1b"], "bound_zb_s": bounds["zb-h1"],
            "hybridpar_1f1b_s": one, "hybridpar_zb_s": zb,
            "peer_1f1b_s": times["peer 1f1b"], "peer_zb_s": times["peer zb"],
            "zb_efficiency": bounds["zb-h1"] / zb["median"],
            "zb_slept_efficiency": bounds["zb-h1"] * stretch / zb["median"],
            "zb_over_1f1b": one["median"] / zb["median"],
            "peer_zb_over_hybridpar_zb": times["peer zb"]["median"] / zb["median"]})
    return rows if topo.rank == 0 else []


def table(rows: list[dict[str, Any]]) -> str:
    body = [[r["p"], r["m"], f"{1e3 * r['bound_1f1b_s']:.0f}", f"{1e3 * r['bound_zb_s']:.0f}",
             fmt(r["hybridpar_1f1b_s"], 1e3), fmt(r["hybridpar_zb_s"], 1e3),
             fmt(r["peer_1f1b_s"], 1e3), fmt(r["peer_zb_s"], 1e3),
             f"{r['zb_efficiency']:.3f}", f"{r['zb_slept_efficiency']:.3f}",
             f"{r['zb_over_1f1b']:.3f}", f"{r['peer_zb_over_hybridpar_zb']:.3f}"]
            for r in rows]
    return markdown_table(["p", "m", "1F1B bound ms", "ZB-H1 bound ms", "hybridpar 1F1B ms",
                           "hybridpar ZB-H1 ms", "peer 1F1B ms", "peer ZB ms",
                           "ZB-H1 eff.", "ZB-H1 eff. (slept)", "1F1B / ZB-H1 time",
                           "peer ZB / hybridpar ZB-H1 time"], body)


def run(mode: str = "full") -> dict[str, Any]:
    cfg = SETTINGS[mode]
    rows: list[dict[str, Any]] = []
    loads = [load()]
    for p in cfg["p"]:
        rows += hybridpar.spawn(_worker, p, args=(p, cfg), timeout=1200)[0]
        loads.append(load())
    worst = min(r["zb_efficiency"] for r in rows)
    slower = [r for r in rows if r["peer_zb_over_hybridpar_zb"] < 1.0]
    notes = [f"ZB-H1 reaches {worst:.3f} of its simulated makespan at worst (target 0.97); "
             f"{min(r['zb_slept_efficiency'] for r in rows):.3f} with the sleeps as they "
             "lasted.",
             "1F1B / ZB-H1 step time: " + ", ".join(
                 f"p={r['p']} m={r['m']} {r['zb_over_1f1b']:.3f}" for r in rows) +
             " (the formulas: ((m + p − 1)(T_F + T_B + T_W)) / (m(T_F + T_B + T_W) + "
             "(p − 1)(T_F + T_B − T_W)))."]
    if slower:
        notes.append("slower than torch's zero bubble in " + ", ".join(
            f"p={r['p']} m={r['m']} ({100 * (1 - r['peer_zb_over_hybridpar_zb']):.1f}%)"
            for r in slower))
    return {"name": NAME, "title": TITLE, "config": cfg, "rows": rows, "table": table(rows),
            "notes": notes, "load_average_1m": loads,
            "columns": "ms: median of the repeats' median step (± half the range of repeats); "
                       "bound: the timed simulator's makespan of the schedule with the "
                       "sleeps; eff.: bound / median; last two columns > 1: ZB-H1 faster"}
