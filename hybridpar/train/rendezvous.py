"""The agent's rendezvous at a loopback endpoint: torch's c10d one with a loopback-only store."""

from __future__ import annotations

import datetime

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from hybridpar.process.loopback import is_loopback, loopback_store

__all__ = ["LOOPBACK_BACKEND", "register_loopback_backend"]

LOOPBACK_BACKEND = "hybridpar-loopback"


class _LoopbackBackend(C10dRendezvousBackend):
    """torch's c10d rendezvous state over our store, under our backend's name."""

    # The registry checks that the handler it built reports the backend name asked for.
    @property
    def name(self) -> str:
        return LOOPBACK_BACKEND


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
    return create_handler(store, _LoopbackBackend(store, params.run_id), params)


def register_loopback_backend() -> str:
    """Register the loopback rendezvous with torch's elastic registry; returns its name."""
    # Registering the same creator again is a no-op, so every launch may call this.
    rendezvous_handler_registry.register(LOOPBACK_BACKEND, _create_handler)
    return LOOPBACK_BACKEND
