"""Benchmark 3: saved-activation bytes per stage, per schedule and checkpoint mode.

Every tensor autograd saves during a training step passes through
`torch.autograd.graph.saved_tensors_hooks`; the pack hook counts its storage (once, however
many nodes save it; parameters and buffers excluded) until the graph lets it go, and the peak
of the live total is the stage's activation memory. The formula: A_s (the bytes one
micro-batch saves on stage s, measured alone) times the live micro-batches of the schedule,
`hybridpar.pipeline.schedules.schedule.live_microbatches`:

    schedule  never          always   except_last
    GPipe     m              1        1
    1F1B      min(p - s, m)  1        2 (stages before the last: a recomputation while the
                                        last micro-batch is held), 1 on the last stage
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

import hybridpar
from hybridpar.models import example_batch, gpt, gpt_loss
from hybridpar.pipeline.activations.checkpoint import is_checkpointed
from hybridpar.pipeline.schedules.schedule import get_schedule, live_microbatches

from .common import load, markdown_table

__all__ = ["NAME", "TITLE", "SavedBytes", "run"]

NAME = "memory"
TITLE = "3. Activation memory (saved-tensor bytes per stage)"

SETTINGS = {
    "full": {"model": {"vocab_size": 256, "block_size": 64, "n_layer": 6, "n_head": 4,
                       "n_embd": 64}, "p": 4, "m": 8, "rows": 2, "balance": [2, 2, 2, 3]},
    "quick": {"model": {"vocab_size": 256, "block_size": 64, "n_layer": 6, "n_head": 4,
                        "n_embd": 64}, "p": 4, "m": 8, "rows": 2, "balance": [2, 2, 2, 3]},
    "smoke": {"model": {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 2,
                        "n_embd": 16}, "p": 2, "m": 4, "rows": 1, "balance": [2, 3]},
}
MODES = ("never", "except_last", "always")


class SavedBytes:
    """Live and peak bytes of the storages autograd holds for backward (excluding `exclude`)."""

    def __init__(self, exclude: list[Tensor]) -> None:
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.refs: dict[int, int] = {}
        self.live = self.peak = 0

    def _release(self, ptr: int, nbytes: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            del self.refs[ptr]
            self.live -= nbytes

    def pack(self, t: Tensor) -> Any:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in self.exclude or ptr == 0:
            return t
        if ptr not in self.refs:
            self.refs[ptr] = 0
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.refs[ptr] += 1
        box = _Box(t)
        weakref.finalize(box, self._release, ptr, nbytes)
        return box

    @staticmethod
    def unpack(packed: Any) -> Tensor:
        return packed.t if isinstance(packed, _Box) else packed

    @contextmanager
    def counting(self) -> Iterator[SavedBytes]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self


class _Box:
    """A saved tensor; when autograd drops it, its bytes stop counting."""

    __slots__ = ("__weakref__", "t")

    def __init__(self, t: Tensor) -> None:
        self.t = t


def _one_microbatch(pipe: hybridpar.HybridPipe, x: Tensor, y: Tensor, last: bool,
                    first: bool, width: int) -> int:
    """A_s: the saved bytes of one micro-batch's forward (+ loss) on this stage, alone."""
    part = pipe.partition
    owned = [*part.parameters(), *part.buffers()]
    counter = SavedBytes(owned)
    inp = x if first else torch.randn(x.shape[0], x.shape[1], width, requires_grad=True)
    with counter.counting():
        out = part(inp)
        if last:
            out = gpt_loss(out, y)
    del out, inp
    return counter.peak


def _worker(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    p, m, rows = cfg["p"], cfg["m"], cfg["rows"]
    topo = hybridpar.init(pp=p, timeout=120)
    x, y = example_batch("gpt", m * rows, **cfg["model"])
    out = []
    for schedule in ("gpipe", "1f1b"):
        for mode in MODES:
            torch.manual_seed(0)
            pipe = hybridpar.HybridPipe(gpt(**cfg["model"]), cfg["balance"], chunks=m,
                                        topology=topo, schedule=schedule, checkpoint=mode,
                                        loss_fn=gpt_loss)
            s = topo.pp_rank
            unit = _one_microbatch(pipe, x[:rows].clone(), y[:rows].clone(),  # own storages
                                   s == p - 1, s == 0, cfg["model"]["n_embd"])
            counter = SavedBytes([*pipe.parameters(), *pipe.buffers()])
            pipe.train_step(x, y)                  # warm-up (lazy initialisations)
            with counter.counting():
                pipe.train_step(x, y)
            live = live_microbatches(get_schedule(schedule)(p, m),
                                     checkpointed=lambda i, mode=mode: is_checkpointed(mode, i, m))
            out.append({"schedule": schedule, "checkpoint": mode, "stage": s,
                        "unit_bytes": unit, "live_microbatches": live[s],
                        "expected_bytes": unit * live[s], "measured_bytes": counter.peak,
                        "left_bytes": counter.live})
    return out


def table(rows: list[dict[str, Any]], p: int) -> str:
    keyed = {(r["schedule"], r["checkpoint"], r["stage"]): r for r in rows}
    body = []
    for schedule in ("gpipe", "1f1b"):
        for mode in MODES:
            cells = [schedule, mode]
            for s in range(p):
                r = keyed[schedule, mode, s]
                ratio = r["measured_bytes"] / r["expected_bytes"]
                cells.append(f"{r['measured_bytes'] / 2**10:.0f} ({r['live_microbatches']}× "
                             f"→ {ratio:.2f})")
            body.append(cells)
    units = [f"A{s} = {keyed['gpipe', 'never', s]['unit_bytes'] / 2**10:.0f}" for s in range(p)]
    return markdown_table(["schedule", "checkpoint", *[f"stage {s} KiB" for s in range(p)]],
                          body) + "\n\nKiB saved per micro-batch alone: " + ", ".join(units)


def run(mode: str = "full") -> dict[str, Any]:
    cfg = SETTINGS[mode]
    rows = [r for rank in hybridpar.spawn(_worker, cfg["p"], args=(cfg,), timeout=600)
            for r in rank]
    worst = max(abs(r["measured_bytes"] / r["expected_bytes"] - 1) for r in rows)
    leaks = [r for r in rows if r["left_bytes"]]
    model = cfg["model"]
    notes = [f"GPT {model['n_layer']} blocks, h={model['n_embd']}, s={model['block_size']}, "
             f"V={model['vocab_size']}; p={cfg['p']}, m={cfg['m']}, b={cfg['rows']}, "
             f"balance {cfg['balance']}.",
             f"measured / formula within {100 * worst:.1f}% everywhere"
             + ("" if not leaks else f"; {len(leaks)} runs left saved tensors alive") + "; "
             "the residual: the micro-batches of token ids (stage 0) and targets (last "
             "stage) are views of one batch tensor, whose storage counts once, whole."]
    return {"name": NAME, "title": TITLE, "config": cfg, "rows": rows,
            "table": table(rows, cfg["p"]), "notes": notes, "load_average_1m": [load()],
            "columns": "each cell: peak saved KiB (live micro-batches of the formula → "
                       "measured / (A_s × live))"}
