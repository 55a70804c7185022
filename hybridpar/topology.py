"""Topology: which (dp, pp, tp) coordinate each rank holds, and the process groups of each dim.

Ranks are laid out with tp varying fastest, then pp, then dp, so tensor-parallel peers are
neighbours (the same node) and pipeline stages of one replica are contiguous blocks:

    dp=2, pp=2, tp=2      rank = (dp_rank * pp + pp_rank) * tp + tp_rank

    rank | 0 1 2 3 4 5 6 7
    dp   | 0 0 0 0 1 1 1 1
    pp   | 0 0 1 1 0 0 1 1
    tp   | 0 1 0 1 0 1 0 1

The rank math (`ParallelDims`) is pure; `Topology` adds the process groups, built from a
`torch.distributed` device mesh with dims ``("dp", "pp", "tp")``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from hybridpar.process.generation import current as current_generation
from hybridpar.process.generation import renew
from hybridpar.process.loopback import is_loopback, loopback_interface, loopback_store
from hybridpar.process.mesh import build_mesh, expert_groups

__all__ = [
    "DEFAULT_TIMEOUT",
    "Coordinate",
    "ParallelDims",
    "Topology",
    "current_topology",
    "default_ep_group",
    "default_tp_group",
    "forget",
    "init",
    "shutdown",
    "using",
]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


class Coordinate(NamedTuple):
    """Where a rank sits in the (dp, pp, tp) grid."""

    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of the three parallel dims, and the rank math between ranks and coordinates."""

    dp: int = 1
    pp: int = 1
    tp: int = 1
    ep: int = 1   # expert parallelism: carved out of dp (each ep group holds every expert)

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} does not divide dp={self.dp}: expert parallelism "
                             f"splits the data-parallel ranks into groups of ep; choose ep "
                             f"among {[d for d in range(1, self.dp + 1) if self.dp % d == 0]}")

    @classmethod
    def for_world(cls, world_size: int, *, pp: int = 1, tp: int = 1, dp: int | None = None,
                  ep: int = 1) -> ParallelDims:
        """The dims for `world_size` ranks; `dp` defaults to ``world_size // (pp * tp)``."""
        if pp < 1 or tp < 1:
            raise ValueError(f"pp and tp must be positive integers, got pp={pp}, tp={tp}")
        if dp is None:
            if world_size % (pp * tp) != 0:
                raise ValueError(
                    f"world size {world_size} is not divisible by pp * tp = {pp} * {tp} = "
                    f"{pp * tp}; launch a multiple of {pp * tp} ranks or change pp / tp"
                )
            dp = world_size // (pp * tp)
        if dp * pp * tp != world_size:
            raise ValueError(
                f"world size {world_size} != dp * pp * tp = {dp} * {pp} * {tp} = "
                f"{dp * pp * tp}; launch {dp * pp * tp} ranks or change the layout"
            )
        return cls(dp=dp, pp=pp, tp=tp, ep=ep)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def coordinate(self, rank: int) -> Coordinate:
        """The (dp, pp, tp) coordinate of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks")
        tp_rank = rank % self.tp
        pp_rank = (rank // self.tp) % self.pp
        dp_rank = rank // (self.tp * self.pp)
        return Coordinate(dp_rank, pp_rank, tp_rank)

    def rank(self, dp: int, pp: int, tp: int) -> int:
        """The global rank at a (dp, pp, tp) coordinate."""
        for name, value, size in (("dp", dp, self.dp), ("pp", pp, self.pp), ("tp", tp, self.tp)):
            if not 0 <= value < size:
                raise ValueError(f"{name} coordinate {value} is outside 0..{size - 1}")
        return (dp * self.pp + pp) * self.tp + tp


class Topology:
    """This rank's place in the (dp, pp, tp) grid, with the process group of each dim."""

    def __init__(self, dims: ParallelDims, rank: int, mesh: DeviceMesh | None,
                 *, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                 device: torch.device | None = None, p2p_tags: bool = False,
                 generation: int = 0,
                 expert_groups: tuple[ProcessGroup, ProcessGroup] | None = None) -> None:
        self.dims = dims
        self.expert_groups = expert_groups   # (ep group, expert dp group): `expert_groups`
        self.generation = generation   # of the process groups (`hybridpar.process.generation`)
        self.rank = rank
        self.mesh = mesh
        self.timeout = timeout
        self.coordinate = dims.coordinate(rank)
        self.device = device if device is not None else torch.device("cpu")
        self.p2p_tags = p2p_tags   # each P2P channel its own tag (gloo debugging aid)

    # sizes and coordinates ----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def tp(self) -> int:
        return self.dims.tp

    @property
    def ep(self) -> int:
        return self.dims.ep

    @property
    def dp_rank(self) -> int:
        return self.coordinate.dp

    @property
    def ep_rank(self) -> int:
        """This rank's place in its ep group: ``dp_rank % ep`` (`expert_groups`)."""
        return self.coordinate.dp % self.dims.ep

    @property
    def pp_rank(self) -> int:
        return self.coordinate.pp

    @property
    def tp_rank(self) -> int:
        return self.coordinate.tp

    def global_rank(self, dp: int, pp: int, tp: int) -> int:
        """The global rank at a (dp, pp, tp) coordinate."""
        return self.dims.rank(dp, pp, tp)

    def stage_rank(self, stage: int) -> int:
        """The rank holding `stage` in this rank's pipeline, at this rank's dp and tp."""
        return self.dims.rank(self.dp_rank, stage, self.tp_rank)

    # groups -------------------------------------------------------------------------------
    def _group(self, name: str) -> ProcessGroup:
        if self.mesh is None:
            raise RuntimeError("this Topology has no process groups (built without a mesh)")
        return self.mesh.get_group(name)

    @property
    def dp_group(self) -> ProcessGroup:
        return self._group("dp")

    @property
    def pp_group(self) -> ProcessGroup:
        return self._group("pp")

    @property
    def tp_group(self) -> ProcessGroup:
        return self._group("tp")

    @property
    def ep_group(self) -> ProcessGroup:
        """The ep ranks whose experts together make every expert (`expert_groups`)."""
        return self._expert_group(0)

    @property
    def expert_dp_group(self) -> ProcessGroup:
        """The dp ranks holding the same experts: their gradients are summed over it."""
        return self._expert_group(1)

    def _expert_group(self, which: int) -> ProcessGroup:
        if self.expert_groups is None:
            raise RuntimeError("this Topology has no expert groups (built without ep groups)")
        return self.expert_groups[which]

    def __repr__(self) -> str:
        d = self.dims
        c = self.coordinate
        ep = f", ep={d.ep}" if d.ep > 1 else ""
        return (f"Topology(rank={self.rank}, dp={d.dp}, pp={d.pp}, tp={d.tp}{ep}, "
                f"dp_rank={c.dp}, pp_rank={c.pp}, tp_rank={c.tp})")


