"""Benchmark TPDense: synchronous vs ring-overlapped (async_comm) forward + backward.

    python scripts/bench_tpdense.py [--tp 2 4] [--tokens 2048] [--in-features 512]
        [--out-features 512] [--repeats 5] [--iters 8] [--out results/bench_tpdense.json]

For each tp and mode (gather, scatter) it times one forward + backward of the layer, median
of `repeats` runs of `iters` steps each (every run the slowest rank's time):

    column   what runs
    sync     TPDense(async_comm=False): all-gather / reduce-scatter, then the matmuls
    async    TPDense(async_comm=True, bidirectional=True): ring hops under the matmuls
    comp     the same matmuls with no communication (skip_communication=True)
    comm     the async layer's ring hops alone (no matmuls)
    overlap  (comp + comm - async) / min(comp, comm): 1 = the shorter one fully hidden,
             0 = none hidden, < 0 = the overlapped layer is slower than the sum

CPU runs use gloo with one thread per rank; CUDA runs (NCCL, one GPU per rank) are added when
at least tp GPUs are visible. Prints a table and writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from bench.common import cpu_name  # scripts/ is on sys.path when run as a script

import hybridpar
from hybridpar.nn import TPDense
from hybridpar.tensor_parallel.feature.ring import (
    gather_chains,
    ring_pass,
    ring_reduce,
    scatter_chains,
)


def _timed(steps: dict[str, Callable[[], None]], *, repeats: int, iters: int,
           device: torch.device) -> dict[str, float]:
    """Median over `repeats` of the slowest rank's seconds per step, for each of `steps`.

    The steps take turns within each repeat (round robin), so a slow spell of the machine
    hits them all alike; each is warmed up once first.
    """
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for step in steps.values():
        step()
    sync()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            sync()
            elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64,
                                   device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    return {name: statistics.median(ts) for name, ts in times.items()}


def _layer_step(layer: TPDense, x: torch.Tensor, g: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer(x).backward(g)
    return step


def _comm_step(mode: str, x: torch.Tensor, g: torch.Tensor,
               group: dist.ProcessGroup) -> Callable[[], None]:
    """The async layer's ring hops with the matmuls left out (same bytes, same schedule)."""
    n = dist.get_world_size(group)

    def step() -> None:
        if mode == "gather":  # forward: gather x blocks; backward: scatter-sum dx blocks
            for _ in ring_pass(gather_chains(x, n, variant="bidirectional"), group):
                pass
            ring_reduce(lambda d, a, b: x[..., a:b],
                        scatter_chains(x.shape[-1], bidirectional=True), group)
        else:  # forward: scatter-sum output blocks; backward: gather dy blocks
            ring_reduce(lambda d, a, b: g[..., a:b],
                        scatter_chains(g.shape[-1], bidirectional=True), group)
            for _ in ring_pass(gather_chains(g, n, variant="bidirectional"), group):
                pass
    return step


def _worker(tp: int, args: dict, backend: str) -> list[dict]:
    topo = hybridpar.init(tp=tp, timeout=120)
    group, rank = topo.tp_group, topo.tp_rank
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else \
        torch.device("cpu")
    tokens, fin, fout = args["tokens"], args["in_features"], args["out_features"]
    timing = {"repeats": args["repeats"], "iters": args["iters"], "device": device}
    gen = torch.Generator().manual_seed(0)
    x_full = torch.randn(tokens, fin, generator=gen).to(device)                 # (N, in)
    g_full = torch.randn(tokens, fout, generator=gen).to(device)                # (N, out)
    x = x_full.chunk(tp, dim=-1)[rank].contiguous().requires_grad_()            # (N, in / tp)
    g = g_full.chunk(tp, dim=-1)[rank].contiguous()                             # (N, out / tp)
    rows = []
    for mode in ("gather", "scatter"):
        def make(mode: str = mode, **kw: bool) -> TPDense:
            torch.manual_seed(0)
            return TPDense(fin, fout, mode=mode, group=group, device=device, **kw)

        if mode == "gather":  # the input comes full, the same matmuls
            comp = _layer_step(make(skip_communication=True), x_full.clone().requires_grad_(), g)
        else:  # the output stays the (N, out) partial; its gradient is the full dy
            comp = _layer_step(make(skip_communication=True), x, g_full)
        t = _timed({"sync": _layer_step(make(), x, g),
                    "async": _layer_step(make(async_comm=True), x, g),
                    "comp": comp,
                    "comm": _comm_step(mode, x.detach(), g, group)}, **timing)
        t_sync, t_async, t_comp, t_comm = t["sync"], t["async"], t["comp"], t["comm"]
        overlap = (t_comp + t_comm - t_async) / min(t_comp, t_comm)
        rows.append({"backend": backend, "tp": tp, "mode": mode, "tokens": tokens,
                     "in_features": fin, "out_features": fout, "sync_ms": 1e3 * t_sync,
                     "async_ms": 1e3 * t_async, "comp_ms": 1e3 * t_comp,
                     "comm_ms": 1e3 * t_comm, "speedup": t_sync / t_async,
                     "overlap": overlap})
    return rows if rank == 0 else []


def _table(rows: list[dict]) -> str:
    head = (f"{'backend':7} {'tp':>2} {'mode':7} {'sync ms':>8} {'async ms':>8} "
            f"{'comp ms':>8} {'comm ms':>8} {'sync/async':>10} {'overlap':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['backend']:7} {r['tp']:>2} {r['mode']:7} {r['sync_ms']:8.2f} "
                     f"{r['async_ms']:8.2f} {r['comp_ms']:8.2f} {r['comm_ms']:8.2f} "
                     f"{r['speedup']:10.2f} {r['overlap']:7.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--in-features", type=int, default=512)
    parser.add_argument("--out-features", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--out", default="results/bench_tpdense.json")
    parser.add_argument("--no-cuda", action="store_true", help="skip the NCCL runs")
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be at least 3 (the median of 3 or more runs)")
    cfg = {k: getattr(args, k) for k in ("tokens", "in_features", "out_features", "repeats",
                                         "iters")}
    backends = ["gloo"]
    if not args.no_cuda and torch.cuda.is_available():
        backends.append("nccl")
    rows: list[dict] = []
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    for backend in backends:
        for tp in args.tp:
            if backend == "nccl" and torch.cuda.device_count() < tp:
                print(f"skipping nccl tp={tp}: {torch.cuda.device_count()} GPU(s) visible")
                continue
            per_rank = hybridpar.spawn(_worker, tp, args=(tp, cfg, backend), backend=backend,
                                       timeout=600)
            rows.extend(per_rank[0])
    print(_table(rows))
    machine = {"platform": platform.platform(), "processor": cpu_name(),
               "cpus": os.cpu_count(), "torch": torch.__version__,
               "load_average_1m": [load_before, os.getloadavg()[0]],  # before, after
               "gpus": [torch.cuda.get_device_name(i)
                        for i in range(torch.cuda.device_count())]}
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": machine, "config": cfg, "seconds": time.perf_counter() - start,
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} ({result['seconds']:.0f} s; 1-minute load average "
          f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} "
          f"CPUs)")


if __name__ == "__main__":
    main()
