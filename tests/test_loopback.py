"""One machine's rendezvous listens on loopback only: the store helper, init, `hybridpar run`.

Listening sockets are read from /proc/net/tcp and /proc/net/tcp6 (state 0A is LISTEN), and
tied to processes through the ``socket:[inode]`` links in /proc/PID/fd (Linux only).
"""

from __future__ import annotations

import datetime
import gc
import ipaddress
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

import hybridpar
from hybridpar.process.loopback import bind_host, is_loopback, loopback_interface, loopback_store
from hybridpar.train.launcher import _rendezvous

pytestmark = pytest.mark.skipif(not Path("/proc/net/tcp").is_file(),
                                reason="reads listening sockets from /proc/net (Linux)")

TINY = Path(__file__).parent / "data" / "tiny_gpt.toml"   # 2 workers
SHORT = datetime.timedelta(seconds=20)


def _listening() -> Iterator[tuple[str, int, int]]:
    """(address, port, inode) of every listening TCP socket of this network namespace."""
    for name in ("tcp", "tcp6"):
        try:
            lines = (Path("/proc/net") / name).read_text().splitlines()[1:]
        except OSError:  # no IPv6 here
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != "0A":
                continue
            hex_addr, hex_port = fields[1].split(":")
            # Each 32-bit word is printed as the host-order integer of the network bytes.
            raw = b"".join(struct.pack("=I", int(hex_addr[i:i + 8], 16))
                           for i in range(0, len(hex_addr), 8))
            yield str(ipaddress.ip_address(raw)), int(hex_port, 16), int(fields[9])


def _addresses(port: int) -> set[str]:
    """The addresses any process listens on at `port`."""
    return {addr for addr, p, _ in _listening() if p == port}


def _own_addresses(port: int) -> set[str]:
    """The addresses this process listens on at `port` (another process, a parallel test's,
    may listen at the same number on another address)."""
    return {addr for addr, p in _own_listeners() if p == port}


def _socket_inodes(pid: int | str) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # the process ended
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[len("socket:["):-1]))
    return inodes


def _own_listeners(pid: int | str = "self") -> set[tuple[str, int]]:
    mine = _socket_inodes(pid)
    return {(addr, port) for addr, port, inode in _listening() if inode in mine}


def _process_tree(root: int, parents: dict[int, int]) -> list[int]:
    """`root` and every process it started, and theirs. `parents` (pid -> parent pid), kept
    between calls, spares re-reading the stat of a process seen before (each poll read every
    process's: half a poll's CPU); a pid gone from /proc is forgotten (its number may be
    reused), and one reparented after its parent ended stays in the tree."""
    running = {int(name) for name in os.listdir("/proc") if name.isdigit()}
    for pid in parents.keys() - running:
        del parents[pid]
    for pid in running - parents.keys():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])   # the name in (...) may hold spaces
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _is_loopback_address(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_loopback


# the helper ----------------------------------------------------------------------------------
def test_loopback_names():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.1.2.3", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "example.com", ""))
    assert bind_host("localhost") == "127.0.0.1" and bind_host("[::1]") == "::1"
    with pytest.raises(ValueError, match="not a loopback address"):
        bind_host("10.0.0.1")


def test_the_listener_check_sees_a_wildcard_listener():
    # The control for every test below: a socket on all interfaces is reported as such.
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        assert _own_addresses(port) == {"0.0.0.0"}
        assert ("0.0.0.0", port) in _own_listeners()


def test_the_store_listens_on_loopback_only_and_serves_clients():
    server = loopback_store("localhost", 0, is_server=True, timeout=SHORT)
    port = server.port
    assert port > 0 and _own_addresses(port) == {"127.0.0.1"}
    client = loopback_store("localhost", port, is_server=False, timeout=SHORT)
    client.set("key", "value")
    assert server.get("key") == b"value"
    # The store took the listening fd over: dropping it frees the port (nothing half-alive).
    del client, server
    gc.collect()
    assert _own_addresses(port) == set()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_the_store_waits_for_world_size_clients():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="1/2 clients joined"):
        loopback_store("127.0.0.1", port, is_server=True, world_size=2,
                       timeout=datetime.timedelta(seconds=1))
    assert time.monotonic() - start < 10
    assert _own_addresses(port) == set()   # the failed store closed its listener


def test_a_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}: the port is in use"):
            loopback_store("127.0.0.1", port, is_server=True, timeout=SHORT)


@pytest.mark.skipif(not socket.has_ipv6 or not Path("/proc/net/tcp6").is_file(),
                    reason="no IPv6")
def test_an_ipv6_loopback_store():
    try:
        server = loopback_store("::1", 0, is_server=True, timeout=SHORT)
    except OSError as e:   # IPv6 compiled in but ::1 not configured
        pytest.skip(f"::1 unusable here: {e}")
    assert _own_addresses(server.port) == {"::1"}
    client = loopback_store("[::1]", server.port, is_server=False, timeout=SHORT)
    client.set("k", "v")
    assert server.get("k") == b"v"


