"""ZeRO-2: each gradient reduced to the dp rank that owns its parameter, micro-batch by
micro-batch, so no rank holds the gradients of its whole shard.

`GradBuckets` (zero 0, 1) keeps every gradient whole on every dp rank until the step's last
backward. Here the parameters are dealt to the dp ranks (`hybridpar.optim.deal`, the owner
keeps their optimizer state) and the buckets are cut per owner, so that one bucket is one
reduce to one rank (together, the reduce-scatter of whole parameters):

    registered   p0  p1  p2  p3  p4  p5          owners  p0 p2 p4 -> rank 0, p1 p3 p5 -> 1
    buckets      b0 = [p5, p3]   b1 = [p4, p2]   b2 = [p1]   b3 = [p0]
                 (owner 1)       (owner 0)       (owner 1)   (owner 0)

Each backward (each micro-batch, or each W pass of a split one) hands autograd's gradient of
a parameter to the hook, which copies it into a staging buffer of its bucket for that
round (the parameter's k-th gradient this step goes to round k) and drops it. A bucket's
round complete, its staging buffer is reduced to the owner, which adds it, divided by dp,
into its gradient: a float32 buffer of its parameters only (``.grad``, or ``main_grad`` for
bf16 weights, views of it after `finish`):

    per parameter     gradient kept                 moved per step (each rank)
    zero 0, 1         whole, on every rank          one all-reduce of it
    zero 2            its 1 / dp share, the owner   one reduce of it per micro-batch

so zero 2 trades the gradient's 4 bytes per parameter for 4 / dp plus a few staging
buffers in flight, at ``chunks`` times the traffic: worth it only when memory is what
limits (as DeepSpeed's ZeRO-2).

Order: a replica's hooks fire in one order (one device, one schedule, autograd's order), so
every dp rank completes, and launches, the rounds in the same order; `finish` launches the
rounds left incomplete (a parameter unused in a micro-batch) in (bucket, round) order. A
parameter unused in a round on one replica must be unused there on all, as for
`GradBuckets`.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup, Work
from torch.utils.hooks import RemovableHandle

from hybridpar import trace
from hybridpar.pipeline.parameters.reduce import bucket_layout, grad_dtype_of, is_view
from hybridpar.precision import MAIN_GRAD, grad_of, set_grad

__all__ = ["ZERO2_BUCKET_BYTES", "ShardedGradBuckets"]

# The bucket size: a rank holds two staging buffers during the backward (one filling, one in
# flight), so at zero 2, which is chosen for memory, the bucket is a third of zero 0 / 1's
# 25 MiB. Peak per rank above its baseline, a GPT of 25 M parameters at dp 4, fp32
# (scripts/bench_zero.py's peak rows; zero 0: 413.8 MiB):
#
#     bucket      25 MiB         8 MiB          4 MiB
#     peak        238.2 (0.58)   206.4 (0.50)   200.3 (0.48)
#
# Below 8 MiB the gain is small and the reduces (buckets x chunks a step) grow.
ZERO2_BUCKET_BYTES = 8 << 20


class _Round:
    """One round of one bucket: its staging buffer and the parameters copied into it."""

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.staging = torch.empty(size, dtype=dtype, device=device)
        self.filled: set[int] = set()


class ShardedGradBuckets:
    """Reduce the `.grad` of `params` over the dp `group` to each parameter's owner.

    `owners`: per parameter, its owner's rank in `group` (the same on every rank). The same
    calls as `GradBuckets`: `attach` before a step's first backward, `finish` after its
    last (`arm` does nothing: every backward reduces). After `finish` an owned parameter's
    gradient (``.grad``; ``main_grad`` of `grad_dtype` for lower weights) is the dp average
    (the sum over `group` divided by `divisor`, default its size),
    a view of this rank's buffer; every other parameter's is None. A gradient present at
    `attach` is kept: the owner's joins the sum, another rank's goes out with its first
    round. At most `in_flight` reduces are outstanding after a launch: the hook waits for
    the older ones (on a GPU a wait only orders the streams; on gloo it blocks), so the
    staging buffers alive are the one filling and `in_flight` in the wire, whatever the
    number of micro-batches.
    """

    def __init__(self, params: Sequence[nn.Parameter], group: ProcessGroup,
                 owners: Sequence[int], *, bucket_bytes: int = ZERO2_BUCKET_BYTES,
                 grad_dtype: torch.dtype | None = None, in_flight: int = 1,
                 divisor: int | None = None) -> None:
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.params = list(params)
        if len(owners) != len(self.params):
            raise ValueError(f"owners lists {len(owners)} ranks for {len(self.params)} "
                             "parameters; give one owner per parameter")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if any(not 0 <= o < self.size for o in owners):
            raise ValueError(f"an owner is outside the dp group's ranks 0..{self.size - 1}: "
                             f"{sorted(set(owners))}")
        self.owners = list(owners)
        # the sum is divided by the group's size (an average), or by `divisor`: experts
        # summed over their expert dp group are divided by the whole dp
        self.divisor = self.size if divisor is None else divisor
        self.grad_dtype = grad_dtype
        self.in_flight = in_flight
        self._buckets = bucket_layout(self.params, bucket_bytes, grad_dtype, self.owners)
        self._where: dict[int, int] = {}        # param index -> bucket index
        for b, bucket in enumerate(self._buckets):
            self._where.update(dict.fromkeys(bucket, b))
        self._offsets: dict[int, int] = {}      # param index -> offset in its bucket
        for bucket in self._buckets:
            offset = 0
            for i in bucket:
                self._offsets[i] = offset
                offset += self.params[i].numel()
        # the owner's gradient buffers: one per owned bucket, kept
        self._owned: dict[int, Tensor] = {}
        self._main = {i for i in self._where
                      if self.params[i].dtype != grad_dtype_of(self.params[i], grad_dtype)}
        for i in self._main:
            setattr(self.params[i], MAIN_GRAD, None)
        self._fired = [0] * len(self.params)    # per parameter: gradients this step
        self._rounds: dict[tuple[int, int], _Round] = {}   # (bucket, round) not launched
        self._works: deque[tuple[Work, int, Tensor]] = deque()   # (work, bucket, staging)
        self._carry: dict[int, Tensor] = {}     # another rank's parameter: grad at attach
        self._unused: set[int] = set()          # owned, no gradient at attach nor since
        self._lock = threading.Lock()
        self._handles: list[RemovableHandle] = [
            self.params[i].register_post_accumulate_grad_hook(self._hook(i))
            for i in self._where]

    @property
    def buckets(self) -> list[list[int]]:
        """The layout: per bucket, the indices of its parameters in `params`."""
        return [list(b) for b in self._buckets]

    @property
    def rounds(self) -> list[int]:
        """Per bucket, the reduces of the current (or last) step: the most gradients one of
        its parameters got (one per micro-batch; two where a stage pair on this rank uses a
        tied parameter twice, its bucket's other parameters then adding zeros)."""
        return [max(self._fired[i] for i in bucket) for bucket in self._buckets]

    def owner_of_bucket(self, b: int) -> int:
        """The rank (in the dp group) that bucket `b`'s reduces go to."""
        return self.owners[self._buckets[b][0]]

    def buffers(self) -> list[Tensor]:
        """This rank's gradient buffers (its owned buckets'), kept between steps."""
        return list(self._owned.values())

    def _owned_buffer(self, b: int) -> Tensor:
        """Owned bucket `b`'s gradient buffer (made, zeroed, the first time)."""
        flat = self._owned.get(b)
        if flat is None:
            first = self.params[self._buckets[b][0]]
            flat = torch.zeros(sum(self.params[i].numel() for i in self._buckets[b]),
                               device=first.device, dtype=grad_dtype_of(first, self.grad_dtype))
            self._owned[b] = flat
        return flat

    def _owned_views(self, b: int) -> list[tuple[int, Tensor]]:
        """(parameter index, its slice of owned bucket `b`'s buffer shaped as it)."""
        flat = self._owned_buffer(b)
        return [(i, flat[self._offsets[i]:self._offsets[i] + p.numel()].view_as(p))
                for i, p in ((i, self.params[i]) for i in self._buckets[b])]

    def attach(self) -> None:
        """Start a step: each gradient present is kept for the sum (see the class), every
        ``.grad`` becomes None for the backwards, the round counts restart."""
        with self._lock, torch.no_grad():
            self._rounds, self._works = {}, deque()   # a failed step's: abandoned
            self._fired = [0] * len(self.params)
            self._carry, self._unused = {}, set()
            for b in range(len(self._buckets)):
                owned = self.owner_of_bucket(b) == self.rank
                views = dict(self._owned_views(b)) if owned else {}
                for i in self._buckets[b]:
                    p = self.params[i]
                    grad = grad_of(p)
                    if i in self._main and p.grad is not None:   # a bf16 grad set outside
                        grad = p.grad.float() if grad is None else grad + p.grad
                    if owned:
                        view = views[i]
                        if grad is None:
                            view.zero_()
                            self._unused.add(i)
                        elif not is_view(grad, view):
                            view.copy_(grad)
                    elif grad is not None:
                        self._carry[i] = grad
                    set_grad(p, None)
                    p.grad = None

    def arm(self) -> None:
        """Nothing: every backward's gradients are reduced as they come."""

    def finish(self) -> None:
        """Launch the incomplete rounds, wait for every reduce, and give each owned parameter
        its averaged gradient (None to the others)."""
        with self._lock, torch.no_grad():
            for b, r in sorted(self._rounds):
                self._launch(b, r)
            self._drain(0)
            for b in range(len(self._buckets)):
                owned = self.owner_of_bucket(b) == self.rank
                views = dict(self._owned_views(b)) if owned else {}
                for i in self._buckets[b]:
                    p = self.params[i]
                    set_grad(p, views[i] if owned and i not in self._unused else None)
                    if i in self._main:
                        p.grad = None
            self._unused, self._carry = set(), {}

    def remove(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, i: int) -> Callable[[Tensor], None]:
        """The accumulate-grad hook of parameter `i`: its gradient into its round's staging."""
        b = self._where[i]
        size = sum(self.params[j].numel() for j in self._buckets[b])
        dtype = grad_dtype_of(self.params[i], self.grad_dtype)

        def hook(param: Tensor) -> None:
            grad = param.grad
            assert grad is not None
            with self._lock, torch.no_grad():
                r = self._fired[i]
                self._fired[i] += 1
                self._unused.discard(i)
                entry = self._rounds.get((b, r))
                if entry is None:
                    entry = self._rounds[(b, r)] = _Round(size, dtype, grad.device)
                self._fill(entry, i, grad)
                param.grad = None
                if len(entry.filled) == len(self._buckets[b]):
                    self._launch(b, r)
                    self._drain(self.in_flight)
        return hook

    def _fill(self, entry: _Round, i: int, grad: Tensor | None) -> None:
        """Parameter `i`'s gradient (None: zeros) into its slice of `entry`'s staging, plus
        what it carried in at `attach`."""
        start = self._offsets[i]
        view = entry.staging[start:start + self.params[i].numel()].view_as(self.params[i])
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)
        carry = self._carry.pop(i, None)
        if carry is not None:
            view.add_(carry)
        entry.filled.add(i)

    def _launch(self, b: int, r: int) -> None:
        """Reduce round `r` of bucket `b` to its owner (lock held); the parameters missing
        from it add zeros (or what they carried in)."""
        entry = self._rounds.pop((b, r))
        for i in self._buckets[b]:
            if i not in entry.filled:
                self._fill(entry, i, None)
        flat = entry.staging
        owner = dist.get_global_rank(self.group, self.owner_of_bucket(b))
        with trace.collective("reduce", flat.numel() * flat.element_size()):
            work = dist.reduce(flat, dst=owner, group=self.group, async_op=True)
        assert work is not None
        self._works.append((work, b, flat))

    def _drain(self, limit: int) -> None:
        """Wait for the oldest reduces until at most `limit` are outstanding: the owner adds
        each result, divided by dp, into its gradient buffer. (Not sooner when one is done:
        the staging buffers alive stay the same whatever the timing.)"""
        while len(self._works) > limit:
            work, b, flat = self._works.popleft()
            work.wait()
            if self.owner_of_bucket(b) == self.rank:   # no views made on this path
                self._owned_buffer(b).add_(flat, alpha=1 / self.divisor)
