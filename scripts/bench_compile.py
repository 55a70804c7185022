"""Compiled blocks (`train.compile`): the quick-start GPT's step time eager vs compiled.

    python scripts/bench_compile.py [--layout 2x2 1x1] [--steps 10] [--warmup 3]
        [--repeats 3] [--set model.n_embd=256 ...] [--out results/bench_compile.json]
        [--smoke]

The model and run: configs/quickstart.toml (GPT n_embd 64, 4 layers, 4 heads, block 64,
batch 16, 4 micro-batches, 1F1B, checkpoint "except_last"), its ranks CPU gloo processes
(`hybridpar.spawn`, one torch thread each), at each layout ``PPxTP`` (2x2: the quick start's
own, 4 ranks; 1x1: one rank, the blocks without tp collectives). Same run: every rank builds
both pipes as `hybridpar run` does (`train.trainer.build_pipe`, ``train.compile`` false and
true, inductor), then

    compile     the compiled pipe's first step (dynamo + inductor: every graph, both grad
                modes), timed alone; then `warmup` more steps of each
    step        `bench.common.timed_round_robin`: `repeats` x `steps` rounds, eager and
                compiled taking turns, each step (batch + train_step + clip + AdamW) between
                two barriers, the slowest rank's median step; the median over the repeats
    ratio       compiled / eager per repeat, then its median (< 1: compiled is faster)
    frames      dynamo frames compiled on the rank (after the warm-up) and recompilations
                during the timed steps (must be 0), graph breaks per rank

`--set SECTION.KEY=VALUE` changes the config as `hybridpar run --set` does (a wider model).
Prints the table, writes the numbers as JSON with the machine and its load. `--smoke` runs a
tiny model, one repeat and a few steps: it checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import hybridpar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.common import (
    fmt,
    load,
    machine,
    machine_line,
    markdown_table,
    spread,
    write_json,
)

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.toml"
# --smoke: a tiny GPT (what is checked is the script, not the speed)
SMOKE_MODEL = ["model.n_embd=16", "model.n_layer=2", "model.n_head=2", "model.block_size=16"]


def _rank(overrides: list[str], warmup: int, steps: int, repeats: int) -> dict[str, Any]:
    """Both pipes on this rank, timed in turns; the compile time and dynamo's counts."""
    import torch
    from bench.common import timed_round_robin
    from torch._dynamo.utils import counters

    from hybridpar.compile import BlockCompileWarning
    from hybridpar.train import load_config
    from hybridpar.train.build import build_optimizer
    from hybridpar.train.data import make_batches
    from hybridpar.train.trainer import build_pipe

    warnings.simplefilter("error", BlockCompileWarning)   # a fallback would time eager twice
    configs = {name: load_config(QUICKSTART, [*overrides, f"train.compile={flag}"])
               for name, flag in (("eager", "false"), ("compiled", "true"))}
    par = configs["eager"].parallel
    topo = hybridpar.init(pp=par.pp, tp=par.tp, dp=par.dp, timeout=par.timeout)
    batches = make_batches(configs["eager"], split="train", dp_rank=topo.dp_rank, dp=topo.dp)
    runs = {}
    for name, config in configs.items():
        pipe = build_pipe(config, topo)
        runs[name] = (pipe, build_optimizer(pipe, config))

    def step_of(name: str) -> Any:
        pipe, optimizer = runs[name]

        def step() -> None:
            x, y = batches.next_batch()
            optimizer.zero_grad(set_to_none=True)
            pipe.train_step(x, y)
            pipe.clip_grad_norm_(1.0)
            optimizer.step()
        return step

    steps_of = {name: step_of(name) for name in runs}
    torch.distributed.barrier()
    t0 = time.perf_counter()
    steps_of["compiled"]()                                # compiles every graph
    compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        for step in steps_of.values():
            step()
    frames = counters["frames"]["total"]
    timed = timed_round_robin(steps_of, warmup=0, iters=steps, repeats=repeats)
    out = {"eager_s": timed["eager"], "compiled_s": timed["compiled"],
           "ratio": spread([c / e for e, c in zip(timed["eager"]["samples"],
                                                   timed["compiled"]["samples"])]),
           "compile_s": compile_s, "frames": frames,
           "recompiles": counters["frames"]["total"] - frames,
           "graph_breaks": sum(counters["graph_break"].values()),
           "compiled_blocks": runs["compiled"][0].compiled_blocks,
           "chunks": par.chunks}
    for pipe, _ in runs.values():
        pipe.close()
    return out


