"""The launcher glue of the ported tests: `torch.multiprocessing.spawn` on a forkserver.

torchshard's tests start their ranks with ``mp.spawn``, whose children each start a fresh
interpreter and import torch (2-3 s of CPU each on 2 cores: most of a test's time). The
conftest swaps in `spawn`, which starts the very same ``fn(i, *args)`` ranks through
`torch.multiprocessing.start_processes` with the forkserver start method instead: the
children fork from a server that imported torch once, with the rendezvous port
(``HYBRIDPAR_TS_PORT``) and ``OMP_NUM_THREADS`` of the test passed to them, and one torch
thread each as before. Errors reach the test as before (`ProcessRaisedException`).
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.multiprocessing import start_processes

import hybridpar.launch

# What the server imports once: `hybridpar.spawn`'s list (the suite's warning filters last,
# tests/conftest.py) and torchshard's layers. The server is one per pytest process, started by
# whichever test spawns first: `hybridpar.spawn` and this both ask for the same list, so a
# rank has the filters whichever came first (test_torch_floor.py checks it).
hybridpar.launch.preload("torch", "torch.distributed", "hybridpar.torchshard")
_ENV = ("HYBRIDPAR_TS_PORT", "OMP_NUM_THREADS")


def _rank(i: int, env: dict[str, str], fn: Callable[..., Any], args: Sequence[Any]) -> None:
    os.environ.update(env)                     # forked from the server: not the test's env
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    fn(i, *args)


def spawn(fn: Callable[..., Any], args: Sequence[Any] = (), nprocs: int = 1, join: bool = True,
          daemon: bool = False, start_method: str = "spawn") -> Any:
    """`torch.multiprocessing.spawn`'s signature; the ranks start from the forkserver."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(hybridpar.launch.preloaded())
    env = {name: os.environ[name] for name in _ENV if name in os.environ}
    return start_processes(_rank, (env, fn, tuple(args)), nprocs, join, daemon,
                           start_method="forkserver")
