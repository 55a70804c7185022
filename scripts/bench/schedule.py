"""Benchmark 1: schedule efficiency of GPipe and 1F1B on sleep-simulated stages.

BENCH.md's protocol: each stage's forward sleeps T_F and its backward T_B (a custom autograd
Function with a parameter, so every stage does backward work), T_F = T_B = 20 ms,
``OMP_NUM_THREADS=1``, a barrier before and after each step, 5 warm-up steps, 8 measured steps,
3 repeats. efficiency = (m + p - 1)(T_F + T_B) / measured median step. The peer,
``torch.distributed.pipelining`` (``ScheduleGPipe``, ``Schedule1F1B``), runs the identical
stages in the same process group, its steps taking turns with ours (GPipe, 1F1B, peer GPipe,
peer 1F1B, then again), so a slow spell of the shared machine hits all four alike.
Both run without recomputation (``checkpoint="never"``), as the bound assumes. Rank 0 also
runs the critical path's computes alone, back to back in one process (``one process``): the
bound as this machine runs it, which no schedule can beat.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn

import hybridpar

from .common import fmt, load, markdown_table, timed_round_robin

__all__ = ["NAME", "TITLE", "SleepStage", "run"]

NAME = "schedule"
TITLE = "1. Schedule efficiency (sleep-simulated stages)"

SETTINGS = {
    #        stages       micro-batches  T_F = T_B  warm-up  steps  repeats
    "full": {"p": [2, 4], "m": [4, 8, 16], "t": 0.020, "warmup": 5, "iters": 8, "repeats": 3},
    "quick": {"p": [2, 4], "m": [4, 8], "t": 0.020, "warmup": 3, "iters": 8, "repeats": 3},
    "smoke": {"p": [2], "m": [4], "t": 0.002, "warmup": 1, "iters": 2, "repeats": 1},
}
ROWS, SEQ, HIDDEN = 2, 16, 64          # one micro-batch (b, s, h): 8 KiB of float32
_SLEPT = [0.0, 0]                      # seconds actually slept, sleeps: this process's


def _sleep(seconds: float) -> None:
    start = time.perf_counter()
    time.sleep(seconds)
    _SLEPT[0] += time.perf_counter() - start
    _SLEPT[1] += 1


class _Sleep(torch.autograd.Function):
    """y = x * w after sleeping `t_f`; the backward sleeps `t_b`, then the usual gradients."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, t_f: float, t_b: float) -> Tensor:
        _sleep(t_f)
        ctx.save_for_backward(x, w)
        ctx.t_b = t_b
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        _sleep(ctx.t_b)
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum().reshape(w.shape), None, None


