"""ZeRO-1 / 2 and bf16 weights: the state a rank holds per parameter, and what sharding costs.

    python scripts/bench_zero.py [--dp 1 2 4] [--zero 0 1 2] [--param-dtype fp32 bf16]
        [--time-dp 2] [--time-param-dtype fp32 bf16] [--steps 30] [--warmup 5]
        [--repeats 3] [--out results/bench_zero.json]
        [--smoke]

The model: the quick-start GPT (configs/quickstart.toml: n_embd 64, 4 layers, 4 heads, block
64, batch 16, 4 micro-batches) at pp = 1, tp = 1, its ranks CPU gloo processes
(`hybridpar.spawn`, one torch thread each), built and given their optimizer as `hybridpar run`
does: `train.trainer.build_pipe(config, topo)`, then `train.trainer.build_optimizer(pipe, config)`
(AdamW; at ``parallel.zero = 1`` and dp > 1 torch's `ZeroRedundancyOptimizer`, which deals
whole parameters to the dp ranks: `hybridpar.optim.zero`; with ``train.param_dtype = "bf16"``
(and ``train.precision = "bf16"``) bf16 weights, float32 gradients and `MasterWeights`, which
deals the float32 masters and moments the same way: `hybridpar.optim.master`; at
``parallel.zero = 2`` `MasterWeights` in both dtypes, and each gradient reduced to its owner
only: `hybridpar.pipeline.parameters.grad_shards`).

1. Memory. Each (dp, zero) runs one full training step on every rank (a batch of
   `make_batches(config, split="train", dp_rank, dp)`, `pipe.train_step(x, y)`,
   `optimizer.step()`), then `train.check.memory.held_bytes(pipe, optimizer)`; each column is
   bytes per trainable parameter of the rank (exact counts, no repeats):

    column      bytes of                                    fp32 weights     bf16 weights
    params      parameters and buffers                      4                2
    grads       gradients outside the dp buckets            4 at dp = 1,     0
                                                            else 0
    buckets     the dp buckets' flat buffers: the           0 at dp = 1,     4 (float32, at
                gradients are views of them (zero 2: the    else 4;          dp = 1 too);
                rank's own parameters' only)                zero 2: ~4 / dp  zero 2: ~4 / dp
    optimizer   AdamW's exp_avg and exp_avg_sq (and the     zero 0: 8        zero 0: 12
                float32 masters) of the parameters the      zero 1, 2:       zero 1, 2:
                rank owns, plus one 4-byte `step` per       ~8 / dp          ~12 / dp
                owned tensor (on a CPU rank torch keeps it
                on the device); whole parameters are
                dealt, so a rank's share is uneven
    total       the four                                    16; 8 + 8/dp;    18; 6 + 12/dp;
                                                            4 + 12/dp        2 + 16/dp

   Not in the table: zero 2's staging buffers (a bucket being filled and one reduce in flight,
   at most 2 x 8 MiB: `grad_shards`), alive during the backward only.

   The worst rank (largest total) is shown with the spread of the totals over the ranks;
   "step counts" is what the `step` scalars add above the formula (4 bytes x tensors owned).

2. Step time of zero = 1 and 2 against zero = 0 at dp = `--time-dp` (2), for each param dtype
   (bf16 weights train under bf16 autocast, as ``hybridpar run`` does): each repeat spawns the two
   in turn (the order swapped every other repeat); a spawn runs `warmup` steps, then `steps`
   timed steps of zero_grad + batch + train_step + `pipe.clip_grad_norm_(1.0)` +
   `optimizer.step()`, each between two barriers (`bench.common.timed_round_robin`: BENCH.md),
   and reports the median step of its slowest rank. Reported: the median over the repeats of
   each and of the per-repeat ratios zero1 / zero0 and zero2 / zero0, with the spread
   ((max - min) / median).

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
COLUMNS = ("params", "grads", "buckets", "optimizer")
# --smoke: a tiny GPT (what is checked is the script and the exact counts, not the speed)
SMOKE_MODEL = ["model.n_embd=16", "model.n_layer=1", "model.n_head=2", "model.block_size=16"]
# the peak rows: the GPT of 25 M parameters (n_embd 512, 8 layers), each rank after
# one step of a tiny one (what a process's first step costs once is not the model's)
PEAK_MODEL = ["model.n_embd=512", "model.n_layer=8"]
PEAK_WARM_UP = ["model.n_embd=32", "model.n_layer=1"]
M_MMAP_THRESHOLD = -3   # mallopt's parameter number (malloc.h)


def _overrides(dp: int, zero: int, dtype: str, model: list[str]) -> list[str]:
    precision = [] if dtype == "fp32" else [f"train.precision={dtype}",
                                            f"train.param_dtype={dtype}"]
    return ["parallel.pp=1", "parallel.tp=1", f"parallel.dp={dp}", f"parallel.zero={zero}",
            "parallel.timeout=300", *precision, *model]


def _autocast(config: Any) -> Any:
    """The autocast `hybridpar run` trains under (bf16 precision: bf16 autocast)."""
    import torch

    return torch.autocast("cpu", dtype=torch.bfloat16,
                          enabled=config.train.precision == "bf16")


def _setup(overrides: list[str]) -> tuple[Any, Any, Any, Any]:
    """This rank's (config, pipe, optimizer, batches), as `hybridpar run` builds them."""
    from hybridpar.train import load_config
    from hybridpar.train.build import build_optimizer
    from hybridpar.train.data import make_batches
    from hybridpar.train.trainer import build_pipe

    config = load_config(QUICKSTART, overrides)
    par = config.parallel
    topo = hybridpar.init(pp=par.pp, tp=par.tp, dp=par.dp, timeout=par.timeout)
    pipe = build_pipe(config, topo)
    optimizer = build_optimizer(pipe, config)
    batches = make_batches(config, split="train", dp_rank=topo.dp_rank, dp=topo.dp)
    return config, pipe, optimizer, batches


