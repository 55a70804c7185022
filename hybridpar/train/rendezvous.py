"""The agent's rendezvous: torch's c10d one, and a store the host agent holds for each
attempt's workers.

    backend              endpoint                 rendezvous store, workers' store listen on
    hybridpar-loopback   127.x, ::1, localhost    that loopback address only
    hybridpar-c10d       a network HOST:PORT      every interface (other machines reach them)

The workers' process group needs a store. torch's agent, when it does not share its own,
picks a port by binding port 0 and closing it, and the workers' rank 0 binds that number
again a moment later: in between any process may take it (two runs started at once on one
machine did: "cannot host the rendezvous store ... the port is in use"). Here the host node's
agent binds the workers' store itself (port 0: the kernel's pick, never released), before it
starts them, and holds it while they run (``TORCHELASTIC_USE_AGENT_STORE=True``: every worker,
on every node, is a client of it; its port reaches the other nodes through the rendezvous
store). Each attempt (a restart after ``--max-restarts``) gets a new one: the keys of the
attempt before it (gloo's addresses of processes that are gone) are never read again. torch's
own shared store would be one for every attempt (its stale keys broke restarts).
"""

from __future__ import annotations

import datetime
import os

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from hybridpar.process.loopback import bind_host, is_loopback, loopback_store

__all__ = ["LOOPBACK_BACKEND", "NETWORK_BACKEND", "register_loopback_backend",
           "register_network_backend"]

LOOPBACK_BACKEND = "hybridpar-loopback"
NETWORK_BACKEND = "hybridpar-c10d"
_WORKERS_PORT = "hybridpar/workers_store_port"   # in each round's namespace


class _NamedBackend(C10dRendezvousBackend):
    """torch's c10d rendezvous state over our store, under our backend's name."""

    def __init__(self, store: dist.Store, run_id: str, name: str) -> None:
        super().__init__(store, run_id)
        self._name = name

    # The registry checks that the handler it built reports the backend name asked for.
    @property
    def name(self) -> str:
        return self._name


def _serve(host: str, port: int, *, loopback: bool, timeout: datetime.timedelta
           ) -> dist.TCPStore:
    """A store's server at (host, port) (0: a port the kernel picks): on that loopback
    address only, or (a network host) on every interface, as torch's."""
    if loopback:
        return loopback_store(host, port, is_server=True, timeout=timeout)
    return dist.TCPStore(host, port, None, True, timeout=timeout, wait_for_workers=False,
                         multi_tenant=True, use_libuv=os.environ.get("USE_LIBUV", "1") == "1")


class _SharedStoreHandler(RendezvousHandler):
    """torch's dynamic rendezvous handler; each round, the workers' store from the host node."""

    def __init__(self, inner: RendezvousHandler, host: str, *, is_host: bool, loopback: bool,
                 timeout: datetime.timedelta) -> None:
        self._inner = inner
        self._host, self._is_host, self._timeout = host, is_host, timeout
        self._loopback = loopback
        self._workers_store: dist.TCPStore | None = None   # the host node's, this round's

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        # info.store is this round's namespace of the rendezvous store: a port found there
        # was published in this round. The last round's workers have all ended (the agent
        # stops them before it joins again), and so may their store.
        if self._is_host:
            self._workers_store = None
            self._workers_store = _serve(self._host, 0, loopback=self._loopback,
                                         timeout=self._timeout)
            info.store.set(_WORKERS_PORT, str(self._workers_store.port))
        port = int(info.store.get(_WORKERS_PORT))
        return RendezvousInfo(info.store, info.rank, info.world_size,
                              RendezvousStoreInfo(self._host, port))

    def get_backend(self) -> str:
        return self._inner.get_backend()

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        self._workers_store = None
        return self._inner.shutdown()


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    # The same handler as torch's "c10d" backend (dynamic rendezvous over a TCPStore); only
    # the stores differ: a loopback one listens there only, and the workers' store is the
    # host agent's (`_SharedStoreHandler`). The agent builds the handler once and rendezvous
    # again through it on each restart, so one store serves the whole run. is_host is always
    # given by the launcher: no guessing from host names.
    name = params.backend
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    loopback = name == LOOPBACK_BACKEND
    if loopback != is_loopback(host):
        raise ValueError(f"the {name} rendezvous needs a "
                         f"{'loopback' if loopback else 'network (not loopback)'} endpoint, "
                         f"got {params.endpoint!r}")
    is_host = params.get_as_bool("is_host")
    if is_host is None:
        raise ValueError(f"the {name} rendezvous needs rdzv_configs['is_host']")
    read_timeout = params.get_as_int("read_timeout", 60)  # torch's c10d default
    if read_timeout is None or read_timeout <= 0:
        raise ValueError(f"read_timeout must be a positive integer, got {read_timeout!r}")
    if not is_host and port == 0:
        raise ValueError(f"a rendezvous client needs the host's port, got {params.endpoint!r}")
    timeout = datetime.timedelta(seconds=read_timeout)
    host = bind_host(host) if loopback else host
    store = _serve(host, port, loopback=loopback, timeout=timeout) if is_host else \
        dist.TCPStore(host, port, None, False, timeout=timeout)
    # torch's handler, sharing its store, would start a server of its own for the workers,
    # on every interface and for every attempt; told not to, it only notes a free port that
    # nobody uses (the workers get the store of _SharedStoreHandler instead).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    inner = create_handler(store, _NamedBackend(store, params.run_id, name), params)
    return _SharedStoreHandler(inner, host, is_host=is_host, loopback=loopback,
                               timeout=timeout)


def register_loopback_backend() -> str:
    """Register the loopback rendezvous with torch's elastic registry; returns its name."""
    # Registering the same creator again is a no-op, so every launch may call this.
    rendezvous_handler_registry.register(LOOPBACK_BACKEND, _create_handler)
    return LOOPBACK_BACKEND


def register_network_backend() -> str:
    """Register the network rendezvous (a non-loopback endpoint, nodes on several machines)
    with torch's elastic registry; returns its name."""
    rendezvous_handler_registry.register(NETWORK_BACKEND, _create_handler)
    return NETWORK_BACKEND
