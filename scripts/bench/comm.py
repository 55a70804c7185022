"""Benchmark 2: exact communication of the GPT pipeline, from hybridpar's own counters.

One training step of the quick-start GPT at pp = 2 (tp = 1 and tp = 2) after a warm-up step,
counted by `hybridpar.comm_stats()` and placed by the timeline (an all-reduce inside a
forward span belongs to the forward). Checked against BENCH.md:

    quantity                                  formula
    P2P payload per boundary per micro-batch  b·s·h elements each way; b·s·h/t under TP
    all-reduces per GPT block                 2 forward + 2 backward, each b·s·h elements
    vocab-parallel cross-entropy              2 all-reduces of ~b·s scalars; no logit gather

The counts are deterministic (tests/test_trace.py asserts the same numbers); this prints them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

import hybridpar
from hybridpar.models import example_batch, gpt, gpt_loss
from hybridpar.trace import COLUMNS, KINDS, OPS

from .common import load, markdown_table

__all__ = ["NAME", "QUICKSTART", "TITLE", "run"]

NAME = "comm"
TITLE = "2. Exact communication (GPT, pp = 2, counters)"

# configs/quickstart.toml: the model, 16 rows per batch, 4 micro-batches, balance "params"
QUICKSTART = {"vocab_size": 256, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 64}
SETTINGS = {
    "full": {"model": QUICKSTART, "batch": 16, "chunks": 4, "balance": [3, 4], "tp": [1, 2]},
    "quick": {"model": QUICKSTART, "batch": 16, "chunks": 4, "balance": [3, 4], "tp": [1, 2]},
    "smoke": {"model": {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 2,
                        "n_embd": 16}, "batch": 4, "chunks": 2, "balance": [2, 3], "tp": [2]},
}
HEADER = 128 * 8   # the int64 shape header of an activation of new shapes


def _placed(events: list[tuple[int, ...]]) -> Counter[str]:
    """All-reduces by the compute span that holds them: "forward", "backward" or "other"."""
    rows = [dict(zip(COLUMNS, e)) for e in events]
    spans = [r for r in rows if KINDS[r["kind"]] in ("forward", "backward")]
    placed: Counter[str] = Counter()
    for r in rows:
        if KINDS[r["kind"]] == "collective" and OPS[r["op"]] == "all_reduce":
            holder = [KINDS[s["kind"]] for s in spans
                      if s["start"] <= r["start"] and r["end"] <= s["end"]]
            placed[holder[0] if holder else "other"] += 1
    return placed


def _worker(tp: int, cfg: dict[str, Any]) -> dict[str, Any]:
    topo = hybridpar.init(pp=2, tp=tp, timeout=120)
    torch.manual_seed(0)
    model = gpt(**cfg["model"], tp=tp)
    pipe = hybridpar.HybridPipe(model, cfg["balance"], chunks=cfg["chunks"], topology=topo,
                                schedule="1f1b", checkpoint="never", loss_fn=gpt_loss)
    x, y = example_batch("gpt", cfg["batch"], **cfg["model"])
    pipe.train_step(x, y)                       # warm-up: the counters count the next step
    hybridpar.reset_comm_stats()
    pipe.trace = True
    pipe.train_step(x, y)
    return {"stage": topo.pp_rank, "tp_rank": topo.tp_rank, "stats": hybridpar.comm_stats(),
            "placed": dict(_placed(list(pipe.recorder.events)))}


def _rows(tp: int, cfg: dict[str, Any], ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    m, model = cfg["chunks"], cfg["model"]
    b, s, h, v = cfg["batch"] // m, model["block_size"], model["n_embd"], model["vocab_size"]
    act = b * s * h * 4                                 # one micro-batch's activation, bytes
    first, last = (next(r for r in ranks if r["stage"] == k and r["tp_rank"] == 0)
                   for k in (0, 1))
    blocks = [cfg["balance"][0] - 1, cfg["balance"][1] - 2]   # minus Embeddings / LN + Head
    rows = []

    def row(quantity: str, measured: float, formula: str, expected: float) -> None:
        rows.append({"tp": tp, "quantity": quantity, "measured": measured,
                     "formula": formula, "expected": expected,
                     "match": abs(measured - expected) < 1e-9})

    fs, bs = first["stats"], last["stats"]
    per = "b·s·h" if tp == 1 else "b·s·h/t"
    row("P2P bytes per micro-batch, activation (stage 0 → 1)",
        fs["p2p_send"]["bytes"] / m, f"4·{per}", act / tp)
    row("P2P bytes per micro-batch, gradient (stage 1 → 0)",
        bs["p2p_send"]["bytes"] / m, f"4·{per}", act / tp)
    row("P2P messages per micro-batch per direction", fs["p2p_send"]["calls"] / m, "1", 1)
    row("header bytes per step of known shapes (every rank)",
        sum(r["stats"].get("p2p_header", {}).get("bytes", 0) for r in ranks), "0", 0)
    if tp > 1:
        for k, r in ((0, first), (1, last)):
            fwd = r["placed"].get("forward", 0) / m
            bwd = r["placed"].get("backward", 0) / m
            extra_f = 1 if k == 0 else 2                # vocab-parallel embedding / loss (2)
            extra_b = 0 if k == 0 else 1                # column-parallel head's input grad
            row(f"stage {k}: all-reduces per block, forward", (fwd - extra_f) / blocks[k],
                "2", 2)
            row(f"stage {k}: all-reduces per block, backward", (bwd - extra_b) / blocks[k],
                "2", 2)
        ar = fs["all_reduce"]
        row("stage 0: bytes per all-reduce", ar["bytes"] / ar["calls"], "4·b·s·h", act)
        loss_bytes = ((b * s + tp) + 2 * b * s) * 4
        blocks_bytes = (4 * blocks[1] + 1) * act        # the blocks and the head, per mb
        row("stage 1: loss all-reduce bytes per micro-batch",
            bs["all_reduce"]["bytes"] / m - blocks_bytes, "4·(3·b·s + t)", loss_bytes)
        gathered = sum(r["stats"].get("all_gather", {}).get("bytes", 0) for r in (first, last))
        reassembly = sum(r["stats"]["p2p_recv"]["calls"] for r in (first, last)) * act
        row("all-gather bytes beyond the P2P re-assembly (logits: 4·b·s·V/t)",
            gathered - reassembly, "0", 0)
        logits = b * s * v // tp * 4
        rows.append({"tp": tp, "quantity": "(a gathered logit shard would be, per mb)",
                     "measured": logits, "formula": "4·b·s·V/t", "expected": logits,
                     "match": True})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def num(x: float) -> str:
        return f"{x:.0f}" if float(x).is_integer() else f"{x:.2f}"

    body = [[r["tp"], r["quantity"], num(r["measured"]), r["formula"], num(r["expected"]),
             "yes" if r["match"] else "**no**"] for r in rows]
    return markdown_table(["tp", "quantity", "measured", "formula", "expected", "match"], body)


def run(mode: str = "full") -> dict[str, Any]:
    cfg = SETTINGS[mode]
    rows: list[dict[str, Any]] = []
    for tp in cfg["tp"]:
        ranks = hybridpar.spawn(_worker, 2 * tp, args=(tp, cfg), timeout=300)
        rows += _rows(tp, cfg, ranks)
    m, model = cfg["chunks"], cfg["model"]
    b = cfg["batch"] // m
    notes = [f"b={b} rows per micro-batch, s={model['block_size']}, h={model['n_embd']}, "
             f"V={model['vocab_size']}, m={m}, balance {cfg['balance']}, 1f1b; one step "
             f"after a warm-up step."]
    bad = [r["quantity"] for r in rows if not r["match"]]
    notes.append("every count matches its formula" if not bad else
                 "MISMATCH: " + "; ".join(bad))
    notes.append(f"payloads travel alone: a {HEADER}-byte shape header goes with each "
                 "activation only in the first step of new shapes (the warm-up step here).")
    return {"name": NAME, "title": TITLE, "config": cfg, "rows": rows, "table": table(rows),
            "notes": notes, "load_average_1m": [load()]}