def _memory_rank(overrides: list[str]) -> dict[str, int]:
    """One training step on this rank, then the bytes it holds (`held_bytes`) and the counts
    that the formulas need."""
    from hybridpar.optim import local_optimizer, owned_parameters
    from hybridpar.train.check.memory import held_bytes, tensor_bytes

    config, pipe, optimizer, batches = _setup(overrides)
    x, y = batches.next_batch()
    optimizer.zero_grad(set_to_none=True)
    with _autocast(config):
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
               masters=tensor_bytes(optimizer.copies() if hasattr(optimizer, "copies") else []),
               step_counts=tensor_bytes(v for s in state for k, v in s.items() if k == "step"))
    pipe.close()
    return out


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak_rank(overrides: list[str], warm_up: list[str]) -> int:
    """This rank's peak resident set above its baseline over build, optimizer and two steps
    (as tests/test_check_memory.py measures it: glibc's mmap threshold fixed at 128 KiB, one
    step of a tiny model first, ``/proc/self/clear_refs`` = 5 to reset VmHWM)."""
    import ctypes
    import ctypes.util

    from hybridpar.train import load_config
    from hybridpar.train.build import build_optimizer
    from hybridpar.train.data import make_batches
    from hybridpar.train.trainer import build_pipe

    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(M_MMAP_THRESHOLD, 128 << 10)
    par = load_config(QUICKSTART, overrides).parallel
    topo = hybridpar.init(pp=par.pp, tp=par.tp, dp=par.dp, timeout=par.timeout)
    peak = 0
    for extra in (warm_up, []):
        config = load_config(QUICKSTART, [*overrides, *extra])
        x, y = make_batches(config, split="train", dp_rank=topo.dp_rank,
                            dp=topo.dp).next_batch()
        Path("/proc/self/clear_refs").write_text("5")    # VmHWM := VmRSS
        before = _status("VmRSS")
        pipe = build_pipe(config, topo)
        optimizer = build_optimizer(pipe, config)
        for _ in range(2):
            optimizer.zero_grad(set_to_none=True)
            with _autocast(config):
                pipe.train_step(x, y)
            pipe.clip_grad_norm_(config.train.grad_clip or float("inf"))
            optimizer.step()
        peak = _status("VmHWM") - before
        pipe.close()
        del pipe, optimizer
    return peak


def peaks(dp: int, zeros: list[int], dtype: str, model: list[str], repeats: int
          ) -> list[dict[str, Any]]:
    """Per zero level: the worst rank's peak above its baseline, median of `repeats` spawns
    (the levels in turn, the order swapped every other repeat), and its ratio to zero 0's."""
    samples: dict[int, list[float]] = {z: [] for z in zeros}
    for i in range(repeats):
        for zero in zeros if i % 2 == 0 else zeros[::-1]:
            ranks = hybridpar.spawn(_peak_rank, dp, timeout=600, args=(
                _overrides(dp, zero, dtype, model), PEAK_WARM_UP))
            samples[zero].append(max(ranks) / 2**20)
    rows = [{"dp": dp, "zero": z, "param_dtype": dtype, "peak_mib": spread(samples[z]),
             "samples_mib": samples[z]} for z in zeros]
    if 0 in samples:
        for r in rows:
            r["ratio"] = r["peak_mib"]["median"] / rows[zeros.index(0)]["peak_mib"]["median"]
    return rows


