"""The options of a training run, shared by `hybridpar run` and its workers, and checks."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_run_options", "add_worker_options", "check_trace_step", "default_run_dir"]


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options a worker and `hybridpar run` share."""
    parser.add_argument("config", help="a TOML config (see configs/)")
    parser.add_argument("--run-dir", help="where checkpoints, metrics and the resolved config "
                        "go (default: runs/<config name>); an existing one is resumed")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        dest="overrides", help="override a config value (repeatable)")
    parser.add_argument("--init-from", metavar="FILE", help="start from a plain state dict "
                        "(hybridpar export's output: OUT/model.safetensors.index.json, "
                        "OUT/model.safetensors or OUT.pt) when the run dir has no checkpoint")
    parser.add_argument("--trace", action="store_true", help="trace one training step (the "
                        "last, or --trace-step) into RUN_DIR/trace: trace.json (Perfetto), "
                        "gantt.png, table.txt (bubble per stage, also printed)")
    parser.add_argument("--trace-step", type=int, metavar="N", help="the step to trace "
                        "(1-based; implies --trace; default: the last step)")


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    """A worker's own: ``--resolved`` (CONFIG is the RUN_DIR/config.json `hybridpar run`
    wrote after checking it; read as it is, not checked again)."""
    parser.add_argument("--resolved", action="store_true", help=argparse.SUPPRESS)


def check_trace_step(step: int | None, steps: int) -> str | None:
    """Why `--trace-step` cannot be traced in a run of `steps` steps (None: it can)."""
    if step is not None and not 1 <= step <= steps:
        return f"--trace-step {step} is not a step of this run (train.steps = {steps}); " \
               f"give 1..{steps}, or --trace for the last step"
    return None


def default_run_dir(config_path: str) -> Path:
    """``runs/<config file stem>`` under the working directory."""
    return Path("runs") / Path(config_path).stem
