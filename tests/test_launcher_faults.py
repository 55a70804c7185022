"""`hybridpar run` on an operator's bad day: runs started at once, a killed agent, two runs
into one run directory (issue 39 point 4, issue 40 points 1 and 2).

Real `hybridpar run` processes on the 2-worker tiny GPT, real files, kill -9. The run
directory's lock and the rendezvous' stores are also tested on their own, in this process.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from hybridpar.cli import main
from hybridpar.io.run_lock import LOCK_NAME, RunDirInUse, hold_run_dir, holder
from hybridpar.launch import free_port
from hybridpar.train.launcher import launch, registered_worker, worker_pids

TINY = Path(__file__).parent / "data" / "tiny_gpt.toml"   # 2 workers
HYBRIDPAR = [sys.executable, "-m", "hybridpar.cli"]
QUIET = ["--set", "train.sample_tokens=0", "--set", "train.log_every=1000"]
LINUX = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.toml"
    path.write_text(TINY.read_text())
    return path


def _complete(run_dir: Path) -> list[str]:
    """The complete checkpoints of a run (a partial one is a hidden .step-N.partial)."""
    folder = run_dir / "checkpoints"
    return sorted((p.name for p in folder.glob("step-*") if (p / ".metadata").is_file()),
                  key=lambda name: int(name.split("-")[1]))


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, killed and not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# the run directory's lock, in this process ---------------------------------------------------
def test_a_held_run_dir_is_refused_naming_the_holder_and_released_empty(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    with hold_run_dir(run_dir):
        record = holder(run_dir)
        assert record is not None and record["pid"] == os.getpid()
        assert record["host"] == socket.gethostname()
        # flock is per open file: a second open in this process is another holder
        with pytest.raises(RunDirInUse) as info, hold_run_dir(run_dir):
            pass
        message = str(info.value)
        assert f"the run directory {run_dir} is in use by another run (pid {os.getpid()} " \
               f"on host {socket.gethostname()}, since " in message
        assert "wait for it to end or stop it, or give another --run-dir" in message
    assert holder(run_dir) is None
    assert (run_dir / LOCK_NAME).read_text() == ""      # released: nothing left to report


def test_a_holder_that_has_not_written_its_record_yet_is_a_starting_run(tmp_path: Path) -> None:
    import fcntl

    tmp_path.joinpath(LOCK_NAME).touch()
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)            # locked, its record not written
        with pytest.raises(RunDirInUse, match="a run that is starting"), \
                hold_run_dir(tmp_path, wait=0.1):
            pass
        assert holder(tmp_path) == {}
    finally:
        os.close(fd)


def test_the_record_of_a_run_that_died_holding_the_lock_is_taken_over_with_a_message(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    dead = {"pid": 4242, "host": "node7", "since": "2026-11-28T06:00:00Z"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(dead))    # nobody holds the file
    with caplog.at_level(logging.WARNING), hold_run_dir(tmp_path):
        assert holder(tmp_path)["pid"] == os.getpid()
    assert f"the run directory {tmp_path} was held by pid 4242 on host node7, since " \
           "2026-11-28T06:00:00Z, which ended without releasing it (killed?); taking it " \
           "over" in caplog.text


@LINUX
def test_a_run_dir_where_workers_still_run_is_refused_before_anything_is_written(
        tiny: Path, tmp_path: Path) -> None:
    # Workers started by torchrun (no agent, no lock) or orphans: their pid files say so.
    run_dir = tmp_path / "r"
    with registered_worker(run_dir, 0), pytest.raises(RunDirInUse) as info:
        launch(str(tiny), run_dir=run_dir)
    assert f"workers of another run still run in {run_dir} (pids {os.getpid()})" \
        in str(info.value)
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME, "workers"]
    assert not (run_dir / "config.json").exists()


def test_a_lock_that_cannot_be_opened_is_named(tmp_path: Path) -> None:
    (tmp_path / LOCK_NAME).mkdir()        # not a file: cannot be opened for writing
    with pytest.raises(OSError, match=r"cannot open the run directory's lock .*\.lock: Is a "
                                      "directory"), hold_run_dir(tmp_path):
        pass


# a process that ends with another -------------------------------------------------------------
LIFETIME = Path(__file__).resolve().parents[1] / "hybridpar" / "process" / "lifetime.py"
# The module alone (stdlib only), without importing hybridpar and torch: a child in 50 ms.
LOAD = ("import importlib.util as u, os, sys, time; "
        f"s = u.spec_from_file_location('lifetime', {str(LIFETIME)!r}); "
        "m = u.module_from_spec(s); s.loader.exec_module(m); ")
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def _armed(code: str) -> subprocess.Popen[str]:
    """A python child running LOAD + `code`, once it printed its first line."""
    child = subprocess.Popen([sys.executable, "-c", LOAD + code], stdout=subprocess.PIPE,
                             text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "armed"
    return child


@LINUX
def test_a_process_ends_within_milliseconds_of_the_process_it_names(tmp_path: Path) -> None:
    agent = subprocess.Popen(SLEEPER)      # not the child's parent: its end is still seen
    try:
        child = _armed(f"m.end_with({agent.pid}, m.start_time({agent.pid})); print('armed', "
                       "flush=True); time.sleep(60)")
        agent.kill()
        agent.wait()
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        agent.kill()


@LINUX
def test_a_process_ends_with_its_parent_by_the_parent_death_signal(tmp_path: Path) -> None:
    # parent: starts the grandchild and prints its pid; the grandchild arms the signal alone
    grandchild = ("import subprocess; g = subprocess.Popen([sys.executable, '-c', sys.argv[1]],"
                  " stdout=subprocess.PIPE, text=True); print(g.stdout.readline().strip(), "
                  "flush=True); time.sleep(60)")
    armed = LOAD + ("m.die_with_parent(os.getppid()); print(os.getpid(), flush=True); "
                    "time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", LOAD + grandchild, armed],
                              stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    try:
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while _alive(pid):
            assert time.monotonic() < deadline, "the grandchild outlived its parent"
            time.sleep(0.01)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@LINUX
def test_a_process_whose_parent_or_named_process_is_gone_ends_at_once() -> None:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    gone = int(ended.stdout)
    for code in (f"m.end_with({gone}, '1')",                         # ended, or another's pid
                 "m.end_with(os.getppid(), '1')",                    # a pid of another start
                 f"m.die_with_parent({gone})"):                      # reparented already
        done = subprocess.run([sys.executable, "-c", LOAD + code + "; print('lived')"],
                              capture_output=True, text=True, timeout=30)
        assert (done.returncode, done.stdout) == (1, ""), code


# the workers' store -------------------------------------------------------------------------
def test_the_workers_store_is_bound_by_the_agent_and_new_for_each_attempt() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from hybridpar.train.rendezvous import register_loopback_backend

    params = RendezvousParameters(backend=register_loopback_backend(),
                                  endpoint="127.0.0.1:0", run_id="faults", min_nodes=1,
                                  max_nodes=1, local_addr="127.0.0.1", is_host=True)
    handler = get_rendezvous_handler(params)
    wait = datetime.timedelta(seconds=20)
    try:
        assert handler.use_agent_store       # the workers are clients: none binds a port
        first = handler.next_rendezvous().bootstrap_store_info
        assert first.master_addr == "127.0.0.1"
        # Listening already, before any worker starts: a worker only connects to it.
        client = dist.TCPStore("127.0.0.1", first.master_port, None, False, timeout=wait)
        client.set("default_pg/0//rank_0", "an address of the first attempt")
        second = handler.next_rendezvous().bootstrap_store_info   # a restart
        again = dist.TCPStore("127.0.0.1", second.master_port, None, False, timeout=wait)
        assert again.num_keys() == 0 and not again.check(["default_pg/0//rank_0"])
    finally:
        handler.shutdown()


def _network_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (None without a route out)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))   # a documentation address: no packet is sent
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_nodes_of_a_network_rendezvous_get_the_workers_store_node_0s_agent_holds() -> None:
    # --rdzv-endpoint HOST:PORT on a network: node 0's agent binds the workers' store itself
    # (port 0) and holds it; node 1 learns its port through the rendezvous store. Before,
    # torch's agent picked the port by binding and releasing it (the race of one machine).
    import threading

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from hybridpar.train.launcher import _rendezvous
    from hybridpar.train.rendezvous import NETWORK_BACKEND

    address = _network_address()
    if address is None:
        pytest.skip("this machine has no network address besides loopback")
    port = free_port()
    backend, endpoint, local_addr = _rendezvous(f"{address}:{port}", single=False)
    assert (backend, endpoint, local_addr) == (NETWORK_BACKEND, f"{address}:{port}", None)
    handlers = [get_rendezvous_handler(RendezvousParameters(
        backend=backend, endpoint=endpoint, run_id="nodes", min_nodes=2, max_nodes=2,
        is_host=node == 0, rank=node, read_timeout=20)) for node in (0, 1)]
    infos: dict[int, object] = {}

    def join(node: int) -> None:
        infos[node] = handlers[node].next_rendezvous()

    try:
        threads = [threading.Thread(target=join, args=(node,)) for node in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert sorted(infos) == [0, 1], "a node did not join"
        stores = {node: info.bootstrap_store_info for node, info in infos.items()}
        assert stores[0] == stores[1] and stores[0].master_addr == address
        assert all(h.use_agent_store for h in handlers)
        workers = stores[0].master_port
        assert workers != port
        with socket.socket() as s, pytest.raises(OSError):   # held, not released
            s.bind(("", workers))
        wait = datetime.timedelta(seconds=20)
        client = dist.TCPStore(address, workers, None, False, timeout=wait)
        client.set("default_pg/0//rank_0", "a worker's address")
        assert dist.TCPStore(address, workers, None, False, timeout=wait).get(
            "default_pg/0//rank_0") == b"a worker's address"
    finally:
        for h in handlers:
            h.shutdown()


def test_a_rendezvous_backend_refuses_the_other_kind_of_endpoint() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from hybridpar.train.rendezvous import register_loopback_backend, register_network_backend

    for backend, endpoint, kind in ((register_loopback_backend(), "10.1.2.3:29500", "loopback"),
                                    (register_network_backend(), "127.0.0.1:29500",
                                     "network (not loopback)")):
        with pytest.raises(ValueError, match=re.escape(
                f"the {backend} rendezvous needs a {kind} endpoint, got '{endpoint}'")):
            get_rendezvous_handler(RendezvousParameters(
                backend=backend, endpoint=endpoint, run_id="x", min_nodes=1, max_nodes=1,
                is_host=True))


@LINUX
def test_runs_started_at_once_on_one_machine_never_collide(tiny: Path, tmp_path: Path) -> None:
    # Each worker group used to host its store on a port torch's agent had bound and
    # released: a run started at the same moment could take it in between.
    runs = [subprocess.Popen([*HYBRIDPAR, "run", str(tiny), "--run-dir", f"r{i}",
                              "--set", "train.steps=2", "--set", "checkpoint.every=0",
                              "--set", "train.sample_tokens=0"],
                             cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for i in range(3)]
    try:
        outputs = [run.communicate(timeout=240)[0] for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
    assert [run.returncode for run in runs] == [0, 0, 0], [o[-2000:] for o in outputs]
    for i in range(3):
        steps = [json.loads(line)["step"]
                 for line in (tmp_path / f"r{i}" / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2]


# a killed agent, a second run ----------------------------------------------------------------
@LINUX
def test_kill_9_of_the_agent_ends_its_workers_and_the_run_dir_is_held_until_then(
        tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    run_dir = tmp_path / "r"
    # Every checkpoint kept: the one exported below is not pruned while it is read.
    long = ["--set", "train.steps=1000000", "--set", "checkpoint.every=5",
            "--set", "checkpoint.keep=1000000", *QUIET]
    log = tmp_path / "agent.log"   # a file, not a pipe: nobody reads a pipe while it runs
    with log.open("w") as sink:
        agent = subprocess.Popen([*HYBRIDPAR, "run", str(tiny), "--run-dir", "r", *long],
                                 cwd=tmp_path, stdout=sink, stderr=subprocess.STDOUT)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 or not _complete(run_dir):
            assert agent.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint in 120 s"
            time.sleep(0.05)
            workers = worker_pids(run_dir)
        config = (run_dir / "config.json").read_bytes()

        # A second run into the held folder: one line naming the holder, nothing written.
        # (In this process: what it runs before it would start an agent is all there is.)
        monkeypatch.chdir(tmp_path)
        assert main(["run", str(tiny), "--run-dir", "r", "--set", "train.lr=0.5"]) == 2
        assert capsys.readouterr().err.strip() == (
            f"hybridpar run: error: the run directory r is in use by another run (pid "
            f"{agent.pid} on host {socket.gethostname()}, since {holder(run_dir)['since']}): "
            "wait for it to end or stop it, or give another --run-dir")
        assert (run_dir / "config.json").read_bytes() == config

        # Readers take no lock: export a checkpoint of the running run.
        step = _complete(run_dir)[-1]
        assert main(["export", str(run_dir / "checkpoints" / step), str(tmp_path / "x")]) == 0

        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=30)
        killed = time.monotonic()
        while any(_alive(pid) for pid in workers):
            assert time.monotonic() - killed < 5, f"workers {workers} outlived their agent"
            time.sleep(0.01)
        latest = _complete(run_dir)
        time.sleep(1.5)                     # nobody writes any more checkpoint
        assert _complete(run_dir) == latest
    finally:
        if agent.poll() is None:
            agent.kill()
        for pid in workers:                 # orphans of a failed test: not left running
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)

    # The next run takes the folder over and says whose it was (the lock is the one a real
    # run takes first; the rest of a run, resuming at the latest checkpoint included, is
    # tested in test_run_cli.py and test_recovery.py).
    assert agent.pid == json.loads((run_dir / LOCK_NAME).read_text())["pid"]   # not emptied
    with caplog.at_level(logging.WARNING), hold_run_dir(run_dir):
        pass
    assert f"held by pid {agent.pid} on host {socket.gethostname()}" in caplog.text
    assert "which ended without releasing it (killed?); taking it over" in caplog.text
    assert holder(run_dir) is None


def _train_held_then_free(held, free):
    """Rank 0 of a library-path run (`train`, no agent) into HELD, a folder another process
    holds, then into FREE: what each run returned or raised, on this rank."""
    from hybridpar.train import Config
    from hybridpar.train.trainer import train

    cfg = Config.from_dict({"model": {"name": "mlp", "in_features": 8, "hidden": 8,
                                      "out_features": 4, "n_layer": 2},
                            "parallel": {"pp": 2, "timeout": 30.0},
                            "train": {"steps": 1, "batch_size": 4, "sample_tokens": 0},
                            "checkpoint": {"every": 0}})
    out = []
    for run_dir in (held, free):
        try:
            out.append(train(cfg, run_dir, progress=False)["steps"])
        except Exception as e:
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_a_library_run_holds_its_run_dir_and_refuses_a_held_one_on_every_rank(tmp_path):
    """`train()` started without `hybridpar run` (torchrun, a notebook): rank 0 holds RUN_DIR
    for the run, and a folder another run holds is refused on every rank, naming it."""
    import hybridpar
    from hybridpar.io.run_lock import hold_run_dir, holder

    held, free = tmp_path / "held", tmp_path / "free"
    with hold_run_dir(held):         # the same ranks: refused there, then a run in FREE
        out = hybridpar.spawn(_train_held_then_free, 2, args=(str(held), str(free)),
                              timeout=120)
        assert holder(held)["pid"] == os.getpid()         # the refused run took nothing
    for refused, ran in out:
        assert refused.startswith("RunDirInUse: the run directory") and \
            f"(pid {os.getpid()} on host" in refused, out
        assert ran == 1, out
    assert not (held / "config.json").exists()               # nothing written
    assert holder(free) is None                              # released at the end