def _formula(dp: int, zero: int, dtype: str) -> tuple[float, str]:
    """The bytes per parameter the issue's formulas give, and how they read."""
    weights, state = (4, 8) if dtype == "fp32" else (2, 12)
    shards = dp if zero else 1
    grads = 4 / dp if zero == 2 else 4
    total = weights + grads + state / shards
    where = " (buckets)" if dp > 1 or dtype != "fp32" else ""
    per = f"/{dp}" if shards > 1 else ""
    text = f"{weights} + 4{per if zero == 2 else ''}{where} + {state}{per} = {total:g}"
    return total, text


def memory(dps: list[int], zeros: list[int], dtypes: list[str], model: list[str]
           ) -> list[dict[str, Any]]:
    rows = []
    for dtype in dtypes:
        rows += [_memory_row(dp, zero, dtype, model) for dp in dps for zero in zeros]
    return rows


def _memory_row(dp: int, zero: int, dtype: str, model: list[str]) -> dict[str, Any]:
    """One (dp, zero, param dtype): every rank's bytes after one step, the worst rank's per
    parameter."""
    ranks = hybridpar.spawn(_memory_rank, dp, args=(_overrides(dp, zero, dtype, model),),
                            timeout=600)
    for r in ranks:
        r["total"] = sum(r[k] for k in COLUMNS)
    n = ranks[0]["n_params"]
    worst = max(range(dp), key=lambda i: ranks[i]["total"])
    formula, text = _formula(dp, zero, dtype)
    return {
        "dp": dp, "zero": zero, "param_dtype": dtype, "n_params": n,
        "n_tensors": ranks[0]["n_tensors"], "ranks": ranks, "worst_rank": worst,
        "per_param": {k: ranks[worst][k] / n
                      for k in (*COLUMNS, "moments", "masters", "step_counts", "total")},
        "total_per_param": spread([r["total"] / n for r in ranks]),
        "formula": formula, "formula_text": text,
    }


def _time_rank(overrides: list[str], warmup: int, steps: int) -> dict[str, Any]:
    """`steps` timed training steps after `warmup` (the slowest rank's median step)."""
    from bench.common import timed_round_robin

    config, pipe, optimizer, batches = _setup(overrides)
    autocast = _autocast(config)

    def step() -> None:
        x, y = batches.next_batch()
        optimizer.zero_grad(set_to_none=True)
        with autocast:
            pipe.train_step(x, y)
        pipe.clip_grad_norm_(1.0)
        optimizer.step()

    timed = timed_round_robin({"step": step}, warmup=warmup, iters=steps, repeats=1)["step"]
    pipe.close()
    return {"step_s": timed["median"]}


def step_time(dp: int, dtype: str, model: list[str], *, warmup: int, steps: int,
              repeats: int) -> dict[str, Any]:
    samples: dict[int, list[float]] = {0: [], 1: [], 2: []}
    for i in range(repeats):
        for zero in (0, 1, 2) if i % 2 == 0 else (2, 1, 0):
            ranks = hybridpar.spawn(_time_rank, dp, args=(_overrides(dp, zero, dtype, model),
                                                          warmup, steps), timeout=600)
            samples[zero].append(ranks[0]["step_s"])   # the slowest rank's, on every rank
    ratios = {z: [t / t0 for t0, t in zip(samples[0], samples[z])] for z in (1, 2)}
    return {"dp": dp, "param_dtype": dtype, "warmup": warmup, "steps": steps,
            "repeats": repeats, "zero0_s": spread(samples[0]), "zero1_s": spread(samples[1]),
            "zero2_s": spread(samples[2]), "ratio": spread(ratios[1]),
            "ratio2": spread(ratios[2])}


