"""What a 20 ms sleep costs the code after it: the ceiling of benchmark 1 on this machine.

    python scripts/wakeup_latency.py [--sleep-ms 20] [--rounds 30] [--out DIR]

Two measurements, each a median over `--rounds`:

    op after sleep   a stage's tiny compute (``y = x * w``, its backward) timed right after a
                     sleep of 0, 1, 5 and --sleep-ms ms: an idle vCPU wakes up slowly, and
                     every compute of benchmark 1's stages follows such a sleep
    hop              two gloo ranks: rank 1 waits in a posted receive while rank 0 sleeps
                     --sleep-ms, then sends 8 bytes; the time from the send's start to the
                     receive's return (one clock: both ranks are on this machine)

Writes DIR/wakeup_latency.json (default DIR: runs/wakeup_latency).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from bench.common import markdown_table, write_json

import hybridpar

SLEEPS_MS = (0.0, 1.0, 5.0)


def op_after_sleep_us(sleep_ms: float, rounds: int) -> float:
    """The median time of a tiny forward + backward right after sleeping `sleep_ms`, µs."""
    w = torch.ones(1, requires_grad=True)
    x = torch.randn(2, 16, 64)
    times = []
    for _ in range(rounds):
        if sleep_ms:
            time.sleep(sleep_ms / 1e3)
        start = time.perf_counter()
        (x * w).sum().backward()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def hop(sleep_ms: float, rounds: int) -> float:
    """The spawn target: rank 0 sleeps and sends, rank 1 waits; rank 1 returns the median
    from the send's start to its receive's return, µs (rank 0 returns 0)."""
    hybridpar.init(timeout=60)
    sent = torch.zeros(1, dtype=torch.int64)
    times = []
    for _ in range(rounds):
        dist.barrier()
        if dist.get_rank() == 0:
            time.sleep(sleep_ms / 1e3)
            dist.send(torch.tensor([time.perf_counter_ns()]), dst=1)
        else:
            dist.recv(sent, src=0)
            times.append((time.perf_counter_ns() - int(sent.item())) / 1e3)
    return statistics.median(times) if times else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sleep-ms", type=float, default=20.0, help="benchmark 1's T_F")
    parser.add_argument("--rounds", type=int, default=30, help="samples per median")
    parser.add_argument("--out", default="runs/wakeup_latency", help="folder for the results")
    args = parser.parse_args(argv)
    if args.sleep_ms <= 0 or args.rounds < 1:
        parser.error("--sleep-ms must be > 0 and --rounds >= 1")
    torch.set_num_threads(1)
    sleeps = (*SLEEPS_MS, args.sleep_ms)
    ops = {ms: op_after_sleep_us(ms, args.rounds) for ms in sleeps}
    hop_us = hybridpar.spawn(hop, 2, args=(args.sleep_ms, args.rounds), timeout=300)[1]
    rows = [[f"op after a {ms:g} ms sleep", f"{us:.0f}"] for ms, us in ops.items()]
    rows.append([f"gloo hop after a {args.sleep_ms:g} ms sleep", f"{hop_us:.0f}"])
    print(markdown_table(["what", "median µs"], rows))
    result: dict[str, Any] = {"op_after_sleep_us": {str(k): v for k, v in ops.items()},
                              "hop_us": hop_us, "sleep_ms": args.sleep_ms,
                              "rounds": args.rounds}
    path = write_json(Path(args.out) / "wakeup_latency.json", result)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
