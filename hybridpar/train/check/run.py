"""Dry run: the first training steps of every rank on fake GPUs, checked and measured without
a GPU.

`hybridpar check CONFIG` builds each rank's HybridPipe as `hybridpar run` does
(`train.trainer.build_pipe`; any model, Hugging Face's ``hf:*`` included) and runs its
`train_step`, gradient clip and optimizer step under `FakeTensorMode` on the `fake`
process-group backend, one rank after another in one process, hybridpar's CUDA-only branches
taken as on a GPU (`hybridpar.device.standing_in`):

    per rank of dp x pp x tp            fails the check (CheckError, one line)
    1. init_process_group("fake")       -
    2. build_pipe on a fake GPU         an error building the stage
    3. shape pass of the stage          an error in it
    4. train_step, gradient clip,       a tensor on the wrong device; a host sync (.item(),
       AdamW: the first batch, the      .tolist(), bool(t)); a dtype NCCL cannot carry
       same again, then one row short   between stages; any other error of a step
       (new shapes: headers)
    then: NCCL replay of every P2P op   an order NCCL cannot progress (replay.NCCLOrderError)
          --memory GiB                  a rank whose peak does not fit

This module is the command and `dry_run`; the ranks run in `ranks`, after the shape pass of
`shapes` (it says what the headers say that a fake receive cannot deliver), a failure is
worded by `failure`, the fake GPU and its CUDA runtime are `fake_gpu`'s and the numbers
measured are `memory`'s. `dry_run` runs the ranks
in a child process by default: the fake GPU's registration lasts for the process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hybridpar.pipeline.activations.checkpoint import layer_stride
from hybridpar.train.check.failure import CheckError
from hybridpar.train.check.memory import CheckReport, RankReport
from hybridpar.train.check.ranks import DryRun
from hybridpar.train.configs.config import Config

__all__ = ["CheckError", "CheckReport", "RankReport", "add_parser", "dry_run", "main"]

CHILD_TIMEOUT = 600              # seconds the isolated dry-run process may take


# entry points ------------------------------------------------------------------------------
def dry_run(config: Config | str | os.PathLike[str], *, device: str = "cuda",
            memory_gib: float | None = None,
            overrides: Sequence[str] = (), model: str | None = None,
            isolate: bool = True) -> CheckReport:
    """Check the first training steps of every rank of `config` (a `Config` or a TOML path).

    `device`: "cuda" (fake GPUs) or "cpu" (fake CPU ranks, as gloo runs them). `memory_gib`:
    the memory of one device; a rank whose peak exceeds it fails. `overrides`: ``--set``
    strings. `model`: ``"module:function"`` or ``"file.py:function"`` building the
    nn.Sequential instead of the config's model (same options, data and loss). `isolate`:
    run in a child process (the fake GPU's registration stays in the process that runs).
    Raises `CheckError` naming the rank, layer and tensor of a failure.
    """
    from hybridpar.train.configs.config import load_config

    cfg = config if isinstance(config, Config) else load_config(config, overrides)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    mode = cfg.parallel.checkpoint
    if device == "cuda" and (layer_stride(mode) is not None or mode == "selective"):
        # torch's non-reentrant checkpoint recomputes inside autograd's backward, on the
        # engine's device thread, whose stream guard then ends the process on the fake GPU
        # (std::terminate in PythonDeviceGuard::exchangeStream, which Python cannot
        # override; docs/check.md); on fake CPU ranks it runs
        raise ValueError(f"hybridpar check cannot dry-run parallel.checkpoint = {mode!r} on fake "
                         "GPUs (torch's checkpoint aborts on the fake device); check it with "
                         "--device cpu (fake CPU ranks), or check with 'always' / 'never'")
    if not isolate:
        return DryRun(cfg, device=device, memory_gib=memory_gib, model=model).all_ranks()
    job = {"config": cfg.to_dict(), "device": device, "memory_gib": memory_gib, "model": model}
    with tempfile.TemporaryDirectory(prefix="hybridpar-check-") as tmp:
        out = Path(tmp) / "result.json"
        try:
            proc = subprocess.run([sys.executable, "-m", "hybridpar.train.check.run", str(out)],
                                  input=json.dumps(job), capture_output=True, text=True,
                                  timeout=CHILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the dry run did not finish in {CHILD_TIMEOUT} s; a fake step "
                               "takes seconds, so this is a hang: please report it") from None
        if not out.is_file():
            raise RuntimeError(f"the dry-run process ended with exit code {proc.returncode} "
                               f"and no result:\n{proc.stderr[-3000:]}")
        result = json.loads(out.read_text(encoding="utf-8"))
    report = CheckReport.from_dict(result["report"]) if result.get("report") else None
    if result.get("error"):
        raise CheckError(result["error"], rank=result.get("rank"), report=report)
    assert report is not None
    return report


def _child(out: str) -> int:
    """``python -m hybridpar.train.check.run RESULT.json``, the job on stdin: one isolated dry
    run."""
    job = json.loads(sys.stdin.read())
    cfg = Config.from_dict(job["config"], source=str(job["config"].get("name")))
    result: dict[str, Any] = {}
    try:
        report = dry_run(cfg, device=job["device"], memory_gib=job["memory_gib"],
                         model=job["model"], isolate=False)
        result["report"] = report.to_dict()
    except CheckError as e:
        result.update(error=str(e), rank=e.rank,
                      report=e.report.to_dict() if e.report is not None else None)
    Path(out).write_text(json.dumps(result), encoding="utf-8")
    return 0


def add_parser(commands: Any) -> None:
    """The `hybridpar check` subcommand and its options."""
    p = commands.add_parser("check", help="dry-run the first steps of every rank on fake GPUs",
                            description="Dry-run the first training steps of every rank of a "
                            "config on fake GPUs (no GPU needed), through hybridpar's CUDA "
                            "branches: device placement, host syncs, the dtypes and NCCL order "
                            "of the P2P, headers of new shapes, memory and traffic per rank.")
    p.add_argument("config", help="a TOML config (see configs/)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="fake GPUs (default) or fake CPU ranks as gloo runs them")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   dest="overrides", help="override a config value (repeatable)")
    p.add_argument("--memory", type=_gib, metavar="GiB",
                   help="memory of one device: fail if a rank's peak is larger")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    p.add_argument("--model", metavar="MODULE:FUNCTION",
                   help="build the nn.Sequential with this function (of a module or a .py "
                   "file) instead of the config's model, with the same options, data, loss")


def _gib(value: str) -> float:
    """``--memory``'s value: the GiB of one device (a positive number)."""
    try:
        gib = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a number of GiB: --memory takes the memory of one device, e.g. "
            "`hybridpar check CONFIG --memory 80`; without it the per-rank bytes are printed "
            "all the same") from None
    if not gib > 0:
        raise argparse.ArgumentTypeError(f"--memory must be a positive number of GiB, got "
                                         f"{value}")
    return gib


def main(args: argparse.Namespace) -> int:
    """Run `hybridpar check`: the table on stdout and 0, or a failure on stderr and 1."""
    try:
        report = dry_run(args.config, device=args.device, memory_gib=args.memory,
                         overrides=args.overrides, model=args.model, isolate=False)
    except CheckError as e:
        if e.report is not None:
            print(e.report.format())
            if args.json:
                e.report.write_json(args.json)
        print(f"hybridpar check: {e}", file=sys.stderr)
        return 1
    print(report.format())
    if args.json:
        report.write_json(args.json)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m hybridpar.train.check.run RESULT.json < JOB.json "
                 "(dry_run's child; use `hybridpar check CONFIG`)")
    sys.exit(_child(sys.argv[1]))
