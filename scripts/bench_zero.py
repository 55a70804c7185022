"""ZeRO-1 (`parallel.zero`): the state a rank holds per parameter, and what sharding costs in time.

    python scripts/bench_zero.py [--dp 1 2 4] [--zero 0 1] [--time-dp 2] [--steps 30] [--warmup 5]
        [--repeats 3] [--out results/bench_zero.json] [--smoke]

The model: the quick-start GPT (configs/quickstart.toml: n_embd 64, 4 layers, 4 heads, block
64, batch 16, 4 micro-batches) at pp = 1, tp = 1, its ranks CPU gloo processes
(`hybridpar.spawn`, one torch thread each), built and given their optimizer as `hybridpar run`
does: `train.trainer.build_pipe(config, topo)`, then `train.trainer._optimizer(pipe, config)`
(AdamW; at ``parallel.zero = 1`` and dp > 1 torch's `ZeroRedundancyOptimizer`, which deals
whole parameters to the dp ranks: `hybridpar.optim.zero`).

1. Memory. Each (dp, zero) runs one full training step on every rank (a batch of
   `make_batches(config, split="train", dp_rank, dp)`, `pipe.train_step(x, y)`,
   `optimizer.step()`), then `train.check_memory.held_bytes(pipe, optimizer)`; each column is
   bytes per trainable parameter of the rank (exact counts, no repeats):

    column      bytes of                                    formula
    params      parameters and buffers (fp32)               4
    grads       gradients outside the dp buckets            4 at dp = 1, else 0
    buckets     the dp buckets' flat buffers (dp > 1): the  0 at dp = 1, else 4
                gradients are views of them
    optimizer   AdamW's exp_avg and exp_avg_sq of the       zero 0: 8; zero 1: about 8 / dp
                parameters the rank owns, plus one 4-byte   (whole parameters are dealt, so
                `step` per owned tensor (on a CPU rank      a rank's share is uneven; their
                torch keeps it on the device)               sum over the ranks is 8)
    total       the four                                    zero 0: 16; zero 1: 4 + 4 + 8/dp

   The worst rank (largest total) is shown with the spread of the totals over the ranks;
   "step counts" is what the `step` scalars add above the formula (4 bytes x tensors owned).

2. Step time of zero = 1 against zero = 0 at dp = `--time-dp` (2): each repeat spawns the two
   in turn (the order swapped every other repeat); a spawn runs `warmup` steps, then `steps`
   timed steps of zero_grad + batch + train_step + `pipe.clip_grad_norm_(1.0)` +
   `optimizer.step()`, each between two barriers (`bench.common.timed_round_robin`: BENCH.md),
   and reports the median step of its slowest rank. Reported: the median over the repeats of
   each and of the per-repeat ratio zero1 / zero0, with the spread ((max - min) / median).

Prints both tables, writes the numbers as JSON with the machine and its load. `--smoke` runs a
tiny model, one repeat and a few steps: it checks the script, not the speed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import hybridpar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.common import fmt, load, machine, markdown_table, spread, write_json

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.toml"
COLUMNS = ("params", "grads", "buckets", "optimizer")
# --smoke: a tiny GPT (what is checked is the script and the exact counts, not the speed)
SMOKE_MODEL = ["model.n_embd=16", "model.n_layer=1", "model.n_head=2", "model.block_size=16"]


def _overrides(dp: int, zero: int, model: list[str]) -> list[str]:
    return ["parallel.pp=1", "parallel.tp=1", f"parallel.dp={dp}", f"parallel.zero={zero}",
            "parallel.timeout=300", *model]


def _setup(overrides: list[str]) -> tuple[Any, Any, Any, Any]:
    """This rank's (config, pipe, optimizer, batches), as `hybridpar run` builds them."""
    from hybridpar.train import load_config
    from hybridpar.train.data import make_batches
    from hybridpar.train.trainer import _optimizer, build_pipe

    config = load_config(QUICKSTART, overrides)
    par = config.parallel
    topo = hybridpar.init(pp=par.pp, tp=par.tp, dp=par.dp, timeout=par.timeout)
    pipe = build_pipe(config, topo)
    optimizer = _optimizer(pipe, config)
    batches = make_batches(config, split="train", dp_rank=topo.dp_rank, dp=topo.dp)
    return config, pipe, optimizer, batches


def _memory_rank(overrides: list[str]) -> dict[str, int]:
    """One training step on this rank, then the bytes it holds (`held_bytes`) and the counts
    that the formulas need."""
    from hybridpar.optim import local_optimizer, owned_parameters
    from hybridpar.train.check_memory import held_bytes, tensor_bytes

    _, pipe, optimizer, batches = _setup(overrides)
    x, y = batches.next_batch()
    optimizer.zero_grad(set_to_none=True)
    pipe.train_step(x, y)
    optimizer.step()
    held = held_bytes(pipe, optimizer)
    trainable = [p for p in pipe.parameters() if p.requires_grad]
    owned = owned_parameters(optimizer)
    state = local_optimizer(optimizer).state.values()
    out = dict(held,
               n_params=sum(p.numel() for p in trainable), n_tensors=len(trainable),
               owned_params=sum(p.numel() for p in trainable if id(p) in owned),
               owned_tensors=sum(1 for p in trainable if id(p) in owned),
               moments=tensor_bytes(v for s in state for k, v in s.items() if k != "step"),
               step_counts=tensor_bytes(v for s in state for k, v in s.items() if k == "step"))
    pipe.close()
    return out


