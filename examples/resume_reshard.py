"""Stop a pp=2 x tp=2 run halfway, resume it under pp=1 x tp=4 and unchanged: the same losses.

    python examples/resume_reshard.py [--steps 20]

Trains configs/quickstart.toml (shortened: --steps, batch 8) on 4 CPU ranks, stops after the
checkpoint at half the steps, then resumes a copy of the run dir under pp=1 x tp=4 and the
run dir itself under the original layout. Checkpoint keys are layout-free and tp shards are
saved with their offsets, so both continue from the same weights, optimizer state and data
position: the two loss curves agree within fp32 noise (reductions run in another order).
"""

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import Any

import hybridpar
from hybridpar.train import Config, load_config
from hybridpar.train.trainer import train

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.toml"


def run(config: Config, run_dir: str, stop_at: int) -> dict[str, Any]:
    """One worker: train (resuming when `run_dir` holds a checkpoint) up to step `stop_at`."""
    summary = train(config, run_dir, stop_at=stop_at, progress=False)
    return {"start": summary["start"], "losses": summary["losses"]}


def train_on_ranks(config: Config, run_dir: Path, stop_at: int) -> tuple[int, list[float]]:
    """(steps done before, losses of the steps run) of a job of dp x pp x tp local ranks."""
    par = config.parallel
    world = (par.dp or 1) * par.pp * par.tp
    summary = hybridpar.spawn(run, world, args=(config, str(run_dir), stop_at), timeout=600)[0]
    return summary["start"], summary["losses"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20, help="total steps (stop at half)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2")
    half = args.steps // 2
    overrides = [f"train.steps={args.steps}", f"train.warmup_steps={args.steps // 4}",
                 f"checkpoint.every={half}", "train.batch_size=8", "train.eval_every=0",
                 "train.log_every=1000", "train.sample_tokens=0"]
    config = load_config(CONFIG, overrides)
    resharded = load_config(CONFIG, [*overrides, "parallel.pp=1", "parallel.tp=4"])
    with tempfile.TemporaryDirectory() as tmp:
        original, copy = Path(tmp) / "pp2_tp2", Path(tmp) / "pp1_tp4"
        _, first = train_on_ranks(config, original, stop_at=half)
        print(f"steps 1-{half} at pp=2 x tp=2: loss {first[0]:.4f} -> {first[-1]:.4f}, "
              f"saved checkpoints/step-{half}")
        shutil.copytree(original, copy)
        start_b, b = train_on_ranks(resharded, copy, stop_at=args.steps)
        start_a, a = train_on_ranks(config, original, stop_at=args.steps)
    assert start_a == start_b == half, (start_a, start_b)
    print(f"resumed from step-{half}:")
    print("step  pp=2 x tp=2  pp=1 x tp=4  difference")
    for step, (la, lb) in enumerate(zip(a, b, strict=True), start=half + 1):
        print(f"{step:4d}  {la:11.6f}  {lb:11.6f}  {la - lb:+10.2e}")
    worst = max(abs(la - lb) for la, lb in zip(a, b, strict=True))
    print(f"max |difference| {worst:.2e} (within fp32 noise: {worst < 1e-4})")
