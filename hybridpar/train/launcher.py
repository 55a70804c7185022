"""`hybridpar run`: check the config, then start dp x pp x tp workers with torch's elastic agent.

    hybridpar run CONFIG                      one node: WORLD = dp * pp * tp local workers,
                                              rendezvous on 127.0.0.1 (a free port)
    hybridpar run CONFIG --nnodes 2 --node-rank R --rdzv-endpoint HOST:PORT
                                              WORLD / 2 workers here; node 0 hosts the store

Each worker runs ``hybridpar.train.__main__.main`` (``python -m hybridpar.train CONFIG ...``'s
entry, wrapped in `@record`, so the first failure's traceback is reported by the agent), in a
process forked from a server that imported torch, the trainer and, for an ``hf:`` model, its
transformers family once (`_preload`): a worker starts in milliseconds instead of importing
them itself (3-6 s of CPU each, every worker of a node at once), and the workers share those
pages. The server imports, it never runs a kernel or touches a GPU, so forking it is safe.
Each worker notes its pid in RUN_DIR/workers/ while it runs (`worker_pids`). With
``--max-restarts N`` the agent restarts every worker after a failure, up to N times; each
restart resumes from the latest complete checkpoint.

The run's lifetime is the agent's:
- the agent holds RUN_DIR (`hybridpar.io.run_lock`: an flock on RUN_DIR/.lock naming its pid
  and host) from before it writes RUN_DIR/config.json until it exits: a second run into the
  same folder fails at once naming the holder, and so does one while workers of an earlier
  run still run there (their pid files);
- a worker dies with its agent, however the agent ends (kill -9 included), within
  milliseconds: it waits on a pidfd of the agent, and its parent, the fork server, ends when
  the agent does, upon which the kernel kills the worker (the parent-death signal); both in
  `hybridpar.process.lifetime`. A worker started after the agent died sees it gone and ends.
  No orphan goes on writing checkpoints nobody will stop.

The workers' store is one the host node's agent binds and holds for each attempt
(`hybridpar.train.rendezvous`: no port picked, released and bound again, so two runs started
at once never collide; not torch's store shared with the workers, whose stale addresses broke
restarts). With no endpoint or a loopback one, it and the agent's store listen on loopback
only; a network endpoint (several machines) has both on every interface.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import multiprocessing
import os
import signal
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from hybridpar.io.run_lock import LOCK_NAME, RunDirInUse, hold_run_dir
from hybridpar.process.lifetime import die_with_parent, end_with, start_time
from hybridpar.process.loopback import bind_host, is_loopback
from hybridpar.train.configs.config import Config, ConfigError, load_config, write_resolved

__all__ = ["launch", "registered_worker", "worker_args", "worker_pids"]

log = logging.getLogger(__name__)



def worker_args(config_path: str, *, run_dir: Path, overrides: Sequence[str],
                init_from: str | None, trace: bool = False,
                trace_step: int | None = None, resolved: bool = False) -> list[str]:
    """The arguments of each worker's ``main`` (after ``python -m hybridpar.train``;
    `resolved`: `config_path` is the RUN_DIR/config.json the launcher wrote, read as it is)."""
    args = [config_path, "--run-dir", str(run_dir)]
    if resolved:
        args.append("--resolved")
    for text in overrides:
        args += ["--set", text]
    if init_from is not None:
        args += ["--init-from", init_from]
    if trace:
        args.append("--trace")
    if trace_step is not None:
        args += ["--trace-step", str(trace_step)]
    return args


def _preload(config: Config) -> list[str]:
    """The modules the workers' fork server imports before forking them."""
    from hybridpar.launch import preloaded

    modules = preloaded()
    name = config.model.name
    if name.startswith("hf:"):
        family = name.removeprefix("hf:")
        modules += ["hybridpar.hf", "transformers.modeling_utils"]
        module = f"transformers.models.{family}.modeling_{family}"
        with contextlib.suppress(ImportError, ValueError):   # no such family: the config
            if importlib.util.find_spec(module) is not None:  # check names it, not this
                modules.append(module)
    return modules


