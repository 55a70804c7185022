"""The MoE GPT at ep 1, 2, 4: tokens/s, peak memory per rank, dispatch against expert compute.

    python scripts/bench_moe.py [--ep 1 2 4] [--dp 4] [--experts 8] [--steps 20] [--warmup 3]
        [--repeats 3] [--out results/bench_moe.json] [--smoke]

The model: the quick-start GPT (configs/quickstart.toml: n_embd 64, 4 layers, block 64, batch
16) with `--experts` experts of top-2 in every block, at pp = 1, tp = 1, dp = `--dp` CPU gloo
ranks (`hybridpar.spawn`, one torch thread each), built as `hybridpar run` builds it
(`build_pipe`, `build_optimizer`), at each ep of `--ep` (carved out of dp: each rank holds
experts / ep of each block's experts).

Each repeat spawns the ep values in turn (the order reversed every other repeat); a spawn runs
`warmup` steps, then `steps` timed steps (zero_grad, batch, train_step, clip, update), each
between two barriers, and reports:

    column        what
    tokens/s      the global batch's tokens / the median step of the slowest rank
    peak MiB      the worst rank's resident set above its baseline (VmHWM, reset by
                  /proc/self/clear_refs), over the build and every step
    expert MiB    the bytes of the expert parameters a rank holds (exact: E / ep of them)
    a2a ms        per step, the time inside the all-to-alls (dispatch, combine, and their
                  backwards; the counts exchange too), slowest rank's median
    experts ms    per step, the time of the experts' forward (the grouped matrix multiplies)

The medians over the repeats are printed with their spread, and the ratio of each ep's
tokens/s to ep 1's in the same run. `--smoke`: a tiny model, one repeat, two steps (checks
the script, not the speed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import hybridpar

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench.common import fmt, load, machine, machine_line, markdown_table, spread, write_json

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "configs" / "quickstart.toml"
SMOKE_MODEL = ["model.n_embd=16", "model.n_layer=1", "model.n_head=2", "model.block_size=16",
               "train.batch_size=8"]


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class _Clock:
    """Seconds spent inside the wrapped functions since the last `take`."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed

    def take(self) -> float:
        out, self.seconds = self.seconds, 0.0
        return out


def _rank(overrides: list[str], warmup: int, steps: int) -> dict[str, Any]:
    """This rank's build, `warmup` steps and `steps` timed steps (see the module)."""
    import torch
    import torch.distributed as dist

    from hybridpar.moe import dispatch, experts
    from hybridpar.train import load_config
    from hybridpar.train.build import build_optimizer
    from hybridpar.train.data import make_batches
    from hybridpar.train.trainer import build_pipe

    a2a, compute = _Clock(), _Clock()   # instruments around the real calls
    dispatch._exchange = a2a.wrap(dispatch._exchange)
    experts.Experts.forward = compute.wrap(experts.Experts.forward)
    config = load_config(QUICKSTART, overrides)
    par = config.parallel
    Path("/proc/self/clear_refs").write_text("5")    # VmHWM := VmRSS
    before = _status("VmRSS")
    topo = hybridpar.init(pp=par.pp, tp=par.tp, dp=par.dp, ep=par.ep, timeout=par.timeout)
    pipe = build_pipe(config, topo)
    optimizer = build_optimizer(pipe, config)
    batches = make_batches(config, split="train", dp_rank=topo.dp_rank, dp=topo.dp)
    times, a2a_s, expert_s = [], [], []
    for i in range(warmup + steps):
        x, y = batches.next_batch()
        dist.barrier()
        a2a.take(), compute.take()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        pipe.train_step(x, y)
        pipe.clip_grad_norm_(1.0)
        optimizer.step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            a2a_s.append(a2a.take())
            expert_s.append(compute.take())
    held = sum(p.numel() * p.element_size() for n, p in pipe.named_parameters()
               if ".experts." in n)
    out = torch.tensor([statistics.median(times), statistics.median(a2a_s),
                        statistics.median(expert_s)], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)    # the slowest rank's
    pipe.close()
    return {"step_s": float(out[0]), "a2a_s": float(out[1]), "experts_s": float(out[2]),
            "peak": _status("VmHWM") - before, "expert_bytes": held,
            "tokens": config.train.batch_size * config.data.seq_len}


def run(eps: list[int], dp: int, n_experts: int, steps: int, warmup: int, repeats: int,
        model: list[str]) -> list[dict[str, Any]]:
    samples: dict[int, list[dict[str, Any]]] = {ep: [] for ep in eps}
    for i in range(repeats):
        for ep in eps if i % 2 == 0 else eps[::-1]:
            overrides = ["parallel.pp=1", "parallel.tp=1", f"parallel.dp={dp}",
                         f"parallel.ep={ep}", "parallel.chunks=1", "parallel.timeout=300",
                         f"model.n_experts={n_experts}", "model.top_k=2",
                         "train.sample_tokens=0", *model]
            ranks = hybridpar.spawn(_rank, dp, args=(overrides, warmup, steps), timeout=900)
            samples[ep].append({"step_s": ranks[0]["step_s"], "a2a_s": ranks[0]["a2a_s"],
                                "experts_s": ranks[0]["experts_s"],
                                "peak_mib": max(r["peak"] for r in ranks) / 2**20,
                                "expert_mib": ranks[0]["expert_bytes"] / 2**20,
                                "tokens": ranks[0]["tokens"]})
    rows = []
    for ep in eps:
        s = samples[ep]
        rows.append({"ep": ep, "dp": dp, "experts": n_experts,
                     "tokens_per_s": spread([x["tokens"] / x["step_s"] for x in s]),
                     "peak_mib": spread([x["peak_mib"] for x in s]),
                     "expert_mib": s[0]["expert_mib"],
                     "a2a_ms": spread([1e3 * x["a2a_s"] for x in s]),
                     "experts_ms": spread([1e3 * x["experts_s"] for x in s]),
                     "samples": s})
    base = next((r for r in rows if r["ep"] == 1), None)
    for r in rows:
        if base is not None:
            r["vs_ep1"] = r["tokens_per_s"]["median"] / base["tokens_per_s"]["median"]
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    return markdown_table(
        ["ep", "tokens/s", "vs ep 1", "peak MiB (worst rank)", "expert MiB / rank",
         "a2a ms / step", "experts fwd ms / step"],
        [[r["ep"], fmt(r["tokens_per_s"], digits=0), f"{r.get('vs_ep1', float('nan')):.2f}",
          fmt(r["peak_mib"]), f"{r['expert_mib']:.2f}", fmt(r["a2a_ms"]),
          fmt(r["experts_ms"])] for r in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "results" / "bench_moe.json"))
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    model = SMOKE_MODEL if args.smoke else []
    steps, warmup, repeats = (2, 1, 1) if args.smoke else (args.steps, args.warmup,
                                                            args.repeats)
    result: dict[str, Any] = {"load_before": load(), "machine": machine()}
    t0 = time.time()
    rows = run(args.ep, args.dp, args.experts, steps, warmup, repeats, model)
    result.update(rows=rows, load_after=load(), seconds=round(time.time() - t0),
                  smoke=args.smoke, steps=steps, warmup=warmup, repeats=repeats)
    print(f"MoE GPT, {args.experts} experts top-2, dp {args.dp} CPU ranks, median of "
          f"{repeats} spawns")
    print(table(rows))
    print(machine_line(result))
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