class SleepStage(nn.Module):
    """A stage whose forward takes `t_f` seconds and backward `t_b`, whatever the input."""

    def __init__(self, t_f: float, t_b: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.t_f, self.t_b = t_f, t_b

    def forward(self, x: Tensor) -> Tensor:
        return _Sleep.apply(x, self.w, self.t_f, self.t_b)


def _loss(out: Tensor, target: Tensor) -> Tensor:
    return (out - target).pow(2).mean()


def _peer_step(p: int, m: int, schedule: str, t: float, x: Tensor, y: Tensor,
               group: Any) -> Any:
    """One training step of torch.distributed.pipelining on the same stage."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = torch.distributed.get_rank()
    stage = PipelineStage(SleepStage(t, t), rank, p, torch.device("cpu"), group=group)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = cls(stage, n_microbatches=m, loss_fn=_loss)

    def step() -> None:
        if rank == 0:
            sched.step(x)
        elif rank == p - 1:
            sched.step(target=y, losses=[])
        else:
            sched.step()
    return step


def _one_process_ms(p: int, m: int, t: float, x: Tensor, repeats: int) -> float:
    """The critical path's computes alone: (m + p - 1) forward + backward pairs of one stage
    back to back in this process, no pipeline and no message; the median of `repeats`, ms.

    No schedule on this machine can beat it: it is the bound as the machine runs it. A
    compute after a 20 ms sleep pays for the idle CPU's wake-up (a 20 µs op takes ~300 µs).
    """
    stage = SleepStage(t, t)
    slept = list(_SLEPT)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(m + p - 1):
            stage(x).sum().backward()
        times.append(time.perf_counter() - start)
    _SLEPT[:] = slept
    return 1e3 * sorted(times)[len(times) // 2]


def _worker(p: int, cfg: dict[str, Any], trace_dir: str | None = None) -> list[dict[str, Any]]:
    topo = hybridpar.init(pp=p, timeout=120)
    t = cfg["t"]
    rows = []
    for m in cfg["m"]:
        gen = torch.Generator().manual_seed(m)
        x = torch.randn(m * ROWS, SEQ, HIDDEN, generator=gen)          # (m b, s, h)
        y = torch.randn(m * ROWS, SEQ, HIDDEN, generator=gen)
        steps = {}
        pipes = {}
        for schedule in ("gpipe", "1f1b"):
            model = nn.Sequential(*[SleepStage(t, t) for _ in range(p)])
            pipe = hybridpar.HybridPipe(model, [1] * p, chunks=m, topology=topo,
                                        schedule=schedule, checkpoint="never", loss_fn=_loss)
            pipes[schedule] = pipe
            steps[f"hybridpar {schedule}"] = lambda pipe=pipe, x=x, y=y: pipe.train_step(x, y)
            steps[f"peer {schedule}"] = _peer_step(p, m, schedule, t, x, y, None)
        _SLEPT[:] = [0.0, 0]
        times = timed_round_robin(steps, warmup=cfg["warmup"], iters=cfg["iters"],
                                  repeats=cfg["repeats"])
        # time.sleep(20 ms) overshoots on a busy machine: the mean sleep over all ranks
        slept = torch.tensor(_SLEPT, dtype=torch.float64)
        torch.distributed.all_reduce(slept)
        mean_sleep = float(slept[0] / slept[1])
        # rank 0 times the one-process run while the others wait (blocked, no CPU)
        one_process_s = _one_process_ms(p, m, t, x[:ROWS], cfg["repeats"]) / 1e3 \
            if topo.rank == 0 else 0.0
        torch.distributed.barrier()
        if trace_dir is not None:  # one traced step of each schedule, for diagnosis
            for schedule, pipe in pipes.items():
                pipe.trace = True
                pipe.train_step(x, y)
                pipe.trace = False
                pipe.write_trace(f"{trace_dir}/p{p}_m{m}_{schedule}", show=False)
        bound = (m + p - 1) * 2 * t
        slept_bound = (m + p - 1) * 2 * mean_sleep   # the bound with the sleeps as they were
        for schedule in ("gpipe", "1f1b"):
            ours, peer = times[f"hybridpar {schedule}"], times[f"peer {schedule}"]
            rows.append({"p": p, "m": m, "schedule": schedule, "bound_s": bound,
                         "mean_sleep_s": mean_sleep, "slept_bound_s": slept_bound,
                         "hybridpar_s": ours, "peer_s": peer,
                         "hybridpar_efficiency": bound / ours["median"],
                         "peer_efficiency": bound / peer["median"],
                         "hybridpar_slept_efficiency": slept_bound / ours["median"],
                         "peer_slept_efficiency": slept_bound / peer["median"],
                         "one_process_s": one_process_s,
                         "one_process_efficiency": bound / one_process_s if one_process_s
                         else 0.0,
                         "peer_over_hybridpar": peer["median"] / ours["median"]})
    return rows if topo.rank == 0 else []


def table(rows: list[dict[str, Any]]) -> str:
    body = [[r["p"], r["m"], r["schedule"], f"{1e3 * r['bound_s']:.0f}",
             fmt(r["hybridpar_s"], 1e3), fmt(r["peer_s"], 1e3), f"{1e3 * r['one_process_s']:.1f}",
             f"{r['hybridpar_efficiency']:.3f}", f"{r['peer_efficiency']:.3f}",
             f"{r['one_process_efficiency']:.3f}", f"{r['peer_over_hybridpar']:.3f}"]
            for r in rows]
    return markdown_table(["p", "m", "schedule", "bound ms", "hybridpar ms", "peer ms",
                           "one process ms", "hybridpar eff.", "peer eff.", "one process eff.",
                           "peer / hybridpar time"], body)


def run(mode: str = "full", *, trace_dir: str | None = None) -> dict[str, Any]:
    cfg = SETTINGS[mode]
    rows: list[dict[str, Any]] = []
    loads = [load()]
    for p in cfg["p"]:
        rows += hybridpar.spawn(_worker, p, args=(p, cfg, trace_dir), timeout=900)[0]
        loads.append(load())
    worst = min(r["hybridpar_efficiency"] for r in rows)
    peer = [r["peer_efficiency"] for r in rows]
    slower = [r for r in rows if r["peer_over_hybridpar"] < 1.0]
    sleeps = [r["mean_sleep_s"] - cfg["t"] for r in rows]
    ceiling = [r["one_process_efficiency"] for r in rows]
    notes = [f"hybridpar efficiency {worst:.3f} at worst (target 0.975); the peer "
             f"{min(peer):.3f}–{max(peer):.3f}; the critical path's computes alone, in one "
             f"process with no message, {min(ceiling):.3f}–{max(ceiling):.3f}.",
             f"time.sleep({cfg['t']}) slept {1e6 * min(sleeps):.0f}–{1e6 * max(sleeps):.0f} µs "
             "too long on average; against the bound with the sleeps as measured "
             "((m + p − 1) × 2 × mean sleep) hybridpar reaches "
             f"{min(r['hybridpar_slept_efficiency'] for r in rows):.3f}–"
             f"{max(r['hybridpar_slept_efficiency'] for r in rows):.3f}, the peer "
             f"{min(r['peer_slept_efficiency'] for r in rows):.3f}–"
             f"{max(r['peer_slept_efficiency'] for r in rows):.3f}."]
    if slower:
        notes.append("slower than the peer in " + ", ".join(
            f"p={r['p']} m={r['m']} {r['schedule']} ({100 * (1 - r['peer_over_hybridpar']):.1f}%)"
            for r in slower))
    return {"name": NAME, "title": TITLE, "config": cfg, "rows": rows, "table": table(rows),
            "notes": notes, "load_average_1m": loads,
            "columns": "ms: median of the repeats' median step (± half the range of repeats); "
                       "eff.: bound / median; one process: the critical path's (m + p − 1) "
                       "forward + backward pairs back to back in one process, no pipeline "
                       "and no message (median of the repeats), the bound as this machine "
                       "runs it; last column > 1: hybridpar is faster"}
