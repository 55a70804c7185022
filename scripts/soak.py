"""Soak test: thousands of steps of a small model; does memory grow or the step time drift?

    python scripts/soak.py [--steps 2000] [--out results/soak.json]

Runs `hybridpar run` on a small GPT (pp=2 x tp=2, 4 workers, checkpoints every 250 steps)
and samples every worker's resident memory (VmRSS from /proc) once a second. Reports the RSS
of each worker after warm-up (the first 10% of the steps) and at the end, the growth in
percent (target: under 5%), and the median step time of each tenth of the run from
metrics.jsonl (stable: last tenth within 10% of the second). Prints a table; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybridpar.train.launcher import worker_pids
from hybridpar.train.metrics import read_metrics

CONFIG = """# the soak model: a small GPT, 2 stages x 2 tp ranks
[model]
name = "gpt"
n_layer = 2
n_head = 2
n_embd = 32
block_size = 32

[data]
source = "corpus"

[parallel]
pp = 2
tp = 2
chunks = 2

[train]
steps = {steps}
batch_size = 8
lr = 1e-3
log_every = 1
eval_every = 500
sample_tokens = 0

[checkpoint]
every = 250
keep = 2
"""


def _rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out", default="results/soak.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config, run_dir = Path(tmp) / "soak.toml", Path(tmp) / "run"
        config.write_text(CONFIG.format(steps=args.steps))
        began = time.monotonic()
        log = open(Path(tmp) / "run.log", "w+")   # a file: a full pipe would block the run
        agent = subprocess.Popen([sys.executable, "-m", "hybridpar.cli", "run", str(config),
                                  "--run-dir", str(run_dir)], stdout=log, stderr=log, text=True)
        samples: list[tuple[int, dict[int, int]]] = []   # (last logged step, {pid: KiB})
        metrics = run_dir / "metrics.jsonl"
        while agent.poll() is None:
            time.sleep(1.0)
            logged = read_metrics(metrics)   # drops a line still being written
            step = logged[-1]["step"] if logged else 0
            rss = {pid: kib for pid in worker_pids(run_dir) if (kib := _rss_kib(pid))}
            if rss:
                samples.append((step, rss))
        log.seek(0)
        output = log.read()
        log.close()
        if agent.returncode != 0:
            sys.exit(f"the soak run failed:\n{output[-3000:]}")
        records = read_metrics(metrics)
    wall = time.monotonic() - began
    warm = [s for s in samples if s[0] >= args.steps // 10]
    first, last = warm[0][1], warm[-1][1]
    growth = {pid: 100.0 * (last[pid] - first[pid]) / first[pid] for pid in first if pid in last}
    tenth = max(1, args.steps // 10)
    times = [statistics.median(r["step_time"] for r in records
                               if i * tenth < r["step"] <= (i + 1) * tenth and "step_time" in r)
             for i in range(10)]
    print(f"{args.steps} steps in {wall:.0f} s; worker RSS after warm-up -> at the end:")
    print(f"{'pid':>8}  {'start MiB':>9}  {'end MiB':>8}  {'growth %':>8}")
    for pid, pct in growth.items():
        print(f"{pid:>8}  {first[pid] / 1024:>9.1f}  {last[pid] / 1024:>8.1f}  {pct:>8.2f}")
    print("median step time (ms) per tenth of the run: "
          + " ".join(f"{t * 1e3:.1f}" for t in times))
    drift = 100.0 * (times[-1] - times[1]) / times[1]
    worst = max(growth.values())
    print(f"max RSS growth {worst:.2f}% (target < 5%); step time drift {drift:+.1f}% "
          "(last tenth vs second)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "steps": args.steps, "wall_s": wall, "rss_growth_pct": growth, "max_growth_pct": worst,
        "rss_start_kib": first, "rss_end_kib": last, "step_time_per_tenth_s": times,
        "step_time_drift_pct": drift}, indent=2) + "\n")


if __name__ == "__main__":
    main()
