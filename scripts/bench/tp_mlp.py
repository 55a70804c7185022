"""Benchmark 5: tensor parallelism on a large MLP, against tp = 1 and against DTensor TP.

The model is `hybridpar.models.mlp` (blocks of column-parallel fc1 -> GELU -> row-parallel fc2
-> GELU, then a replicated classifier), hidden size H, 2 blocks, N tokens; one step is the
forward, the cross-entropy and the backward (no optimizer). Compared, step by step in turn:

    tp=1           one rank, torch.set_num_threads(1) and (2) (the whole machine)
    hybridpar tp=2 two ranks, one thread each: ParallelLinear(dim=-1) / (dim=0)
    DTensor tp=2   the same blocks as plain nn.Linear under parallelize_module with
                   ColwiseParallel (fc1) / RowwiseParallel (fc2), in the same process group

Both tp=2 models hold the slices of the same full weights (checked: equal first losses).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hybridpar
from hybridpar.models import mlp, mlp_loss

from .common import fmt, load, markdown_table, timed_round_robin

__all__ = ["NAME", "TITLE", "PlainBlock", "run"]

NAME = "tp_mlp"
TITLE = "5. Tensor parallelism on a large MLP (tp = 2)"

SETTINGS = {
    "full": {"hidden": [1024, 2048, 4096], "tokens": 512, "layers": 2, "warmup": 2,
             "iters": 3, "repeats": 3},
    "quick": {"hidden": [1024, 2048], "tokens": 512, "layers": 2, "warmup": 2, "iters": 3,
              "repeats": 3},
    "smoke": {"hidden": [64], "tokens": 16, "layers": 1, "warmup": 1, "iters": 1,
              "repeats": 1},
}
CLASSES = 16


class PlainBlock(nn.Module):
    """`hybridpar.models.mlp.MLPBlock` with plain nn.Linear layers: what DTensor shards."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear) -> None:
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.fc2(F.gelu(self.fc1(x))))


def _plain_copy(model: nn.Sequential) -> nn.Sequential:
    """The one-device `mlp()` as nn.Linear layers holding the same values."""
    def linear(layer: Any) -> nn.Linear:
        out = nn.Linear(layer.in_features, layer.out_features)
        with torch.no_grad():
            out.weight.copy_(layer.weight)
            out.bias.copy_(layer.bias)
        return out

    blocks = [PlainBlock(linear(b.fc1), linear(b.fc2)) for b in list(model)[:-1]]
    return nn.Sequential(*blocks, model[-1])


def _data(cfg: dict[str, Any], hidden: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(cfg["tokens"], hidden, generator=g)                    # (N, H)
    return x, torch.randint(0, CLASSES, (cfg["tokens"],), generator=g)     # (N,)


def _step(model: nn.Module, x: Tensor, y: Tensor, losses: list[float]) -> Any:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        loss = mlp_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
    return step


def _build(cfg: dict[str, Any], hidden: int, tp: int | None) -> nn.Sequential:
    torch.manual_seed(0)
    return mlp(in_features=hidden, hidden=hidden, out_features=CLASSES,
               n_layer=cfg["layers"], tp=tp)


def _worker_tp1(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    hybridpar.init(timeout=300)
    rows = []
    for hidden in cfg["hidden"]:
        x, y = _data(cfg, hidden)
        model = _build(cfg, hidden, None)
        row: dict[str, Any] = {"hidden": hidden}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            losses: list[float] = []
            t = timed_round_robin({"tp1": _step(model, x, y, losses)}, warmup=cfg["warmup"],
                                  iters=cfg["iters"], repeats=cfg["repeats"], barrier=False)
            row[f"tp1_{threads}t_s"] = t["tp1"]
            row["loss"] = losses[0]
        rows.append(row)
    return rows


def _worker_tp2(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    topo = hybridpar.init(tp=2, timeout=300)
    rows = []
    for hidden in cfg["hidden"]:
        x, y = _data(cfg, hidden)
        ours = _build(cfg, hidden, 2)
        peer = _plain_copy(_build(cfg, hidden, None))
        plan = {}
        for i in range(cfg["layers"]):
            plan[f"{i}.fc1"] = ColwiseParallel()
            plan[f"{i}.fc2"] = RowwiseParallel()
        peer = parallelize_module(peer, topo.mesh["tp"], plan)
        losses: dict[str, list[float]] = {"hybridpar": [], "dtensor": []}
        t = timed_round_robin({"hybridpar": _step(ours, x, y, losses["hybridpar"]),
                               "dtensor": _step(peer, x, y, losses["dtensor"])},
                              warmup=cfg["warmup"], iters=cfg["iters"], repeats=cfg["repeats"])
        rows.append({"hidden": hidden, "hybridpar_s": t["hybridpar"], "dtensor_s": t["dtensor"],
                     "loss_diff": abs(losses["hybridpar"][0] - losses["dtensor"][0])})
        del ours, peer
    return rows if topo.rank == 0 else []


def table(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        ours, dt = r["hybridpar_s"]["median"], r["dtensor_s"]["median"]
        body.append([r["hidden"], fmt(r["tp1_1t_s"], 1e3), fmt(r["tp1_2t_s"], 1e3),
                     fmt(r["hybridpar_s"], 1e3), fmt(r["dtensor_s"], 1e3),
                     f"{r['tp1_1t_s']['median'] / ours:.2f}",
                     f"{r['tp1_2t_s']['median'] / ours:.2f}", f"{dt / ours:.3f}"])
    return markdown_table(["H", "tp=1 1 thread ms", "tp=1 2 threads ms", "hybridpar tp=2 ms",
                           "DTensor tp=2 ms", "speed-up vs tp=1 (1 t)",
                           "vs tp=1 (2 t)", "DTensor / hybridpar"], body)


def run(mode: str = "full") -> dict[str, Any]:
    cfg = SETTINGS[mode]
    loads = [load()]
    single = hybridpar.spawn(_worker_tp1, 1, args=(cfg,), threads=2, timeout=900)[0]
    loads.append(load())
    double = hybridpar.spawn(_worker_tp2, 2, args=(cfg,), timeout=900)[0]
    loads.append(load())
    rows = [{**a, **b} for a, b in zip(single, double)]
    ratio = [r["dtensor_s"]["median"] / r["hybridpar_s"]["median"] for r in rows]
    slower = [(r["hidden"], x) for r, x in zip(rows, ratio) if x < 1]
    notes = [f"{cfg['tokens']} tokens, {cfg['layers']} blocks of H -> H (column) -> H (row), "
             f"forward + cross-entropy + backward; tp=2 ranks use one thread each; first "
             f"losses of the two tp=2 models equal to {max(r['loss_diff'] for r in rows):.1e}.",
             "faster than DTensor at every size: " + ("yes" if not slower else "no, "
             + ", ".join(f"H={h} by {100 * (1 / x - 1):.1f}%" for h, x in slower))]
    return {"name": NAME, "title": TITLE, "config": cfg, "rows": rows, "table": table(rows),
            "notes": notes, "load_average_1m": loads,
            "columns": "ms: median step (± half the range of the repeats); last column > 1: "
                       "hybridpar is faster"}
