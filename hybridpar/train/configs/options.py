"""The options of a training run, shared by `hybridpar run` and its workers, and checks."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_run_options", "add_worker_options", "check_init_from", "check_trace_step",
           "default_run_dir", "init_from_format"]


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """The options a worker and `hybridpar run` share."""
    parser.add_argument("config", help="a TOML config (see configs/)")
    parser.add_argument("--run-dir", help="where checkpoints, metrics and the resolved config "
                        "go (default: runs/<config name>); an existing one is resumed")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        dest="overrides", help="override a config value (repeatable)")
    parser.add_argument("--init-from", metavar="PATH", help="start from a plain state dict "
                        "(hybridpar export's output: the folder OUT, its "
                        "model.safetensors.index.json or model.safetensors, or OUT.pt) when "
                        "the run dir has no checkpoint; safetensors are read by each rank for "
                        "its stages and tp slices only, a .pt file whole")
    parser.add_argument("--trace", action="store_true", help="trace one training step (the "
                        "last, or --trace-step) into RUN_DIR/trace: trace.json (Perfetto), "
                        "gantt.png, table.txt (bubble per stage, also printed)")
    parser.add_argument("--trace-step", type=int, metavar="N", help="the step to trace "
                        "(1-based; implies --trace; default: the last step)")


def add_worker_options(parser: argparse.ArgumentParser) -> None:
    """A worker's own: ``--resolved`` (CONFIG is the RUN_DIR/config.json `hybridpar run`
    wrote after checking it; read as it is, not checked again)."""
    parser.add_argument("--resolved", action="store_true", help=argparse.SUPPRESS)


def init_from_format(path: str) -> str:
    """``"safetensors"`` (an export folder, its index ``.json``, a ``.safetensors`` file) or
    ``"pt"`` (any other file: ``torch.load``); a `ValueError` saying what to give else."""
    target = Path(path)
    what = ("give hybridpar export's output: the folder OUT (or its "
            "model.safetensors.index.json or model.safetensors) or the file OUT.pt")
    if target.is_dir():
        if not (target / "model.safetensors.index.json").is_file() and \
                not (target / "model.safetensors").is_file():
            raise ValueError(f"--init-from {path}: the folder holds neither "
                             f"model.safetensors.index.json nor model.safetensors; {what}")
        return "safetensors"
    if not target.is_file():
        raise ValueError(f"--init-from {path}: no such file or folder; {what}")
    return "safetensors" if target.suffix in (".json", ".safetensors") else "pt"


def check_init_from(path: str | None) -> str | None:
    """What is wrong with ``--init-from`` `path` (None: nothing, or no path)."""
    if path is None:
        return None
    try:
        init_from_format(path)
    except ValueError as e:
        return str(e)
    return None


def check_trace_step(step: int | None, steps: int) -> str | None:
    """Why `--trace-step` cannot be traced in a run of `steps` steps (None: it can)."""
    if step is not None and not 1 <= step <= steps:
        return f"--trace-step {step} is not a step of this run (train.steps = {steps}); " \
               f"give 1..{steps}, or --trace for the last step"
    return None


def default_run_dir(config_path: str) -> Path:
    """``runs/<config file stem>`` under the working directory."""
    return Path("runs") / Path(config_path).stem