_current: Topology | None = None


def _as_timedelta(timeout: float | datetime.timedelta | None) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return datetime.timedelta(seconds=float(timeout))


def _p2p_tags(value: bool | None) -> bool:
    """`p2p_tags`, or ``HYBRIDPAR_P2P_TAGS`` (1 / 0) when None; default off (order only)."""
    if value is not None:
        return bool(value)
    text = os.environ.get("HYBRIDPAR_P2P_TAGS", "0").strip().lower()
    if text not in ("0", "1", "", "false", "true"):
        raise ValueError(f"HYBRIDPAR_P2P_TAGS must be 0 or 1, got {text!r}")
    return text in ("1", "true")


def init(*, pp: int = 1, tp: int = 1, dp: int | None = None, ep: int = 1,
         backend: str | None = None, timeout: float | datetime.timedelta | None = None,
         p2p_tags: bool | None = None) -> Topology:
    """Initialize `torch.distributed` (if needed) and the (dp, pp, tp) grid; returns the Topology.

    Reads the torchrun variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)
    when the default process group is not initialized yet; with a loopback ``MASTER_ADDR`` (one
    machine) rank 0's store listens on that address only. `backend` defaults to nccl when
    CUDA is available, else gloo. With nccl each rank takes ``cuda:LOCAL_RANK`` (set before
    the process group, passed as its `device_id`) and gets gloo for CPU tensors too
    (``"cpu:gloo,cuda:nccl"``); a rank that sees no such GPU raises instead of training on
    the CPU. `topology.device` is that device (the CPU with gloo). `timeout` (seconds or
    timedelta) bounds every wait. `ep` > 1 splits the dp ranks into expert-parallel groups
    of ep (`expert_groups`): each holds every expert once, E / ep on each rank.
    The topology becomes the default one read by `hybridpar.nn` layers.

    Pipeline messages match by order alone, as NCCL matches them: every P2P op uses tag 0.
    ``p2p_tags=True`` (or ``HYBRIDPAR_P2P_TAGS=1``) gives each channel its own tag instead,
    which gloo honours and NCCL ignores: a debugging aid (a run that differs between the two
    modes has an ordering bug).
    """
    global _current
    wait = _as_timedelta(timeout)
    tags = _p2p_tags(p2p_tags)
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError(
                "torch.distributed is not initialized and RANK / WORLD_SIZE are not set; "
                "launch with torchrun or `hybridpar run`, or use hybridpar.spawn(fn, nprocs)"
            )
        if backend is None:
            backend = os.environ.get("HYBRIDPAR_BACKEND") or (
                "nccl" if torch.cuda.is_available() else "gloo")
        # A bad layout fails here, on every rank alike, before any rank connects to another.
        ParallelDims.for_world(int(os.environ["WORLD_SIZE"]), pp=pp, tp=tp, dp=dp, ep=ep)
        device_id = None
        if backend == "nccl":
            device_id = _cuda_device()
            torch.cuda.set_device(device_id)
            # CPU tensors (agreement flags, abort text) go over gloo, CUDA tensors over NCCL
            backend = "cpu:gloo,cuda:nccl"
        _init_default_group(backend, wait, device_id)
    else:   # after a failed step broke the groups: a new generation of them (gloo)
        renew(wait)
    dims = ParallelDims.for_world(dist.get_world_size(), pp=pp, tp=tp, dp=dp, ep=ep)
    device_type = "cuda" if "nccl" in dist.get_backend() else "cpu"
    mesh = build_mesh(dims.dp, dims.pp, dims.tp, dist.get_rank(), device_type, timeout=wait)
    groups = expert_groups(dims.dp, dims.ep, dims.pp, dims.tp, dist.get_rank(),
                           timeout=wait) if dims.ep > 1 else None
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" \
        else torch.device("cpu")
    _current = Topology(dims, dist.get_rank(), mesh, timeout=wait, device=device,
                        p2p_tags=tags, generation=current_generation(),
                        expert_groups=groups)
    return _current