def run_layout(layout: str, model: list[str], *, warmup: int, steps: int,
               repeats: int) -> dict[str, Any]:
    pp, tp = (int(v) for v in layout.lower().split("x"))
    overrides = [f"parallel.pp={pp}", f"parallel.tp={tp}", "parallel.dp=1",
                 "parallel.timeout=600", *model]
    ranks = hybridpar.spawn(_rank, pp * tp, args=(overrides, warmup, steps, repeats),
                            timeout=3000)
    r0 = ranks[0]   # step times are the slowest rank's on every rank
    return {"layout": layout, "pp": pp, "tp": tp, "ranks": pp * tp, "eager_s": r0["eager_s"],
            "compiled_s": r0["compiled_s"], "ratio": r0["ratio"], "chunks": r0["chunks"],
            "compile_s": max(r["compile_s"] for r in ranks),
            "frames": [r["frames"] for r in ranks],
            "recompiles": [r["recompiles"] for r in ranks],
            "graph_breaks": [r["graph_breaks"] for r in ranks],
            "compiled_blocks": [r["compiled_blocks"] for r in ranks],
            "warmup": warmup, "steps": steps, "repeats": repeats}


def table(rows: list[dict[str, Any]]) -> str:
    def per_mb(s: dict[str, Any], chunks: int) -> str:
        return f"{s['median'] * 1e3 / chunks:.1f}"

    return markdown_table(
        ["layout (pp x tp)", "eager (ms / step)", "compiled (ms / step)", "compiled / eager",
         "eager / compiled (ms / micro-batch)", "compile (s)", "frames per rank",
         "recompiles", "graph breaks per rank"],
        [[r["layout"], fmt(r["eager_s"], 1e3), fmt(r["compiled_s"], 1e3),
          fmt(r["ratio"], 1, 3),
          f"{per_mb(r['eager_s'], r['chunks'])} / {per_mb(r['compiled_s'], r['chunks'])}",
          f"{r['compile_s']:.1f}", " ".join(map(str, r["frames"])),
          sum(r["recompiles"]), " ".join(map(str, r["graph_breaks"]))] for r in rows])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layout", nargs="+", default=["2x2", "1x1"],
                   help="PPxTP layouts (2x2: the quick start's)")
    p.add_argument("--steps", type=int, default=10, help="timed rounds per repeat")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each after compile")
    p.add_argument("--repeats", type=int, default=3, help="repeats (medians of medians)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="a config override (repeatable)")
    p.add_argument("--out", default="results/bench_compile.json")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model, 1 repeat, few steps: checks the script, not speed")
    args = p.parse_args(argv)
    model: list[str] = list(args.overrides)
    if args.smoke:
        model = [*SMOKE_MODEL, *model]
        args.steps, args.warmup, args.repeats = 2, 1, 1
    started, load_before = time.perf_counter(), load()
    rows = [run_layout(layout, model, warmup=args.warmup, steps=args.steps,
                       repeats=args.repeats) for layout in args.layout]
    result = {"rows": rows, "model_overrides": model, "smoke": args.smoke,
              "config": str(QUICKSTART.relative_to(ROOT)), "machine": machine(),
              "load_before": load_before, "load_after": load(),
              "seconds": round(time.perf_counter() - started, 1)}
    print(f"quick-start GPT step time, eager vs compiled blocks (inductor), same run "
          f"(median of {args.steps} steps per repeat, median of {args.repeats} repeats, "
          f"± half the range):\n")
    print(table(rows))
    print(f"\n{machine_line(result)}")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
