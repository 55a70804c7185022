"""The agent's rendezvous at a loopback endpoint: torch's c10d one with a loopback-only store,
and a store the agent holds for each attempt's workers.

The workers' process group needs a store. torch's agent, when it does not share its own,
picks a port by binding port 0 and closing it, and the workers' rank 0 binds that number
again a moment later: in between any process may take it (two runs started at once on one
machine did: "cannot host the rendezvous store ... the port is in use"). Here the host node's
agent binds the workers' store itself, before it starts them, and holds it while they run
(``TORCHELASTIC_USE_AGENT_STORE=True``: every worker is a client of it). Each attempt (a
restart after ``--max-restarts``) gets a new one: the keys of the attempt before it (gloo's
addresses of processes that are gone) are never read again. torch's own shared store would
be one for every attempt (its stale keys broke restarts) and listens on every interface.
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

__all__ = ["LOOPBACK_BACKEND", "register_loopback_backend"]

LOOPBACK_BACKEND = "hybridpar-loopback"
_WORKERS_PORT = "hybridpar/workers_store_port"   # in each round's namespace


class _LoopbackBackend(C10dRendezvousBackend):
    """torch's c10d rendezvous state over our store, under our backend's name."""

    # The registry checks that the handler it built reports the backend name asked for.
    @property
    def name(self) -> str:
        return LOOPBACK_BACKEND


class _SharedStoreHandler(RendezvousHandler):
    """torch's dynamic rendezvous handler; each round, the workers' store from the host node."""

    def __init__(self, inner: RendezvousHandler, host: str, *, is_host: bool,
                 timeout: datetime.timedelta) -> None:
        self._inner = inner
        self._host, self._is_host, self._timeout = host, is_host, timeout
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
            self._workers_store = loopback_store(self._host, 0, is_server=True,
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
    # the store differs: torch's would listen on every interface. The agent builds the
    # handler once and rendezvous again through it on each restart, so one store serves the
    # whole run. is_host is always given by the launcher: no guessing from host names.
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    if not is_loopback(host):
        raise ValueError(f"the {LOOPBACK_BACKEND} rendezvous needs a loopback endpoint, got "
                         f"{params.endpoint!r}")
    is_host = params.get_as_bool("is_host")
    if is_host is None:
        raise ValueError(f"the {LOOPBACK_BACKEND} rendezvous needs rdzv_configs['is_host']")
    read_timeout = params.get_as_int("read_timeout", 60)  # torch's c10d default
    if read_timeout is None or read_timeout <= 0:
        raise ValueError(f"read_timeout must be a positive integer, got {read_timeout!r}")
    if not is_host and port == 0:
        raise ValueError(f"a rendezvous client needs the host's port, got {params.endpoint!r}")
    store = loopback_store(host, port, is_server=is_host,
                           timeout=datetime.timedelta(seconds=read_timeout))
    # torch's handler, sharing its store, would start a server of its own for the workers,
    # on every interface and for every attempt; told not to, it only notes a free port that
    # nobody uses (the workers get the store of _SharedStoreHandler instead).
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    inner = create_handler(store, _LoopbackBackend(store, params.run_id), params)
    return _SharedStoreHandler(inner, bind_host(host), is_host=is_host,
                               timeout=datetime.timedelta(seconds=read_timeout))


def register_loopback_backend() -> str:
    """Register the loopback rendezvous with torch's elastic registry; returns its name."""
    # Registering the same creator again is a no-op, so every launch may call this.
    rendezvous_handler_registry.register(LOOPBACK_BACKEND, _create_handler)
    return LOOPBACK_BACKEND