def _formula(dp: int, zero: int) -> tuple[float, str]:
    """The bytes per parameter the issue's formulas give, and how they read."""
    if zero == 0:
        return 16.0, ("4 + 4 + 8 = 16" if dp == 1 else "4 + 4 (buckets hold the grads) + 8 = 16")
    total = 4 + 4 + 8 / dp
    return total, f"4 + 4{'' if dp == 1 else ' (buckets)'} + 8/{dp} = {total:g}"


def memory(dps: list[int], zeros: list[int], model: list[str]) -> list[dict[str, Any]]:
    rows = []
    for dp in dps:
        for zero in zeros:
            ranks = hybridpar.spawn(_memory_rank, dp, args=(_overrides(dp, zero, model),),
                                    timeout=600)
            for r in ranks:
                r["total"] = sum(r[k] for k in COLUMNS)
            n = ranks[0]["n_params"]
            worst = max(range(dp), key=lambda i: ranks[i]["total"])
            formula, text = _formula(dp, zero)
            rows.append({
                "dp": dp, "zero": zero, "n_params": n, "n_tensors": ranks[0]["n_tensors"],
                "ranks": ranks, "worst_rank": worst,
                "per_param": {k: ranks[worst][k] / n
                              for k in (*COLUMNS, "moments", "step_counts", "total")},
                "total_per_param": spread([r["total"] / n for r in ranks]),
                "formula": formula, "formula_text": text,
            })
    return rows


def _time_rank(overrides: list[str], warmup: int, steps: int) -> dict[str, Any]:
    """`steps` timed training steps after `warmup` (the slowest rank's median step)."""
    from bench.common import timed_round_robin

    _, pipe, optimizer, batches = _setup(overrides)

    def step() -> None:
        x, y = batches.next_batch()
        optimizer.zero_grad(set_to_none=True)
        pipe.train_step(x, y)
        pipe.clip_grad_norm_(1.0)
        optimizer.step()

    timed = timed_round_robin({"step": step}, warmup=warmup, iters=steps, repeats=1)["step"]
    pipe.close()
    return {"step_s": timed["median"]}


def step_time(dp: int, model: list[str], *, warmup: int, steps: int, repeats: int
              ) -> dict[str, Any]:
    samples: dict[int, list[float]] = {0: [], 1: []}
    for i in range(repeats):
        for zero in (0, 1) if i % 2 == 0 else (1, 0):
            ranks = hybridpar.spawn(_time_rank, dp, args=(_overrides(dp, zero, model), warmup,
                                                          steps), timeout=600)
            samples[zero].append(ranks[0]["step_s"])   # the slowest rank's, on every rank
    ratios = [z1 / z0 for z0, z1 in zip(samples[0], samples[1])]
    return {"dp": dp, "warmup": warmup, "steps": steps, "repeats": repeats,
            "zero0_s": spread(samples[0]), "zero1_s": spread(samples[1]),
            "ratio": spread(ratios)}


def memory_table(rows: list[dict[str, Any]]) -> str:
    def b(v: float) -> str:
        return f"{v:.3f}"

    return markdown_table(
        ["dp", "zero", "params", "grads", "buckets", "optimizer", "total (worst rank)",
         "formula", "step counts", "ranks' totals (min–max)", "spread"],
        [[r["dp"], r["zero"], *(b(r["per_param"][k]) for k in COLUMNS),
          f"**{b(r['per_param']['total'])}**", r["formula_text"],
          f"+{r['per_param']['step_counts']:.4f}",
          f"{b(r['total_per_param']['min'])}–{b(r['total_per_param']['max'])}",
          f"{r['total_per_param']['spread_pct']:.1f}%"] for r in rows])


def time_table(t: dict[str, Any]) -> str:
    return markdown_table(
        ["dp", "zero 0 (ms / step)", "zero 1 (ms / step)", "zero 1 / zero 0", "repeats"],
        [[t["dp"], fmt(t["zero0_s"], 1e3), fmt(t["zero1_s"], 1e3), fmt(t["ratio"], 1, 3),
          t["repeats"]]])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="memory rows' dp")
    p.add_argument("--zero", type=int, nargs="+", default=[0, 1], choices=[0, 1])
    p.add_argument("--time-dp", type=int, default=2, help="dp of the step-time comparison")
    p.add_argument("--steps", type=int, default=30, help="timed steps per spawn")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per spawn")
    p.add_argument("--repeats", type=int, default=3, help="spawns of each zero, alternating")
    p.add_argument("--out", default="results/bench_zero.json")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model, 1 repeat, few steps: checks the script, not speed")
    args = p.parse_args(argv)
    model: list[str] = []
    if args.smoke:
        model = SMOKE_MODEL
        args.steps, args.warmup, args.repeats = 3, 1, 1
    started, load_before = time.perf_counter(), load()
    rows = memory(args.dp, args.zero, model)
    timing = step_time(args.time_dp, model, warmup=args.warmup, steps=args.steps,
                       repeats=args.repeats)
    result = {"memory": rows, "step_time": timing, "model_overrides": model,
              "config": str(QUICKSTART.relative_to(ROOT)), "smoke": args.smoke,
              "machine": machine(), "load_before": load_before, "load_after": load(),
              "seconds": round(time.perf_counter() - started, 1)}
    n = rows[0]["n_params"]
    print(f"bytes per trainable parameter per rank ({n:,} parameters, "
          f"{rows[0]['n_tensors']} tensors), after one step:\n")
    print(memory_table(rows))
    print(f"\nstep time at dp = {timing['dp']} (median of {timing['steps']} steps per spawn, "
          f"median of {timing['repeats']} spawns each, ± half the range):\n")
    print(time_table(timing))
    print(f"\nmachine: {result['machine']['processor']}, {result['machine']['cpus']} CPUs, "
          f"torch {result['machine']['torch']}; load {load_before} -> {result['load_after']}; "
          f"{result['seconds']} s")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
