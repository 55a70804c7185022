"""Loopback-only rendezvous: a TCPStore listening on 127.0.0.1 (or ::1), not on every interface."""

from __future__ import annotations

import datetime
import errno
import ipaddress
import os
import socket
from pathlib import Path

import torch.distributed as dist

__all__ = ["bind_host", "is_loopback", "loopback_interface", "loopback_store"]

# ARPHRD_LOOPBACK, the link type Linux reports in /sys/class/net/<name>/type for loopback.
_ARPHRD_LOOPBACK = "772"


def is_loopback(host: str) -> bool:
    """Whether `host` names this machine's loopback: 127.x.x.x, ``::1`` or ``localhost``."""
    name = host.strip().strip("[]").lower()
    if name in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # a host name: resolving it could give anything, so it is not loopback
        return False


def bind_host(host: str) -> str:
    """The address a loopback `host` is bound and connected at (``localhost`` -> 127.0.0.1).

    ``localhost`` may resolve to 127.0.0.1 or ::1 depending on the machine; the server and
    every client must agree, so the name is pinned to the IPv4 address on both sides.
    """
    if not is_loopback(host):
        raise ValueError(f"{host!r} is not a loopback address")
    name = host.strip().strip("[]").lower()
    return "127.0.0.1" if name.startswith("localhost") else name


def _listen_fd(host: str, port: int) -> tuple[int, int]:
    """A socket bound to (host, port) and listening: its fd (the caller owns it) and port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # As torch does for its own listener: a port left in TIME_WAIT by the previous run (a
        # restart) can be bound again at once. A port that something still listens on cannot.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise OSError(e.errno, f"cannot host the rendezvous store at {host}:{port}: the "
                              "port is in use (another run, or a process left over from one); "
                              "choose another port (MASTER_PORT / --rdzv-endpoint)") from None
            raise
        sock.listen(socket.SOMAXCONN)
        port = int(sock.getsockname()[1])  # the kernel's choice when `port` was 0
    except BaseException:
        sock.close()
        raise
    # TCPStore does not dup `master_listen_fd`: it takes the fd over and closes it when the
    # store (or its failed constructor) is destroyed. Closing the Python socket as well would
    # close the listener under the running store (clients then hang), so hand the fd over.
    return sock.detach(), port


def loopback_store(host: str, port: int, *, is_server: bool, world_size: int | None = None,
                   timeout: datetime.timedelta) -> dist.TCPStore:
    """A `TCPStore` at a loopback (host, port) whose server listens on that address only.

    torch's own server listens on ``*:port`` whatever `host` says, so any machine that can
    reach this one could talk to it. Here the server side binds the listening socket itself
    and passes it as ``master_listen_fd``; clients connect as usual. With `world_size` the
    server waits (up to `timeout`) until that many stores, itself included, have connected.
    `port` 0 binds a free port (``store.port``). Raises `OSError` when the port is in use.
    """
    address = bind_host(host)
    if not is_server:
        return dist.TCPStore(address, port, world_size, False, timeout=timeout)
    fd, port = _listen_fd(address, port)
    # torch's env:// store uses libuv unless USE_LIBUV=0; both accept master_listen_fd.
    use_libuv = os.environ.get("USE_LIBUV", "1") == "1"
    return dist.TCPStore(address, port, world_size, True, timeout=timeout,
                         master_listen_fd=fd, use_libuv=use_libuv)


def loopback_interface() -> str | None:
    """The name of the loopback network interface (``lo`` on Linux); None when unknown."""
    net = Path("/sys/class/net")
    try:
        names = sorted(p.name for p in net.iterdir())
    except OSError:  # not Linux
        return None
    for name in names:
        try:
            if (net / name / "type").read_text().strip() == _ARPHRD_LOOPBACK:
                return name
        except OSError:
            continue
    return None
