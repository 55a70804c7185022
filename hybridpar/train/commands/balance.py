"""`hybridpar balance CONFIG`: profile the config's model, print the stage table, write it back."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import torch

from hybridpar.balance import (
    DEFAULT_BANDWIDTH,
    balance_by_params,
    balance_profiles,
    format_table,
    profile_layers,
    stage_table,
)
from hybridpar.io.files import atomic_write_text
from hybridpar.pipeline.schedules.layout import Layout
from hybridpar.train.configs.config import load_config
from hybridpar.train.configs.model_build import build_model
from hybridpar.train.data import make_batches

__all__ = ["add_parser", "run", "write_balance"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register the ``balance`` subcommand."""
    p = commands.add_parser("balance", help="profile a config's model and choose a balance",
                            description=__doc__)
    p.add_argument("config", help="a TOML config (configs/*.toml)")
    p.add_argument("--partitions", type=int,
                   help="stages (default: the config's, parallel.pp x virtual stages per rank)")
    p.add_argument("--by", choices=("time", "size", "params"), default="time")
    p.add_argument("--tp", type=int, help="cost of tp shards (default: parallel.tp)")
    p.add_argument("--timeout", type=float, default=2.0, help="profiling seconds (time)")
    p.add_argument("--write", action="store_true",
                   help="store the balance as parallel.balance in the config file")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (repeatable)")


def run(args: argparse.Namespace) -> int:
    """Profile, print the table and the balance; with ``--write`` update the file."""
    cfg = load_config(args.config, args.set)
    par = cfg.parallel
    stages = Layout.of(par.schedule, par.pp, par.virtual_stages).stages   # pp * virtual
    partitions = args.partitions if args.partitions is not None else stages
    tp = args.tp if args.tp is not None else cfg.parallel.tp
    if tp < 1:
        raise ValueError(f"--tp {tp} must be a positive integer (the tensor-parallel size whose "
                         "shards are costed)")
    if not args.timeout > 0:
        raise ValueError(f"--timeout {args.timeout} must be positive (seconds of profiling)")
    if args.write and partitions != stages:
        raise ValueError(f"--write stores a balance for the config's {stages} stages; drop "
                         f"--partitions {partitions}, or also --set parallel.pp={partitions}")
    torch.manual_seed(cfg.train.seed)
    # on meta as a worker builds it; each layer is materialized alone while it is profiled
    model, _, init_fn = build_model(cfg)
    if not 1 <= partitions <= len(model):
        raise ValueError(f"cannot split {len(model)} layers into {partitions} stages; "
                         f"choose --partitions between 1 and {len(model)}")
    # one micro-batch of one replica: what a stage computes at a time
    rows = max(1, cfg.train.batch_size // (cfg.parallel.dp or 1) // cfg.parallel.chunks)
    x = make_batches(cfg).next_batch()[0]            # ids, or (ids, positions): packed
    sample = tuple(t[:rows] for t in x) if isinstance(x, tuple) else x[:rows]
    profiles = profile_layers(model, sample, timeout=args.timeout, chunks=1, tp=tp,
                              progress=True, init_fn=init_fn)
    bandwidth = DEFAULT_BANDWIDTH["cpu"]
    if args.by == "params":
        balance = balance_by_params(partitions, model)
    else:
        balance = balance_profiles(profiles, partitions, by=args.by, p2p_bandwidth=bandwidth)
    print(f"{cfg.model.name} ({len(model)} layers) over {partitions} stages by {args.by}, "
          f"tp={tp}, micro-batch of {rows}:")
    print(format_table(stage_table(profiles, balance, p2p_bandwidth=bandwidth)))
    print(f"balance = {balance}")
    if args.write:
        write_balance(args.config, balance)
        print(f"wrote parallel.balance = {balance} to {args.config}")
    return 0


_HEADER = re.compile(r"^\s*\[([^\[\]]+)\]\s*(#.*)?$")
_BALANCE = re.compile(r"^(\s*)balance\s*=.*$")


def write_balance(path: str | os.PathLike[str], balance: list[int]) -> None:
    """Set ``balance = [...]`` in the ``[parallel]`` table of a TOML file, keeping the rest.

    The file is replaced atomically (`hybridpar.io.files.atomic_write_text`): a crash leaves the
    old file or the new one, never half of one.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines(keepends=True)
    value = f"balance = {list(balance)}\n"
    section, header_at, done = None, None, False
    for i, line in enumerate(lines):
        header = _HEADER.match(line)
        if header:
            section = header.group(1).strip()
            if section == "parallel":
                header_at = i
            continue
        match = _BALANCE.match(line)
        if section == "parallel" and match:
            lines[i] = match.group(1) + value
            done = True
            break
    if not done:
        if header_at is None:
            lines += ["\n" if lines and not lines[-1].endswith("\n") else "", "[parallel]\n"]
            lines.append(value)
        else:
            lines.insert(header_at + 1, value)
    atomic_write_text(path, "".join(lines))
