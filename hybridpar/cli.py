"""The `hybridpar` command line: `balance`, `env` (run / export come with the trainer)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence

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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hybridpar` console script."""
    from hybridpar import __version__

    parser = argparse.ArgumentParser(prog="hybridpar", description=(
        "Pipeline x tensor x data parallel training for PyTorch."))
    parser.add_argument("--version", action="version", version=f"hybridpar {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("env", help="print the versions and devices hybridpar sees")
    from hybridpar.balance import cli as balance_cli

    balance_cli.add_parser(commands)
    args = parser.parse_args(argv)
    if args.command == "env":
        return _env()
    if args.command == "balance":
        from hybridpar.train import ConfigError

        try:
            return balance_cli.run(args)
        except (ConfigError, ValueError) as e:
            print(f"hybridpar balance: error: {e}", file=sys.stderr)
            return 2
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
