"""Fault campaign: SIGKILL a worker of `hybridpar run --max-restarts 1`, N times; nothing lost?

    python scripts/kill_test.py [--trials 10] [--out results/kill_test.json]

One uninterrupted reference run, then `--trials` runs of the same config, each with one
worker killed (SIGKILL) at a random moment after its first checkpoint. A trial succeeds when
the elastic agent restarted the job, it resumed from a checkpoint, it finished with exit code
0, and its per-step losses and final weights equal the reference run's exactly (dropout is
on, so the RNG state must come back too). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hybridpar.train.launcher import worker_pids
from hybridpar.train.metrics import read_metrics

CONFIG = """# the kill campaign's model: a small GPT on 2 stages x 2 tp ranks
[model]
name = "gpt"
n_layer = 2
n_head = 2
n_embd = 32
block_size = 32
dropout = 0.1

[data]
source = "corpus"

[parallel]
pp = 2
tp = 2
chunks = 2

[train]
steps = 30
batch_size = 8
lr = 3e-3
log_every = 1
sample_tokens = 0

[checkpoint]
every = 5
keep = 2
"""


def _last_step(metrics: Path) -> int:
    """The last step logged in `metrics` (0: none yet)."""
    records = read_metrics(metrics)
    return int(records[-1]["step"]) if records else 0


def _run(config: Path, run_dir: Path, *, kill: bool, seed: int) -> dict[str, Any]:
    """One `hybridpar run`; with `kill`, SIGKILL a random worker at a random time."""
    cmd = [sys.executable, "-m", "hybridpar.cli", "run", str(config), "--run-dir",
           str(run_dir), "--max-restarts", "1"]
    began = time.monotonic()
    log = open(run_dir.with_suffix(".log"), "w+")   # a file: a full pipe would block the run
    agent = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    killed = None
    if kill:
        # A random moment after the first checkpoint (step 5) and before the end (step 30):
        # once the run has logged a random step, then a random part of a step (~70 ms). The
        # moment is counted in steps, not seconds, so a faster run is still killed mid-way.
        rng = random.Random(seed)
        target, metrics = rng.randint(6, 27), run_dir / "metrics.jsonl"
        while _last_step(metrics) < target and agent.poll() is None:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.07))
        workers = worker_pids(run_dir)
        if workers and agent.poll() is None:
            killed = rng.choice(workers)
            os.kill(killed, signal.SIGKILL)
    agent.wait(timeout=600)
    log.seek(0)
    output = log.read()
    log.close()
    records = read_metrics(run_dir / "metrics.jsonl")
    return {"rc": agent.returncode, "output": output, "killed": killed,
            "seconds": time.monotonic() - began,
            "losses": {r["step"]: r["loss"] for r in records}}


def _weights(run_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    subprocess.run([sys.executable, "-m", "hybridpar.cli", "export",
                    str(run_dir / "checkpoints" / "step-30"), str(out)], check=True,
                   capture_output=True)
    return torch.load(out, weights_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--out", default="results/kill_test.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = root / "kill.toml"
        config.write_text(CONFIG)
        reference = _run(config, root / "reference", kill=False, seed=0)
        assert reference["rc"] == 0, reference["output"]
        ref_weights = _weights(root / "reference", root / "reference.pt")
        rows = []
        print(f"{'trial':>5}  {'killed':>7}  {'restarted':>9}  {'losses':>6}  {'weights':>7}  "
              f"{'seconds':>7}  ok")
        for trial in range(args.trials):
            run_dir = root / f"trial-{trial}"
            result = _run(config, run_dir, kill=True, seed=trial)
            restarted = "resumed from" in result["output"]
            same_losses = result["losses"] == reference["losses"]
            same_weights = result["rc"] == 0 and all(
                torch.equal(a, ref_weights[k])
                for k, a in _weights(run_dir, root / f"{trial}.pt").items())
            ok = result["rc"] == 0 and result["killed"] is not None and restarted \
                and same_losses and same_weights
            rows.append({"trial": trial, "killed_pid": result["killed"], "rc": result["rc"],
                         "restarted": restarted, "same_losses": same_losses,
                         "same_weights": same_weights, "seconds": round(result["seconds"], 1),
                         "ok": ok})
            print(f"{trial:>5}  {result['killed']!s:>7}  {restarted!s:>9}  "
                  f"{same_losses!s:>6}  {same_weights!s:>7}  {result['seconds']:>7.1f}  "
                  f"{'yes' if ok else 'NO'}", flush=True)
            if not ok:
                print(result["output"][-3000:])
    successes = sum(r["ok"] for r in rows)
    print(f"\n{successes}/{args.trials} trials recovered with identical losses and weights")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"successes": successes, "trials": args.trials,
                                          "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