def test_the_launcher_picks_the_loopback_rendezvous_for_one_machine():
    assert _rendezvous(None, single=True) == ("hybridpar-loopback", "127.0.0.1:0", "127.0.0.1")
    assert _rendezvous("localhost:29500", single=False) == (
        "hybridpar-loopback", "localhost:29500", "127.0.0.1")
    assert _rendezvous("10.1.2.3:29500", single=False) == (
        "hybridpar-c10d", "10.1.2.3:29500", None)


def test_the_elastic_rendezvous_store_listens_on_loopback_only():
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from hybridpar.train.rendezvous import register_loopback_backend

    backend = register_loopback_backend()
    assert register_loopback_backend() == backend            # registering again is harmless
    params = RendezvousParameters(backend=backend, endpoint="127.0.0.1:0", run_id="t",
                                  min_nodes=1, max_nodes=1, local_addr="127.0.0.1",
                                  is_host=True)
    before = _own_listeners()
    handler = get_rendezvous_handler(params)
    try:
        new = _own_listeners() - before
        assert len(new) == 1 and {addr for addr, _ in new} == {"127.0.0.1"}
        info = handler.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert info.bootstrap_store_info.master_addr == "127.0.0.1"
    finally:
        handler.shutdown()


# hybridpar.init on ranks ---------------------------------------------------------------------
def _rank_listeners() -> dict[str, object]:
    hybridpar.init(timeout=30)
    dist.barrier()   # every rank is up: rank 0's store has all its clients
    listeners = sorted(_own_listeners())
    dist.barrier()   # nobody exits (and closes sockets) before everybody has looked
    return {"rank": dist.get_rank(), "port": int(os.environ["MASTER_PORT"]),
            "listeners": [list(x) for x in listeners], "store": sorted(_addresses(
                int(os.environ["MASTER_PORT"]))),
            "gloo": os.environ.get("GLOO_SOCKET_IFNAME", "")}


def test_spawned_ranks_rendezvous_on_loopback_only():
    out = hybridpar.spawn(_rank_listeners, 2, timeout=60)
    port = out[0]["port"]
    assert out[0]["store"] == ["127.0.0.1"]               # no 0.0.0.0 / :: entry for the port
    assert ["127.0.0.1", port] in out[0]["listeners"]     # and it is rank 0's
    for o in out:   # the store and gloo's own listeners alike
        assert o["listeners"] and all(_is_loopback_address(a) for a, _ in o["listeners"]), o
        assert o["gloo"] == (loopback_interface() or "")


def _init_only() -> list[object]:
    hybridpar.init(timeout=30)
    dist.barrier()
    return [dist.get_world_size(), os.environ.get("GLOO_SOCKET_IFNAME", "")]


def test_ranks_join_a_store_the_agent_already_hosts():
    # torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE=True): rank 0 must be a client
    # too; had it tried to host the store, the port would have been in use.
    agent = loopback_store("127.0.0.1", 0, is_server=True, timeout=SHORT)
    env = {"MASTER_PORT": str(agent.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert hybridpar.spawn(_init_only, 2, env=env, timeout=60) == \
        [[2, loopback_interface() or ""]] * 2


def test_a_master_port_in_use_fails_rank_zero_clearly():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(hybridpar.SpawnError, match="rank 0 failed") as info:
            hybridpar.spawn(_init_only, 1, env={"MASTER_PORT": str(port)}, timeout=60)
    assert f"127.0.0.1:{port}: the port is in use" in info.value.trace


# hybridpar run -------------------------------------------------------------------------------
def test_hybridpar_run_listens_on_loopback_only(tmp_path: Path):
    config = tmp_path / "tiny.toml"
    config.write_text(TINY.read_text())
    log = tmp_path / "run.log"
    seen: dict[tuple[str, int], int] = {}   # every listener of the run's processes -> its pid
    parents: dict[int, int] = {}
    with log.open("w") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "hybridpar.cli", "run", str(config), "--run-dir", "r",
             "--set", "train.steps=3", "--set", "train.sample_tokens=0",
             "--set", "checkpoint.every=0"],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        try:
            while agent.poll() is None:
                assert time.monotonic() < deadline, "the run did not end in 120 s"
                owners = {inode: pid for pid in _process_tree(agent.pid, parents)
                          for inode in _socket_inodes(pid)}
                for addr, port, inode in _listening():
                    if inode in owners:
                        seen[(addr, port)] = owners[inode]
                time.sleep(0.05)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait(timeout=30)
    assert agent.returncode == 0, log.read_text()[-3000:]
    # Seen at all: the agent's rendezvous store, and the workers' store and gloo listeners.
    assert agent.pid in seen.values(), seen
    assert any(pid != agent.pid for pid in seen.values()), seen
    assert all(_is_loopback_address(addr) for addr, _ in seen), seen
