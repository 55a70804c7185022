"""NCCL's own failure handling for a run: async error handling and the flight recorder.

Set by the trainer on every rank before its process group exists (torch reads them when it
creates an NCCL communicator); a value the user exported wins:

    variable                           value                        what it does
    TORCH_NCCL_ASYNC_ERROR_HANDLING    3                            a failed or timed-out
                                                                    collective ends the process
                                                                    (no hang in a dead job)
    TORCH_FR_BUFFER_SIZE               2000                         the flight recorder: the
                                                                    last 2000 collectives and
                                                                    P2P ops of each rank
    TORCH_NCCL_DUMP_ON_TIMEOUT         1                            on a timeout, each rank
                                                                    dumps its recorder ...
    TORCH_FR_DUMP_TEMP_FILE            RUN_DIR/nccl_trace/rank_     ... into the run directory
                                                                    (one file per rank)

Read a dump with ``python -m torch.distributed.flight_recorder.fr_trace RUN_DIR/nccl_trace``
(torch's analyzer: which rank did not join which collective). hybridpar's watchdog fires
earlier (`pipe.build.WATCHDOG_SHARE` of the timeout) and names the stage,
micro-batch and
peer; NCCL's dump is the record of what the device had queued.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["TRACE_DIR", "nccl_env"]

TRACE_DIR = "nccl_trace"


def nccl_env(run_dir: str | os.PathLike[str], *, create: bool) -> dict[str, str]:
    """Set the variables above in ``os.environ`` (those not set already); returns the values in
    effect. `create`: make RUN_DIR/nccl_trace for the dumps (a GPU run)."""
    folder = Path(run_dir) / TRACE_DIR
    wanted = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": str(folder / "rank_"),
    }
    if create:
        folder.mkdir(parents=True, exist_ok=True)
    return {key: os.environ.setdefault(key, value) for key, value in wanted.items()}
