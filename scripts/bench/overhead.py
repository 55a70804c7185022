"""Benchmark 4: the cost of HybridPipe itself at pp = tp = dp = 1, against a plain loop.

One rank, the same model (the quick-start GPT, built twice from one seed), the same batch and
the same AdamW; the two training loops take turns step by step:

    plain      opt.zero_grad(); gpt_loss(model(x), y).backward(); opt.step()
    hybridpar  opt.zero_grad(); pipe.train_step(x, y); opt.step()   # chunks=1

The ratio is hybridpar's median step over the plain loop's (target: at most 1.03).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import hybridpar
from hybridpar.models import example_batch, gpt, gpt_loss

from .comm import QUICKSTART
from .common import fmt, load, markdown_table, timed_round_robin

__all__ = ["NAME", "TITLE", "run"]

NAME = "overhead"
TITLE = "4. Overhead of HybridPipe at pp = tp = dp = 1"

SETTINGS = {
    "full": {"model": QUICKSTART, "batch": [4, 16], "threads": [1, 2], "warmup": 5,
             "iters": 30, "repeats": 5},
    "quick": {"model": QUICKSTART, "batch": [16], "threads": [1], "warmup": 3, "iters": 10,
              "repeats": 5},
    "smoke": {"model": {"vocab_size": 32, "block_size": 8, "n_layer": 1, "n_head": 2,
                        "n_embd": 16}, "batch": [2], "threads": [1], "warmup": 1, "iters": 2,
              "repeats": 1},
}


def _steps(plain: nn.Module, pipe: hybridpar.HybridPipe, x: Tensor, y: Tensor,
           losses: dict[str, list[float]]) -> tuple[Callable[[], None], Callable[[], None]]:
    """One training step of each loop, the same AdamW on each model."""
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    opt_pipe = torch.optim.AdamW(pipe.parameters(), lr=1e-3)

    def plain_step() -> None:
        opt_plain.zero_grad()
        loss = gpt_loss(plain(x), y)
        loss.backward()
        opt_plain.step()
        losses["plain"].append(loss.item())

    def pipe_step() -> None:
        opt_pipe.zero_grad()
        loss = pipe.train_step(x, y)
        opt_pipe.step()
        losses["hybridpar"].append(loss.item())

    return plain_step, pipe_step


def _worker(cfg: dict[str, Any], threads: int) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)
    topo = hybridpar.init(timeout=120)
    rows = []
    for batch in cfg["batch"]:
        x, y = example_batch("gpt", batch, **cfg["model"])
        torch.manual_seed(0)
        plain = gpt(**cfg["model"])
        torch.manual_seed(0)
        pipe = hybridpar.HybridPipe(gpt(**cfg["model"]), [len(plain)], chunks=1,
                                    topology=topo, checkpoint="never", loss_fn=gpt_loss)
        losses: dict[str, list[float]] = {"plain": [], "hybridpar": []}
        plain_step, pipe_step = _steps(plain, pipe, x, y, losses)
        # the same model and data: the first losses agree to float precision
        plain_step()
        pipe_step()
        same = abs(losses["plain"][0] - losses["hybridpar"][0])
        times = timed_round_robin({"plain": plain_step, "hybridpar": pipe_step},
                                  warmup=cfg["warmup"], iters=cfg["iters"],
                                  repeats=cfg["repeats"], barrier=False)
        rows.append({"batch": batch, "tokens": batch * cfg["model"]["block_size"],
                     "threads": threads, "plain_s": times["plain"],
                     "hybridpar_s": times["hybridpar"], "first_loss_diff": same,
                     "ratio": times["hybridpar"]["median"] / times["plain"]["median"]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    body = [[r["threads"], r["batch"], r["tokens"], fmt(r["plain_s"], 1e3, 2),
             fmt(r["hybridpar_s"], 1e3, 2),
             f"{1e3 * (r['hybridpar_s']['median'] - r['plain_s']['median']):+.2f}",
             f"{r['ratio']:.3f}"] for r in rows]
    return markdown_table(["threads", "batch", "tokens", "plain ms", "hybridpar ms",
                           "difference ms", "hybridpar / plain"], body)


def run(mode: str = "full") -> dict[str, Any]:
    cfg = SETTINGS[mode]
    rows: list[dict[str, Any]] = []
    loads = [load()]
    for threads in cfg["threads"]:
        rows += hybridpar.spawn(_worker, 1, args=(cfg, threads), threads=threads,
                                timeout=600)[0]
        loads.append(load())
    worst = max(r["ratio"] for r in rows)
    model = cfg["model"]
    notes = [f"GPT {model['n_layer']} blocks, h={model['n_embd']}, s={model['block_size']}, "
             f"AdamW; median of {cfg['repeats']} repeats of {cfg['iters']} steps; first "
             f"losses equal to {max(r['first_loss_diff'] for r in rows):.1e}.",
             f"worst ratio {worst:.3f} (target ≤ 1.03): "
             + ("met." if worst <= 1.03 else f"missed by {100 * (worst - 1.03):.1f} points.")]
    return {"name": NAME, "title": TITLE, "config": cfg, "rows": rows, "table": table(rows),
            "notes": notes, "load_average_1m": loads,
            "columns": "ms: median step of the repeats (± half their range)"}
