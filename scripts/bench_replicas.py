"""Benchmark the replica check: `HybridPipe.check_replicas()` after a training step, against it.

    python scripts/bench_replicas.py [--layouts 1x2x2 2x2x1] [--n-layer 4] [--n-embd 128]
        [--batch 16] [--seq 64] [--chunks 4] [--warmup 2] [--iters 6] [--repeats 5]
        [--out results/bench_replicas.json]

Each layout (pp x tp x dp) runs on pp * tp * dp gloo ranks, one thread each: a GPT of
`hybridpar.models` (vocabulary 256, tp layers over the tp group), `batch` sequences of `seq`
tokens per step (batch / dp per replica, `chunks` micro-batches, 1F1B, no recomputation).
Every iteration runs the trainer's order, each phase timed alone between barriers:

    phase     what runs                                   timed as
    step      pipe.train_step(x, y): forward, backward,   the slowest rank (barriers around)
              gradient all-reduces over tp and dp
    check     pipe.check_replicas() right after it        the same; its all-reduce bytes
                                                          counted by hybridpar.comm_stats
    update    global-norm clip + AdamW                    the same

Per repeat, the median over `iters` iterations (after `warmup`); reported, the median over
`repeats` (at least 3) and half their range. check / step: the check's time over the step's
(train_step alone); check / trainer step: over step + update (what `hybridpar run` does per
step). The counted bytes must equal the formula on every rank: per group a rank is in (tp:
its parameters without a parallel dim; dp: all its parameters; a tie: the tied copies),
2 x (parameters + gradients) widened to at least float32, i.e. 16 bytes per fp32 element
(MAX and MIN of values and of gradients). Prints a table and writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from math import prod
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.common import cpu_name, fmt, load, markdown_table, spread, write_json

import hybridpar
from hybridpar.models import example_batch, gpt, gpt_loss
from hybridpar.sharded.attrs import get_parallel_dim
from hybridpar.tensor_parallel.random import model_parallel_manual_seed

PHASES = ("step", "check", "update")


def parse_layout(text: str) -> tuple[int, int, int]:
    """``"PPxTPxDP"`` -> (pp, tp, dp)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"layout {text!r} is not PPxTPxDP (e.g. 1x2x2)")
    pp, tp, dp = map(int, parts)
    return pp, tp, dp


def formula_bytes(pipe: hybridpar.HybridPipe) -> int:
    """What the check all-reduces on this rank: per group, 2 x (parameters + gradients) of the
    group's copies, each element at least float32 (MAX and MIN of each)."""
    topo = pipe.topology

    def size(params: list[torch.nn.Parameter]) -> int:
        floats = [p for p in params if p.is_floating_point()]
        return sum(4 * p.numel() * max(p.element_size(), 4) for p in floats)

    params = list(dict(pipe.named_parameters()).values())
    total = 0
    if topo.tp > 1:
        total += size([p for p in params if get_parallel_dim(p) is None])
    if topo.dp > 1:
        total += size(params)
    for _, tied in pipe._ties.groups:   # a tie's copies on this rank's stages (none in a GPT)
        total += size(list(tied))
    return total


