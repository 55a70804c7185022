"""The worker entry point: ``torchrun --nproc-per-node N -m hybridpar.train CONFIG [options]``.

`hybridpar run` starts these workers itself; torchrun (or any launcher that sets RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT) may start them too.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

__all__ = ["main"]


def _configure_logging(rank: int, reporter: bool) -> None:
    logging.basicConfig(level=logging.INFO if reporter else logging.WARNING,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr, force=True)


@record
def main(argv: Sequence[str] | None = None) -> int:
    """Run the training loop of a config on this rank (one of WORLD_SIZE)."""
    import torch

    from hybridpar.topology import ParallelDims, shutdown
    from hybridpar.train.configs.config import ConfigError, load_config, load_resolved
    from hybridpar.train.configs.options import (
        add_run_options,
        add_worker_options,
        check_trace_step,
        default_run_dir,
    )
    from hybridpar.train.launcher import registered_worker
    from hybridpar.train.trainer import train

    parser = argparse.ArgumentParser(prog="python -m hybridpar.train",
                                     description="A hybridpar training worker.")
    add_run_options(parser)
    add_worker_options(parser)
    args = parser.parse_args(argv)
    try:
        config = load_resolved(args.config) if args.resolved else \
            load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"hybridpar.train: error: {e}", file=sys.stderr)
        return 2
    problem = check_trace_step(args.trace_step, config.train.steps)
    if problem:
        print(f"hybridpar.train: error: {problem}", file=sys.stderr)
        return 2
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    par = config.parallel
    dims = ParallelDims.for_world(world, pp=par.pp, tp=par.tp, dp=par.dp, ep=par.ep)
    _configure_logging(rank, rank == dims.rank(0, dims.pp - 1, 0))
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.config)
    request = None
    if args.trace or args.trace_step is not None:
        from hybridpar.pipeline.tracing.trace_report import request_trace

        request = request_trace(run_dir / "trace", step=args.trace_step)
    try:
        with registered_worker(run_dir, rank):
            result = train(config, run_dir, init_from=args.init_from, trace=request,
                           write_config=not args.resolved)
    finally:
        shutdown()
    if request is not None and not request.done and rank == 0:
        logging.warning("nothing traced: step %d was not run here (the run resumed after it)",
                        request.step or config.train.steps)
    # stopped by a signal (checkpoint.on_signal): not a finished run, the shell's status for
    # the signal (SIGTERM: 143); exiting with it, a worker of torch's elastic agent ends at
    # once, where a worker that returns waits for the agent to read its result (which an
    # agent being shut down never does: 30 s, then SIGKILL)
    stopped = result.get("stopped_by")
    return 128 + signal.Signals[stopped].value if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
