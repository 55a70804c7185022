"""Where a micro-batched step's time goes on one device: the pipe against a plain loop.

    python scripts/gpu_microbatch.py [--config TOML] [--batch B] [--chunks M[,M...]]
                                     [--dropout P] [--device cuda|cpu] [--tiny]
                                     [--no-profile] [--out DIR]

One rank (nccl on cuda, gloo on cpu), the config's GPT (default: configs/gpt_large_gpu.toml
with dropout 0, so attention runs in `scaled_dot_product_attention`), bf16 autocast. Times,
each the median of 10 after 3 warm-ups, synchronised, for each M of --chunks:

    whole batch        the plain model, forward + backward of the whole batch at once
    plain loop         the plain model, forward + backward of each of M micro-batches
                       (the peer: what any micro-batched trainer does on one device)
    plain loop fwd     the same, forward only under no_grad
    pipe               the one-stage `HybridPipe` train_step of the same batch, 1F1B,
                       checkpoint 'never'
    host time          the time the pipe step / the plain loop takes to return without a
                       synchronisation: when it is about the synchronised time, the host
                       (Python and kernel launches), not the device, sets the pace

then a `torch.profiler` table of two pipe steps of the last M (by device time and by host
time; not with --no-profile). Writes
DIR/gpu_microbatch.json and DIR/gpu_microbatch_profile.txt (default DIR:
runs/gpu_microbatch). --tiny: a 4-layer, 32-wide GPT (the CPU smoke test).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench.common import markdown_table, write_json

import hybridpar
from hybridpar.models.gpt import gpt, gpt_loss

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "gpt_large_gpu.toml"
TINY = {"block_size": 32, "n_layer": 4, "n_head": 4, "n_embd": 32}
WARMUP, ITERS = 3, 10


def _median_ms(step: Callable[[], None], sync: Callable[[], None]) -> float:
    """The median of ITERS synchronised runs of `step` after WARMUP, in ms."""
    times = []
    for i in range(WARMUP + ITERS):
        sync()
        start = time.perf_counter()
        step()
        sync()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _host_ms(step: Callable[[], None], sync: Callable[[], None]) -> float:
    """How long `step` takes to return when the device is not waited for, in ms."""
    sync()
    start = time.perf_counter()
    step()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed * 1e3


def measure(model_cfg: dict[str, Any], batch: int, chunk_counts: list[int], out: str,
            profile_steps: bool) -> dict[str, Any]:
    """The spawn target: every time above for each micro-batch count, and the profile of
    the last count's pipe, on this rank's device."""
    topo = hybridpar.init()
    device = topo.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    with device:   # built on the device: a 300 M model initialises in seconds there
        model = gpt(**model_cfg)
    x = torch.randint(0, model_cfg["vocab_size"], (batch, model_cfg["block_size"]), device=device)
    y = torch.randint(0, model_cfg["vocab_size"], (batch, model_cfg["block_size"]), device=device)

    def bf16() -> torch.autocast:
        return torch.autocast(device.type, dtype=torch.bfloat16)

    def whole() -> None:
        with bf16():
            loss = gpt_loss(model(x), y)
        loss.backward()

    rows = []
    for chunks in chunk_counts:
        def plain_loop(chunks: int = chunks) -> None:
            for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
                with bf16():
                    loss = gpt_loss(model(xs), ys)
                loss.backward()

        def plain_forward(chunks: int = chunks) -> None:
            with torch.no_grad(), bf16():
                for xs in x.chunk(chunks):
                    model(xs)

        with device:
            stages = gpt(**model_cfg)
        pipe = hybridpar.HybridPipe(stages, [model_cfg["n_layer"] + 3],
                                    chunks=chunks, topology=topo, schedule="1f1b",
                                    checkpoint="never", loss_fn=gpt_loss)

        def pipe_step(pipe: hybridpar.HybridPipe = pipe) -> None:
            with bf16():
                pipe.train_step(x, y)

        rows.append({"chunks": chunks, "plain_loop_ms": _median_ms(plain_loop, sync),
                     "plain_loop_fwd_ms": _median_ms(plain_forward, sync),
                     "pipe_ms": _median_ms(pipe_step, sync),
                     "pipe_host_ms": _host_ms(pipe_step, sync),
                     "plain_loop_host_ms": _host_ms(plain_loop, sync)})
    if profile_steps:
        from torch.profiler import ProfilerActivity, profile
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA]
                                               if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(2):
                pipe_step()
            sync()
        averages = prof.key_averages()
        by_device = averages.table(sort_by="cuda_time_total" if device.type == "cuda"
                                   else "cpu_time_total", row_limit=25, max_name_column_width=60)
        by_host = averages.table(sort_by="self_cpu_time_total", row_limit=25,
                                 max_name_column_width=60)
        Path(out, "gpu_microbatch_profile.txt").write_text(
            f"two pipe steps of {chunk_counts[-1]} micro-batches\n\nby device time\n"
            f"{by_device}\n\nby host time\n{by_host}\n")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"whole_batch_ms": _median_ms(whole, sync), "rows": rows, "device": name,
            "torch": str(torch.__version__)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="the model (a TOML)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--chunks", default="8",
                        help="micro-batches per step, or several: 1,2,4,8")
    parser.add_argument("--no-profile", action="store_true", help="skip the profiler tables")
    parser.add_argument("--dropout", type=float, default=0.0, help="the model's dropout")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda when there is one")
    parser.add_argument("--tiny", action="store_true", help="a 4-layer, 32-wide GPT")
    parser.add_argument("--out", default="runs/gpu_microbatch", help="folder for the results")
    args = parser.parse_args(argv)
    try:
        args.chunks = [int(c) for c in str(args.chunks).split(",")]
    except ValueError:
        parser.error(f"--chunks must be integers separated by commas, got {args.chunks!r}")
    for chunks in args.chunks:
        if args.batch < 1 or chunks < 1 or args.batch % chunks:
            parser.error(f"--batch ({args.batch}) must be a positive multiple of --chunks "
                         f"({chunks})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here; use --device cpu", file=sys.stderr)
        return 2
    with open(args.config, "rb") as f:
        model_cfg = {k: v for k, v in tomllib.load(f)["model"].items() if k != "name"}
    model_cfg["dropout"] = args.dropout
    if args.tiny:
        model_cfg.update(TINY)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    backend = "nccl" if device == "cuda" else "gloo"
    (result,) = hybridpar.spawn(measure, 1, args=(model_cfg, args.batch, args.chunks, str(out),
                                                  not args.no_profile),
                                backend=backend, timeout=600,
                                threads=4 if backend == "nccl" else 1)
    whole = result["whole_batch_ms"]
    rows = [[r["chunks"], args.batch // r["chunks"], f"{r['plain_loop_ms']:.2f}",
             f"{r['plain_loop_fwd_ms']:.2f}", f"{r['pipe_ms']:.2f}",
             f"{r['pipe_ms'] / r['plain_loop_ms']:.3f}", f"{r['pipe_host_ms']:.2f}",
             f"{r['plain_loop_host_ms']:.2f}", f"{r['pipe_ms'] / whole:.2f}"]
            for r in result["rows"]]
    print(f"{result['device']} · torch {result['torch']} · batch {args.batch} · "
          f"{model_cfg['n_layer']} layers × {model_cfg['n_embd']} · dropout {args.dropout:g}; "
          f"whole batch at once: {whole:.2f} ms\n")
    print(markdown_table(["micro-batches", "sequences each", "plain loop ms", "plain loop fwd ms",
                          "pipe ms", "pipe ÷ plain loop", "pipe host ms", "plain loop host ms",
                          "pipe ÷ whole batch"], rows))
    write_json(out / "gpu_microbatch.json", {**result, "model": model_cfg, "batch": args.batch,
                                              "backend": backend})
    written = [out / "gpu_microbatch.json"] + ([] if args.no_profile
                                               else [out / "gpu_microbatch_profile.txt"])
    print("\nwrote " + " and ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