def _world_size(config: Config) -> int:
    par = config.parallel
    return (par.dp or 1) * par.pp * par.tp


def _check_nodes(world: int, nnodes: int, node_rank: int, endpoint: str | None) -> None:
    if nnodes < 1 or world % nnodes:
        raise ConfigError(f"--nnodes {nnodes} does not divide the {world} workers (dp x pp x "
                          "tp); choose a divisor of it")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"--node-rank {node_rank} is not in 0..{nnodes - 1}")
    if nnodes > 1 and not endpoint:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every "
                          "node; node 0 listens there)")
    if endpoint and (":" not in endpoint or not endpoint.rsplit(":", 1)[1].isdigit()):
        raise ConfigError(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT")


def _rendezvous(endpoint: str | None, *, single: bool) -> tuple[str, str, str | None]:
    """The agent's rendezvous backend, its endpoint and the address workers meet at."""
    # No endpoint (one node): port 0, the store binds a free port itself, with no window for
    # another process to take it in between (one node has no peer to tell the port to).
    endpoint = endpoint or "127.0.0.1:0"
    host = endpoint.rsplit(":", 1)[0]
    if is_loopback(host):
        # Every node is on this machine: the agent's store listens on the loopback address
        # only, and so does the workers' (`hybridpar.init` with a loopback MASTER_ADDR, which
        # the agent takes from local_addr).
        from hybridpar.train.rendezvous import register_loopback_backend

        return register_loopback_backend(), endpoint, bind_host(host)
    # A network endpoint: torch's c10d rendezvous, its stores on every interface (the
    # workers' one bound and held by node 0's agent, `train.rendezvous`).
    from hybridpar.train.rendezvous import register_network_backend

    return register_network_backend(), endpoint, "127.0.0.1" if single else None


def launch(config_path: str, *, run_dir: str | os.PathLike[str] | None = None,
           overrides: Sequence[str] = (), max_restarts: int = 0, nnodes: int = 1,
           node_rank: int = 0, rdzv_endpoint: str | None = None,
           init_from: str | None = None, trace: bool = False,
           trace_step: int | None = None) -> int:
    """Run a config to the end on this node's workers; the exit status (0: success).

    The config is loaded and checked here first, so a bad one fails in one line before any
    worker starts (raises `ConfigError`). `trace` / `trace_step`: trace the last / that step
    into RUN_DIR/trace (`hybridpar.pipeline.tracing.trace_report`).
    """
    from hybridpar.train.configs.options import check_init_from, check_trace_step, default_run_dir

    config = load_config(config_path, overrides)
    world = _world_size(config)
    _check_nodes(world, nnodes, node_rank, rdzv_endpoint)
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {max_restarts}")
    problem = check_init_from(init_from)
    if problem:
        raise ConfigError(problem)
    problem = check_trace_step(trace_step, config.train.steps)
    if problem:
        raise ConfigError(problem)
    folder = Path(run_dir) if run_dir is not None else default_run_dir(config_path)
    # Held before anything is written: a run already there keeps its config.json.
    with hold_run_dir(folder, name=lock_name(node_rank)):
        _check_no_workers(folder)
        return _launch(config, folder, world=world, max_restarts=max_restarts,
                       nnodes=nnodes, node_rank=node_rank, rdzv_endpoint=rdzv_endpoint,
                       init_from=init_from, trace=trace, trace_step=trace_step)


def lock_name(node_rank: int) -> str:
    """The lock file of `node_rank`'s agent in RUN_DIR: each node's agent holds its own (the
    folder may be one shared by every node, or each node's own)."""
    return LOCK_NAME if node_rank == 0 else f"{LOCK_NAME}.node-{node_rank}"


def _check_no_workers(folder: Path) -> None:
    """Refuse a run directory where workers of an earlier run still run on this machine (one
    started by torchrun, whose agent holds no lock, or an orphan of a killed agent)."""
    alive = worker_pids(folder)
    if alive:
        pids = " ".join(map(str, alive))
        raise RunDirInUse(f"workers of another run still run in {folder} (pids {pids}): wait "
                          f"for them to end or stop them (kill {pids}), or give another "
                          "--run-dir")


def _launch(config: Config, folder: Path, *, world: int, max_restarts: int, nnodes: int,
            node_rank: int, rdzv_endpoint: str | None, init_from: str | None, trace: bool,
            trace_step: int | None) -> int:
    """`launch` once the config is checked and the run directory held."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    resolved = write_resolved(config, folder)   # each node's workers read it: loaded once
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    single = nnodes == 1
    backend, endpoint, local_addr = _rendezvous(rdzv_endpoint, single=single)
    launch_config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=world // nnodes,
        run_id=f"hybridpar-{config.name}" if not single else f"hybridpar-{uuid.uuid4().hex[:8]}",
        rdzv_backend=backend, rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": node_rank == 0, "rank": node_rank},
        max_restarts=max_restarts, monitor_interval=0.2, start_method="forkserver",
        local_addr=local_addr)
    args = worker_args(str(resolved), run_dir=folder, overrides=(), init_from=init_from,
                       trace=trace, trace_step=trace_step, resolved=True)
    # started at the first worker's start, with the environment set above
    multiprocessing.get_context("forkserver").set_forkserver_preload(_preload(config))
    log.info("starting %d workers (%s) in %s", world // nnodes, config.name, folder)
    try:
        elastic_launch(launch_config, run_worker)((os.getpid(), start_time("self")), args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message = failure.message
        if isinstance(message, dict):  # the error file of a worker wrapped in @record
            message = message.get("message", "")
        print(f"hybridpar run: worker rank {rank} failed first (exit code {failure.exitcode}"
              f"): {message}", file=sys.stderr)
        return 1
    except SignalException as e:   # the agent's own SIGTERM / SIGINT: its workers were stopped
        name = signal.Signals(e.sigval).name
        print(f"hybridpar run: stopped by {name} (the workers' last checkpoint is the latest "
              f"with checkpoint.on_signal = true); run again to resume", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


def run_worker(agent: tuple[int, str | None], args: list[str]) -> None:
    """A worker of `launch`: the worker's ``main(args)``; a non-zero status exits with it.
    `agent`: the pid and start time of the agent that started it."""
    _end_with_agent(os.getppid(), agent)
    from hybridpar.train.__main__ import main

    status = main(args)
    if status:
        raise SystemExit(status)


def _end_with_agent(parent: int, agent: tuple[int, str | None]) -> None:
    """Have this worker end when its agent ends (`parent`: the pid that started it, the
    agent's fork server or the agent itself), even by kill -9, within milliseconds."""
    # Two ways, each enough alone: a thread here waits for the agent's end (a pidfd), and
    # the kernel kills this worker when its parent ends (the fork server ends when the agent
    # does, as it reads a pipe only the agent holds; but it takes a second or two to shut its
    # interpreter down).
    die_with_parent(parent)
    end_with(*agent)


@contextlib.contextmanager
def registered_worker(run_dir: Path, rank: int) -> Iterator[None]:
    """While inside: RUN_DIR/workers/<rank>.pid holds this process's pid and start time
    (`worker_pids` reads it; a file left by a killed worker names a process that is gone)."""
    started = start_time("self")
    if started is None:   # no /proc: nothing to note
        yield
        return
    path = run_dir / "workers" / f"{rank}.pid"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{os.getpid()} {started}\n")
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()


def worker_pids(run_dir: str | os.PathLike[str]) -> list[int]:
    """The pids of this machine's running workers of the run in `run_dir` (from their pid
    files, each checked against /proc: the same pid and start time; Linux)."""
    pids = []
    for path in (Path(run_dir) / "workers").glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pid, started = path.read_text().split()
            if start_time(pid) == started:
                pids.append(int(pid))
    return sorted(pids)