def _cuda_device() -> torch.device:
    """This rank's GPU, ``cuda:LOCAL_RANK``; raises when a GPU job would land on the CPU."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local >= count:
        why = ("this torch is a CPU build" if torch.version.cuda is None else
               f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!r}")
        raise RuntimeError(
            f"backend nccl needs GPU {local} (LOCAL_RANK) but this process sees {count} GPUs "
            f"({why}); install a CUDA build of torch and launch one rank per GPU, or train "
            "on CPU with backend='gloo' (HYBRIDPAR_BACKEND=gloo)")
    return torch.device("cuda", local)


def _init_default_group(backend: str, wait: datetime.timedelta,
                        device_id: torch.device | None = None) -> None:
    """`init_process_group` from the torchrun variables; a loopback MASTER_ADDR stays local."""
    addr = os.environ.get("MASTER_ADDR", "")
    local = is_loopback(addr)
    interface = loopback_interface() if local else None
    if interface is not None:
        # Every rank is on this machine (none elsewhere could reach a loopback address), so
        # gloo's own listeners can stay on the loopback interface too, instead of the address
        # the host name resolves to. A GLOO_SOCKET_IFNAME set by the user wins.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    # torchrun's agent may host the store at MASTER_PORT already (TORCHELASTIC_USE_AGENT_STORE):
    # then every rank is a client of it, exactly what env:// does, and rank 0 must not bind.
    # A non-loopback address means ranks on other machines: torch's all-interface store.
    if not local or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend=backend, timeout=wait, device_id=device_id)
        return
    if not os.environ.get("MASTER_PORT", "").isdigit():
        raise RuntimeError(f"MASTER_PORT must be a port number, got "
                           f"{os.environ.get('MASTER_PORT')!r}")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # torch's env:// store would listen on every interface; this one only at MASTER_ADDR.
    store = loopback_store(addr, int(os.environ["MASTER_PORT"]), is_server=rank == 0,
                           world_size=world, timeout=wait)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world,
                            timeout=wait, device_id=device_id)


def current_topology() -> Topology:
    """The topology set by `hybridpar.init`; raises `RuntimeError` before it."""
    if _current is None:
        raise RuntimeError(
            "hybridpar is not initialized: call hybridpar.init(pp=..., tp=...) first "
            "(or pass group= to the layer)"
        )
    return _current


def default_ep_group() -> ProcessGroup:
    """The expert-parallel group of the current topology (what experts use without group=)."""
    return current_topology().ep_group


def default_tp_group() -> ProcessGroup:
    """The tensor-parallel group of the current topology (what layers use without group=)."""
    return current_topology().tp_group


def shutdown() -> None:
    """Forget the current topology and destroy the default process group (if any)."""
    global _current
    _current = None
    if dist.is_initialized():
        dist.destroy_process_group()


def forget() -> None:
    """Forget the current topology, keeping the process group (torchshard's
    ``destroy_process_group`` forgets its model-parallel group the same way)."""
    global _current
    _current = None


@contextlib.contextmanager
def using(topology: Topology) -> Iterator[Topology]:
    """`topology` as the current one (what `init` sets) inside the block, then the previous
    one again (`hybridpar check` runs every rank's step in one process this way)."""
    global _current
    before, _current = _current, topology
    try:
        yield topology
    finally:
        _current = before