def _worker(layout: tuple[int, int, int], cfg: dict[str, Any]) -> dict[str, Any]:
    pp, tp, dp = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, timeout=300)
    model_cfg = cfg["model"]
    torch.manual_seed(0)
    model_parallel_manual_seed(0, group=topo.tp_group)
    model = gpt(**model_cfg, tp=tp if tp > 1 else None)
    pipe = hybridpar.HybridPipe(model, "params", chunks=cfg["chunks"], topology=topo,
                                schedule="1f1b", checkpoint="never", loss_fn=gpt_loss)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=1e-4)
    x, y = example_batch("gpt", cfg["batch"], **model_cfg)
    x, y = x.chunk(dp)[topo.dp_rank], y.chunk(dp)[topo.dp_rank]       # (batch / dp, seq)
    times: dict[str, list[float]] = {name: [] for name in PHASES}
    counted: list[int] = []
    worst = 0.0

    def timed(name: str, fn: Any) -> Any:
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        dist.barrier()
        times[name].append(time.perf_counter() - t0)
        return out

    def iteration() -> None:
        nonlocal worst
        optimizer.zero_grad(set_to_none=True)
        timed("step", lambda: pipe.train_step(x, y))
        hybridpar.reset_comm_stats()
        worst = max(worst, timed("check", pipe.check_replicas))
        counted.append(hybridpar.comm_stats().get("all_reduce", {}).get("bytes", 0))

        def update() -> None:
            pipe.clip_grad_norm_(1.0)
            optimizer.step()
        timed("update", update)

    for _ in range(cfg["warmup"]):
        iteration()
    per_repeat: dict[str, list[float]] = {name: [] for name in PHASES}
    for _ in range(cfg["repeats"]):
        for ts in times.values():
            ts.clear()
        for _ in range(cfg["iters"]):
            iteration()
        for name, ts in times.items():
            slowest = torch.tensor([statistics.median(ts)], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            per_repeat[name].append(slowest.item())
    pipe.close()
    return {"rank": topo.rank, "pp_rank": topo.pp_rank, "tp_rank": topo.tp_rank,
            "dp_rank": topo.dp_rank, "params": sum(p.numel() for p in pipe.parameters()),
            "counted_bytes": sorted(set(counted)), "formula_bytes": formula_bytes(pipe),
            "largest_difference": worst,
            "times": {name: spread(v) for name, v in per_repeat.items()}}


def row(layout: tuple[int, int, int], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    pp, tp, dp = layout
    t = ranks[0]["times"]          # every rank all-reduced the same slowest times
    step, check, update = (t[name]["median"] for name in PHASES)
    counted = [r["counted_bytes"] for r in ranks]
    formula = [r["formula_bytes"] for r in ranks]
    return {"pp": pp, "tp": tp, "dp": dp, "ranks": len(ranks),
            "params_per_rank": [r["params"] for r in ranks],
            "step_s": t["step"], "check_s": t["check"], "update_s": t["update"],
            "check_over_step": check / step, "check_over_trainer_step": check / (step + update),
            "bytes_per_rank": [c[0] if len(c) == 1 else c for c in counted],
            "formula_bytes_per_rank": formula,
            "match": all(c == [f] for c, f in zip(counted, formula)),
            "largest_difference": max(r["largest_difference"] for r in ranks)}


def table(rows: list[dict[str, Any]]) -> str:
    def size(n: int) -> str:
        return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"

    body = [[f"{r['pp']} x {r['tp']} x {r['dp']}", f"{max(r['params_per_rank']):,}",
             fmt(r["step_s"], 1e3), fmt(r["update_s"], 1e3), fmt(r["check_s"], 1e3),
             f"{100 * r['check_over_step']:.1f}%", f"{100 * r['check_over_trainer_step']:.1f}%",
             size(max(r["formula_bytes_per_rank"])), "yes" if r["match"] else "NO",
             f"{r['largest_difference']:g}"] for r in rows]
    return markdown_table(["pp x tp x dp", "params / rank", "step ms", "update ms",
                           "check ms", "check / step", "check / trainer step",
                           "check bytes / rank", "bytes = formula", "difference"], body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", type=parse_layout, nargs="+",
                        default=[(1, 2, 2), (2, 2, 1)], metavar="PPxTPxDP")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step, global")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--chunks", type=int, default=4, help="micro-batches per replica")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="results/bench_replicas.json")
    args = parser.parse_args(argv)
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (the median of 3 or more runs)")
    for _, _, dp in args.layouts:
        if args.batch % (dp * args.chunks):
            parser.error(f"--batch {args.batch} does not split into dp={dp} replicas of "
                         f"--chunks {args.chunks} micro-batches")
    cfg = {"model": {"vocab_size": 256, "block_size": args.seq, "n_layer": args.n_layer,
                     "n_head": args.n_head, "n_embd": args.n_embd},
           "batch": args.batch, "chunks": args.chunks, "warmup": args.warmup,
           "iters": args.iters, "repeats": args.repeats}
    command = "python scripts/bench_replicas.py " + " ".join(argv if argv is not None
                                                              else sys.argv[1:])
    start, loads = time.perf_counter(), [load()]
    rows = []
    for layout in args.layouts:
        ranks = hybridpar.spawn(_worker, prod(layout), args=(layout, cfg), timeout=600)
        rows.append(row(layout, ranks))
        loads.append(load())
    text = table(rows)
    m = cfg["model"]
    notes = [f"GPT {m['n_layer']} blocks, h={m['n_embd']}, V=256, {args.batch} x {args.seq} "
             f"tokens per step, {args.chunks} micro-batches per replica, 1F1B, AdamW; median of "
             f"{args.repeats} repeats of {args.iters} iterations (± half their range), "
             "one thread per rank, gloo",
             "check bytes: all-reduced by the check on the busiest rank, per group "
             "2 x (parameters + gradients) of its replicated parameters, at least float32"]
    print(text)
    for note in notes:
        print(f"- {note}")
    seconds = time.perf_counter() - start
    out = write_json(args.out, {"name": "replicas", "command": command.strip(), "config": cfg,
                                "rows": rows, "table": text, "notes": notes,
                                "processor": cpu_name(), "seconds": seconds,
                                "load_average_1m": loads})
    print(f"wrote {out} ({seconds:.0f} s; 1-minute load average "
          + " -> ".join(f"{x:.1f}" for x in loads) + ")")
    return 0 if all(r["match"] and r["largest_difference"] == 0.0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
