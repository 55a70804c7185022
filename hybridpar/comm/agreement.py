"""Errors raised on every rank: a check that fails on some ranks fails on all of them alike.

A check that each rank runs on its own part (its stage's keys, its shard's shapes) may fail on
some ranks only; the others would walk into the next collective and wait for peers that are
gone. ``with fail_together(ErrorType):`` runs the check, then every rank learns whether any
failed, with two small collectives and no pickles:

    step                          every rank
    1. all-reduce MIN             the lowest rank that failed (world size: none failed)
    2. broadcast from it          its message as UTF-8 bytes (length and type first, then the
                                  bytes)
    3. raise                      the failing rank re-raises its own error; the others raise
                                  the same type with its message and rank
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["agreement_device", "fail_together"]


def _device_type(backend: str) -> str:
    """The device type of the agreement's tensors on a group of `backend` (`dist.get_backend`).

        backend                  devices it carries   agreement on
        "gloo", "mpi", "fake"    cpu, cuda, ...       cpu
        "cpu:gloo,cuda:nccl"     cpu, cuda            cpu (gloo): control traffic never syncs
                                                      a GPU (DESIGN §9)
        "nccl", "cuda:nccl"      cuda                 cuda (NCCL refuses CPU tensors)

    A group given several backends (``"dev:backend,..."``, what `hybridpar.init` makes of
    nccl) is named by that whole string, never ``"nccl"``: read it by device, not by name.
    """
    name = str(backend).lower()
    if ":" in name:
        devices = [pair.split(":", 1)[0].strip() for pair in name.split(",")]
    else:   # one backend for every device it supports (torch assumes cpu and cuda if unknown)
        devices = list(dist.Backend.backend_capability.get(name, ["cpu", "cuda"]))
    return "cpu" if "cpu" in devices else devices[0]


def agreement_device(group: ProcessGroup | None) -> torch.device:
    """The device of a decision's tensors on `group`: the CPU where it has gloo (`_device_type`)."""
    kind = _device_type(dist.get_backend(group))
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


@contextmanager
def fail_together(error_type: type[Exception] | tuple[type[Exception], ...], *,
                  group: ProcessGroup | None = None) -> Iterator[None]:
    """Run the block; if it raises `error_type` on any rank of `group`, raise on every rank.

    `error_type` may be a tuple of types: the other ranks raise the same type as the failing
    rank did (the first of the tuple that it is an instance of). Outside an initialized process
    group the block runs as is. Other exceptions pass through untouched (and may leave peers
    waiting, as before).
    """
    if not dist.is_initialized():
        yield
        return
    types = error_type if isinstance(error_type, tuple) else (error_type,)
    error: Exception | None = None
    try:
        yield
    except types as e:
        error = e
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = agreement_device(group)
    first = torch.tensor([rank if error is not None else world], device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
    src = int(first.item())
    if src == world:
        return
    message = str(error).encode() if rank == src else b""
    kind = next(i for i, t in enumerate(types) if isinstance(error, t)) \
        if rank == src else 0
    header = torch.tensor([len(message), kind], device=device)
    src_global = dist.get_global_rank(group, src) if group is not None else src
    dist.broadcast(header, src_global, group=group)
    length, kind = (int(v) for v in header.tolist())
    data = torch.frombuffer(bytearray(message), dtype=torch.uint8).to(device) if message \
        else torch.zeros(length, dtype=torch.uint8, device=device)
    if length:
        dist.broadcast(data, src_global, group=group)
    if error is not None and rank == src:
        raise error
    text = bytes(data.cpu().tolist()).decode(errors="replace")
    raise types[kind](f"{text} (raised on rank {src_global})")
