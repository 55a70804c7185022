"""What a dry run measures on its fake GPUs: memory by kind and traffic per rank, and the report.

What is measured (`RankReport`, `CheckReport`), in bytes of the rank's device:

    column        bytes of                                        how
    params        this rank's parameters and buffers (its stage,  pipe.parameters(), buffers()
                  its tp shard)
    grads         their gradients after the step, those that do   sum over p.grad
                  not live in the dp buckets
    buckets       the dp gradient buckets (dp > 1): one flat      GradBuckets.buffers(), kept
                  buffer per bucket, all of them as large as the  from step to step
                  trainable parameters; the gradients are views
                  of them (no second copy)
    optimizer     AdamW's exp_avg and exp_avg_sq                  the optimizer's state after
                                                                  its step (2 x trainable)
    activations   the peak of tensors saved for backward          saved_tensors_hooks (below)
    peak          the most bytes alive at once, temporaries       `LiveBytes` (below)
                  included, over a step and its update in the
                  steady state: checked against --memory
    p2p           pipeline payloads sent + received (not the      hybridpar.comm_stats()
                  headers of new shapes: ``comm["p2p_header"]``)
    collectives   all-reduce, all-gather, reduce-scatter, bcast:  hybridpar.comm_stats()
                  the full tensor's bytes per call (a ring all-
                  reduce moves twice what the others do)

The peak (`LiveBytes`): every fake tensor an operation returns on the rank's device during the
first step and its update is keyed by its storage (a view and its base count once), over
what is there before (parameters, buffers, AdamW's state, the dp buckets); a new one counts
the storages still alive, and the largest sum is the peak. The step starts as every step of
a run after the first does (`steady_state`): the optimizer's state and the dp
buckets are there, the gradients are None (the trainer sets them so before each step) and
come back in the backward, and the update runs the optimizer as torch runs it on that
device (on a GPU the foreach AdamW, whose temporaries are one more copy of the parameters;
on CPU ranks one parameter at a time). So

    peak = params + optimizer + buckets + the most the step or its update holds on top:
           max(gradients + activations + temporaries of forward and backward,
               gradients + the optimizer step's temporaries)

term by term as they are alive together: the sum of the columns is near it or above for a
large model (activations and gradients are not all alive at once), below it for a small one
(temporaries). What it cannot see: the allocator's cache and fragmentation, the CUDA context,
NCCL's buffers, workspaces of kernels (docs/check.md).

Activations (`pipeline.activations.kept.SavedActivations`): every tensor autograd saves during the
step is
keyed by its storage (a view and its base count once, parameters and buffers not at all); a
new one counts the storages still alive, and the largest sum is the peak. Checkpointed micro-batches
save nothing in their first forward (no grad) and everything again while recomputed, so the
peak follows the schedule: without checkpointing it is the saved bytes of one micro-batch
times m on every stage under GPipe, times p - s on stage s under 1F1B (BENCH.md). A split
backward (ZB-H1, ZBV) also keeps each linear layer's output gradient from its I to its W:
those count as saved too (`split_backward.observing_kept`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hybridpar.optim import optimizer_state_tensors
from hybridpar.pipeline.activations.kept import StorageSum, storage_key
from hybridpar.pipeline.parameters.partition import layer_spans

__all__ = [
    "COLLECTIVES",
    "CheckReport",
    "GiB",
    "LiveBytes",
    "RankReport",
    "format_bytes",
    "held_bytes",
    "memory_problem",
    "steady_state",
    "tensor_bytes",
]

GiB = 2**30
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "reduce", "broadcast",
               "all_to_all")
_P2P = ("p2p_send", "p2p_recv")   # payloads: every step's (headers: new shapes only)


def tensor_bytes(tensors: Iterable[Tensor | None]) -> int:
    """The bytes of `tensors` (None counts 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class LiveBytes(TorchDispatchMode, StorageSum):
    """The peak bytes of the tensors alive on `device_type` while active (see above).

    Given the tensors already there (`present`: parameters, buffers), it sees every tensor
    an operation returns, on this thread and on autograd's (the mode travels with the
    thread-local state, as FakeTensorMode does); a storage counts once, with its size, until
    it is freed. Freed storages are found when a new one would make a new peak, so the peak
    is exact and the bookkeeping cheap.
    """

    def __init__(self, device_type: str, present: Iterable[Tensor] = ()) -> None:
        TorchDispatchMode.__init__(self)
        StorageSum.__init__(self)
        self.device_type = device_type
        for t in present:
            self._count(t)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self._count(t)
        return out

    def _count(self, t: Tensor) -> None:
        if t.device.type != self.device_type or t.is_meta:
            return
        self._add(storage_key(t), t)


def steady_state(pipe: nn.Module, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """Put a rank's `pipe` where every step of a run after the first starts: AdamW's state
    made (one update of zero gradients, then the gradients back to None, as the trainer sets
    them before a step) and the dp buckets' flat buffers allocated (`GradBuckets.finish` of
    no gradients: all-reduces zeros). Returns those tensors, alive from then on."""
    with torch.no_grad():
        for p in pipe.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    for buckets in _buckets(pipe):
        buckets.finish()
    return [*optimizer_state_tensors(optimizer), *_bucket_buffers(pipe)]


def held_bytes(pipe: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The bytes a rank holds after a step and its update, on its device: parameters and
    buffers, gradients, the dp buckets' buffers, AdamW's state (its step counts stay on the
    host, as torch keeps them on CUDA)."""
    params = list(pipe.parameters())
    device = params[0].device.type if params else "cpu"
    buffers = _bucket_buffers(pipe)
    in_buckets = {storage_key(t) for t in buffers}
    return dict(params=tensor_bytes([*params, *pipe.buffers()]),
                grads=tensor_bytes(p.grad for p in params if p.grad is not None
                                   and storage_key(p.grad) not in in_buckets),
                buckets=tensor_bytes(buffers),
                optimizer=tensor_bytes(t for t in optimizer_state_tensors(optimizer)
                                       if t.device.type == device))


def _buckets(pipe: nn.Module) -> list[Any]:
    """The pipe's `pipeline.parameters.reduce.GradBuckets`: the dp buckets, and the experts'
    (expert parallelism: reduced over the dp ranks holding the same experts)."""
    return [b for b in (getattr(pipe, "_dp_buckets", None),
                        getattr(pipe, "_expert_buckets", None)) if b is not None]


def _bucket_buffers(pipe: nn.Module) -> list[Tensor]:
    """The flat buffers of the pipe's buckets (where its gradients live at dp > 1)."""
    return [t for buckets in _buckets(pipe) for t in buckets.buffers()]



@dataclass(frozen=True)
class RankReport:
    """The numbers of one rank's step (bytes), and where it sits in the grid."""

    rank: int
    dp: int
    stage: int
    tp: int
    layers: tuple[int, ...]           # the model's layers the rank holds
    params: int                       # parameters and buffers
    grads: int
    optimizer: int
    activations: int
    comm: dict[str, dict[str, int]]   # hybridpar.comm_stats() of the step
    peak: int                         # the most bytes alive at once (`LiveBytes`)
    buckets: int = 0                  # the dp gradient buckets (dp > 1)

    @property
    def p2p(self) -> int:
        return sum(self.comm.get(k, {}).get("bytes", 0) for k in _P2P)

    @property
    def collectives(self) -> int:
        return sum(self.comm.get(k, {}).get("bytes", 0) for k in COLLECTIVES)

    @property
    def where(self) -> str:
        return f"rank {self.rank} (dp {self.dp}, stage {self.stage}, tp {self.tp})"


@dataclass
class CheckReport:
    """A dry run that passed: every rank's numbers, the layout, and notes for the reader."""

    config: str
    device: str
    dims: tuple[int, int, int]        # (dp, pp, tp)
    balance: list[int]
    chunks: int
    schedule: str
    checkpoint: str
    precision: str
    ranks: list[RankReport]
    memory_gib: float | None = None
    notes: list[str] = field(default_factory=list)
    p2p_groups: int = 0               # P2P groups replayed under NCCL's rules
    microbatches: list[list[int]] = field(default_factory=list)   # rows, per dry step
    cuda_branches: dict[str, int] = field(default_factory=dict)   # CUDA branches taken

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for row, rank in zip(data["ranks"], self.ranks):
            row.update(p2p=rank.p2p, collectives=rank.collectives)
        data["total"] = self.total()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CheckReport:
        names = {f.name for f in dataclasses.fields(RankReport)}
        rows: list[dict[str, Any]] = [{k: v for k, v in r.items() if k in names}
                                      for r in data["ranks"]]
        ranks = [RankReport(**{**r, "layers": tuple(r["layers"])}) for r in rows]
        fields = {f.name for f in dataclasses.fields(cls)} - {"ranks", "dims"}
        return cls(**{k: data[k] for k in fields if k in data}, dims=tuple(data["dims"]),
                   ranks=ranks)

    def total(self) -> dict[str, int]:
        """The sums over all ranks."""
        keys = ("params", "grads", "buckets", "optimizer", "activations", "peak", "p2p",
                "collectives")
        return {k: sum(getattr(r, k) for r in self.ranks) for k in keys}

    def write_json(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    def format(self) -> str:
        """The per-rank table, a total line and the notes."""
        dp, pp, tp = self.dims
        where = "cuda devices" if self.device == "cuda" else "CPU ranks"
        head = (f"{self.config}: dp={dp} x pp={pp} x tp={tp} on {len(self.ranks)} fake "
                f"{where}, balance {self.balance}, {self.chunks} micro-batches, "
                f"{self.schedule}, checkpoint={self.checkpoint}, {self.precision}")
        columns = ("rank", "dp", "stage", "tp", "layers", "params", "grads", "buckets",
                   "optimizer", "activations", "peak", "p2p", "collectives")
        rows = [[str(r.rank), str(r.dp), str(r.stage), str(r.tp),
                 layer_spans(r.layers),
                 *(format_bytes(getattr(r, k)) for k in columns[5:])] for r in self.ranks]
        total = self.total()
        rows.append(["total", "", "", "", "", *(format_bytes(total[k]) for k in columns[5:])])
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
        lines = [head, "  ".join(c.rjust(w) for c, w in zip(columns, widths))]
        lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
        worst = max(self.ranks, key=lambda r: r.peak)
        fit = "no --memory given" if self.memory_gib is None else \
            f"{'fits' if memory_problem(self.ranks, self.memory_gib) is None else 'exceeds'}" \
            f" --memory {self.memory_gib:.3g} GiB"
        lines.append(f"largest peak: {worst.where}, {format_bytes(worst.peak)}; {fit}; "
                     f"NCCL replay of {self.p2p_groups} P2P groups: ok")
        if self.microbatches:
            steps = ", then ".join("+".join(map(str, rows)) for rows in self.microbatches)
            n = len(self.microbatches)
            lines.append(f"{n} step{'s' if n > 1 else ''} of new shapes (headers exchanged), "
                         f"micro-batch rows {steps}; the numbers are the first step's, from "
                         "the steady state (the optimizer's state and the dp buckets there)")
        if self.cuda_branches:
            lines.append("CUDA branches taken: " + ", ".join(
                f"{name} {n}" for name, n in self.cuda_branches.items()))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def format_bytes(n: int) -> str:
    """`n` bytes as B / KiB / MiB / GiB / TiB with three significant digits."""
    for unit, size in (("TiB", 2**40), ("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size or n >= 999.5 * size / 1024:   # 1020 MiB: 0.996 GiB, not 1.02e+03 MiB
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def memory_problem(ranks: list[RankReport], memory_gib: float) -> str | None:
    """Why some rank does not fit `memory_gib` per device (None: all fit)."""
    limit = memory_gib * GiB
    over = sorted((r for r in ranks if r.peak > limit), key=lambda r: -r.peak)
    if not over:
        return None
    worst = over[0]
    kinds = [k for k in ("params", "grads", "buckets", "optimizer", "activations")
             if k != "buckets" or worst.buckets]
    parts = ", ".join(f"{k} {format_bytes(getattr(worst, k))}" for k in kinds)
    rest = worst.peak - sum(getattr(worst, k) for k in kinds)
    if rest > 0:   # what is alive at the peak besides: temporaries
        parts += f", temporaries {format_bytes(rest)}"
    others = ", ".join(str(r.rank) for r in over[1:])
    also = "" if not others else \
        f"; rank {others} does not fit either" if len(over) == 2 else \
        f"; ranks {others} do not fit either"
    return (f"{worst.where} needs {format_bytes(worst.peak)}, "
            f"{format_bytes(int(worst.peak - limit))} more than --memory {memory_gib:.3g} GiB "
            f"({parts}){also}; use more stages or tp, more micro-batches with 1f1b, "
            "checkpoint='always', or a smaller batch")