def memory_table(rows: list[dict[str, Any]]) -> str:
    def b(v: float) -> str:
        return f"{v:.3f}"

    return markdown_table(
        ["weights", "dp", "zero", "params", "grads", "buckets", "optimizer",
         "total (worst rank)", "formula", "step counts", "ranks' totals (min–max)", "spread"],
        [[r["param_dtype"], r["dp"], r["zero"], *(b(r["per_param"][k]) for k in COLUMNS),
          f"**{b(r['per_param']['total'])}**", r["formula_text"],
          f"+{r['per_param']['step_counts']:.4f}",
          f"{b(r['total_per_param']['min'])}–{b(r['total_per_param']['max'])}",
          f"{r['total_per_param']['spread_pct']:.1f}%"] for r in rows])


def peak_table(rows: list[dict[str, Any]]) -> str:
    return markdown_table(
        ["weights", "dp", "zero", "peak above baseline (MiB, worst rank)", "/ zero 0",
         "repeats"],
        [[r["param_dtype"], r["dp"], r["zero"], fmt(r["peak_mib"], 1, 0),
          f"{r['ratio']:.2f}" if "ratio" in r else "", len(r["samples_mib"])] for r in rows])


def time_table(times: list[dict[str, Any]]) -> str:
    return markdown_table(
        ["weights", "dp", "zero 0 (ms / step)", "zero 1 (ms / step)", "zero 2 (ms / step)",
         "zero 1 / zero 0", "zero 2 / zero 0", "repeats"],
        [[t["param_dtype"], t["dp"], fmt(t["zero0_s"], 1e3), fmt(t["zero1_s"], 1e3),
          fmt(t["zero2_s"], 1e3), fmt(t["ratio"], 1, 3), fmt(t["ratio2"], 1, 3), t["repeats"]]
         for t in times])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, nargs="+", default=[1, 2, 4], help="memory rows' dp")
    p.add_argument("--zero", type=int, nargs="+", default=[0, 1, 2], choices=[0, 1, 2])
    p.add_argument("--param-dtype", nargs="+", default=["fp32", "bf16"],
                   choices=["fp32", "bf16"], help="train.param_dtype of the rows and times")
    p.add_argument("--time-dp", type=int, default=2, help="dp of the step-time comparison")
    p.add_argument("--time-param-dtype", nargs="+", choices=["fp32", "bf16"],
                   help="param dtypes of the step-time comparison (default: --param-dtype)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per spawn")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per spawn")
    p.add_argument("--repeats", type=int, default=3, help="spawns of each zero, alternating")
    p.add_argument("--peak-dp", type=int, default=4, help="dp of the peak rows (0: none)")
    p.add_argument("--peak-repeats", type=int, default=3, help="spawns of each zero's peak")
    p.add_argument("--out", default="results/bench_zero.json")
    p.add_argument("--smoke", action="store_true",
                   help="a tiny model, 1 repeat, few steps: checks the script, not speed")
    args = p.parse_args(argv)
    model: list[str] = []
    peak_model = PEAK_MODEL
    if args.smoke:
        model = peak_model = SMOKE_MODEL
        args.steps, args.warmup, args.repeats, args.peak_repeats = 3, 1, 1, 1
    started, load_before = time.perf_counter(), load()
    rows = memory(args.dp, args.zero, args.param_dtype, model)
    timing = [step_time(args.time_dp, dtype, model, warmup=args.warmup, steps=args.steps,
                        repeats=args.repeats)
              for dtype in args.time_param_dtype or args.param_dtype]
    peak_rows = peaks(args.peak_dp, args.zero, "fp32", peak_model, args.peak_repeats) \
        if args.peak_dp else []
    result = {"memory": rows, "step_time": timing, "peak": peak_rows,
              "peak_model_overrides": peak_model, "model_overrides": model,
              "config": str(QUICKSTART.relative_to(ROOT)), "smoke": args.smoke,
              "machine": machine(), "load_before": load_before, "load_after": load(),
              "seconds": round(time.perf_counter() - started, 1)}
    n = rows[0]["n_params"]
    print(f"bytes per trainable parameter per rank ({n:,} parameters, "
          f"{rows[0]['n_tensors']} tensors), after one step:\n")
    print(memory_table(rows))
    print(f"\nstep time at dp = {args.time_dp} (median of {args.steps} steps per spawn, "
          f"median of {args.repeats} spawns each, ± half the range):\n")
    print(time_table(timing))
    if peak_rows:
        print(f"\npeak resident set per rank above its baseline, fp32 weights, "
              f"{' '.join(peak_model)} (median of {args.peak_repeats} spawns):\n")
        print(peak_table(peak_rows))
    print(f"\n{machine_line(result)}")
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
