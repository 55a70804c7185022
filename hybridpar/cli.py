"""The `hybridpar` command line: `run`, `export`, `balance`, `check`, `schedule`, `tokenize`,
`env`.

Errors in what the user gave (config, paths, options) print one line and exit with 2.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _env() -> int:
    import torch
    import torch.distributed as dist

    import hybridpar

    rows = [
        ("hybridpar", hybridpar.__version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("cpus", str(os.cpu_count())),
        ("cuda devices", str(torch.cuda.device_count() if torch.cuda.is_available() else 0)),
        ("gloo", str(dist.is_gloo_available())),
        ("nccl", str(dist.is_nccl_available())),
        ("default backend", "nccl" if torch.cuda.is_available() else "gloo"),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _add_run(commands: Any) -> None:
    from hybridpar.train.configs.options import add_run_options

    p = commands.add_parser("run", help="train a config on dp x pp x tp local workers",
                            description="Train a config: checks it, then starts dp x pp x tp "
                            "workers through torch's elastic launcher. Running again with the "
                            "same run dir resumes from its latest complete checkpoint.")
    add_run_options(p)
    p.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart all workers after a failure up to N times, resuming from "
                   "the latest checkpoint (default 0)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank (default 0)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="rendezvous address, the same on every node (node 0 listens there); "
                   "default for one node: 127.0.0.1 and a free port")


def _add_export(commands: Any) -> None:
    p = commands.add_parser("export", help="write a checkpoint as a plain state dict or a "
                            "Hugging Face checkpoint",
                            description="Write a checkpoint folder (any layout) as the plain "
                            "single-device state dict of the unsharded nn.Sequential, or as a "
                            "Hugging Face checkpoint: safetensors files written one tensor at a "
                            "time, assembled beside OUT and renamed into place.")
    p.add_argument("checkpoint", help="a checkpoint folder, e.g. runs/quickstart/checkpoints/"
                   "step-200")
    p.add_argument("out", help="the folder to create: safetensors files of at most "
                   "--max-shard-size bytes (model.safetensors, or model-00001-of-0000N."
                   "safetensors ... and model.safetensors.index.json); a path ending in .pt: "
                   "one torch.save file instead (the whole model in this process)")
    p.add_argument("--format", choices=("plain", "hf", "pt"), default="plain",
                   help="plain: the nn.Sequential's names (--init-from reads it); hf: a "
                   "Hugging Face checkpoint (config.json + weights) of an hf:<family> run, for "
                   "from_pretrained; pt: the old name of plain")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE",
                   help="the most bytes in one safetensors file: 5GB (the default), 200MB, "
                   "20KB, 1.5GiB or a number of bytes; a larger tensor gets a file of its own")
    p.add_argument("--config", default=None, help="with --format hf: the run's config.json "
                   "(default: RUN_DIR/config.json next to RUN_DIR/checkpoints)")


def _schedule(args: argparse.Namespace) -> int:
    from hybridpar.train.commands.schedule import main as schedule_main

    return schedule_main(args)


def _check(args: argparse.Namespace) -> int:
    from hybridpar.train.check import main as check_main

    return check_main(args)


def _tokenize(args: argparse.Namespace) -> int:
    from hybridpar.data.command import run as tokenize_run

    return tokenize_run(args)


def _plot(args: argparse.Namespace) -> int:
    from hybridpar.train.commands.plot import run as plot_run

    return plot_run(args)


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from hybridpar.train import ConfigError
    from hybridpar.train.configs.options import default_run_dir
    from hybridpar.train.launcher import launch

    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.config)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir} is a file; give a folder (new or a run's, to "
                          "resume it)")
    return launch(args.config, run_dir=run_dir, overrides=args.overrides,
                  max_restarts=args.max_restarts, nnodes=args.nnodes,
                  node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint,
                  init_from=args.init_from, trace=args.trace, trace_step=args.trace_step)


def _export(args: argparse.Namespace) -> int:
    from hybridpar.io.weight_files import DEFAULT_MAX_SHARD_SIZE, parse_size
    from hybridpar.train.export import export_checkpoint, export_hf, export_plain

    size = DEFAULT_MAX_SHARD_SIZE
    if args.max_shard_size is not None:
        try:
            size = parse_size(args.max_shard_size)
        except ValueError as e:
            raise ValueError(f"--max-shard-size: {e}") from None
    if args.format != "hf" and str(args.out).endswith(".pt"):
        if args.max_shard_size is not None:
            raise ValueError(f"--max-shard-size sizes safetensors files, and {args.out} is one "
                             ".pt file: drop the option, or give a folder (no .pt) to write")
        state = export_checkpoint(args.checkpoint, args.out)
        count = sum(t.numel() for t in state.values())
        print(f"wrote {args.out}: {len(state)} tensors, {count:,} values")
        return 0
    try:
        if args.format == "hf":
            written = export_hf(args.checkpoint, args.out, config=args.config,
                                max_shard_size=size)
        else:
            written = export_plain(args.checkpoint, args.out, max_shard_size=size)
    except ImportError as e:   # safetensors is missing: one line, as every user error
        raise ValueError(str(e)) from None
    files = len(written.files)
    print(f"wrote {args.out}: {written.tensors} tensors, {written.values:,} values in {files} "
          f"file{'s' if files > 1 else ''}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `hybridpar` command line: every command and option (docs/reference.md shows it)."""
    from hybridpar import __version__
    from hybridpar.data.command import add_parser as add_tokenize
    from hybridpar.train.check import add_parser as add_check
    from hybridpar.train.commands.balance import add_parser as add_balance
    from hybridpar.train.commands.plot import add_parser as add_plot
    from hybridpar.train.commands.schedule import add_parser as add_schedule

    parser = argparse.ArgumentParser(prog="hybridpar", description=(
        "Pipeline x tensor x data parallel training for PyTorch."))
    parser.add_argument("--version", action="version", version=f"hybridpar {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_run(commands)
    _add_export(commands)
    add_balance(commands)
    add_check(commands)
    add_schedule(commands)
    add_tokenize(commands)
    add_plot(commands)
    commands.add_parser("env", help="print the versions and devices hybridpar sees")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hybridpar` console script."""
    from hybridpar.train.commands.balance import run as balance

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "env":
        return _env()
    handlers = {"run": _run, "export": _export, "balance": balance, "check": _check,
                "schedule": _schedule, "tokenize": _tokenize,
                "plot": _plot}
    if args.command not in handlers:
        parser.print_help()
        return 0
    from hybridpar.train import ConfigError
    from hybridpar.train.checkpoints.checkpoint import CheckpointError

    try:
        return handlers[args.command](args)
    except (ConfigError, CheckpointError, ValueError, OSError) as e:
        print(f"hybridpar {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
