"""Ring collectives that overlap with compute: all-gather and scatter-sum by neighbour hops.

Every hop is one `batch_isend_irecv` to the next rank of the tp group and from the previous
one; the next hop is posted before a received tensor is handed out, so the caller computes on
one piece while the next travels. "Up" sends rank r's tensor to r + 1, "down" to r - 1 (mod n).

The gathers differ in how pieces travel, not (for the first two) in what they return. For
rank r of n, ``x_s`` the input of rank s and ``h = C // 2`` (C: the last dim, the features):

    function                     element i (0 ≤ i < n)          hops      per hop sends
    async_gather                 x_(r-i)  (shift_up=False:      n - 1     x up (down)
                                 x_(r+i))
    async_gather_bidirectional   same as async_gather           ⌈(n-1)/2⌉ x up and x down
    async_gather_split           2n - 1 pieces, see its table   n - 1     x[..., :h] up and
                                                                          x[..., h:] down

The scatter-sums return on rank r ``sum over ranks s of xs_s[r]`` (every rank passes one tensor
per rank, all of one shape): `async_scatter` passes running sums one way in n - 1 hops,
`async_scatter_split` passes ``[..., :h]`` up and ``[..., h:]`` down at once. Each function
is differentiable: the backward of a gather is a scatter-sum along the reversed route, and
the backward of a scatter-sum is a gather.

`ring_pass` and `ring_reduce` are the engines, exposed for layers that interleave their own
compute (`TPDense(async_comm=True)`): ring_pass yields pieces as they land; ring_reduce asks
for each partial while the running sums travel. On gloo every P2P work object is waited on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar.sharded.mappings import group_rank, group_size

__all__ = [
    "Arrival",
    "async_gather",
    "async_gather_bidirectional",
    "async_gather_split",
    "async_scatter",
    "async_scatter_split",
    "gather_chains",
    "gather_order",
    "ring_pass",
    "ring_reduce",
    "scatter_chains",
]

_TAGS = {1: 7301, -1: 7302}  # one P2P tag per direction: two hops to one peer never mix
_VARIANTS = ("unidirectional", "bidirectional", "split")

Chain = tuple[Tensor, int, int]       # (tensor, direction +1 / -1, hops) for ring_pass
SumChain = tuple[int, int, int]       # (direction, start, stop) features for ring_reduce


class Arrival(NamedTuple):
    """A piece handed out by `ring_pass`: whose it is, on which chain, after how many hops."""

    source: int
    chain: int
    hop: int
    tensor: Tensor


class _Pending:
    """The works of one posted hop and the buffers they receive into."""

    def __init__(self, works: list[Any], bufs: dict[int, Tensor], what: str) -> None:
        self.works, self.bufs, self.what = works, bufs, what

    def wait(self) -> dict[int, Tensor]:
        try:
            for work in self.works:  # gloo: every work object, sends included
                work.wait()
        except RuntimeError as e:
            raise RuntimeError(f"{self.what} failed or timed out: {e}") from e
        return self.bufs


class _Ring:
    """This rank's place on the ring of `group`."""

    def __init__(self, group: ProcessGroup | None, op: str) -> None:
        self.group, self.op = group, op
        self.n, self.rank = group_size(group), group_rank(group)

    def source(self, direction: int, hop: int) -> int:
        """The rank whose tensor arrives here after `hop` hops in `direction`."""
        return (self.rank - direction * hop) % self.n

    def post(self, items: Sequence[tuple[int, Tensor, int]], hop: int) -> _Pending:
        """Send each (chain, tensor, direction) one hop on and receive its replacement."""
        ops, bufs = [], {}
        for chain, t, direction in items:
            dst, src = (self.rank + direction) % self.n, (self.rank - direction) % self.n
            buf = torch.empty_like(t)
            ops.append(dist.P2POp(dist.isend, t, group=self.group, tag=_TAGS[direction],
                                  group_peer=dst))
            ops.append(dist.P2POp(dist.irecv, buf, group=self.group, tag=_TAGS[direction],
                                  group_peer=src))
            bufs[chain] = buf
        peers = sorted({(self.rank + d) % self.n for _, _, d in items})
        what = (f"{self.op}: tp rank {self.rank} of {self.n}, ring hop {hop}, exchanging "
                f"with tp ranks {peers}")
        return _Pending(dist.batch_isend_irecv(ops), bufs, what)


def gather_chains(x: Tensor, n: int, *, variant: str, shift_up: bool = True) -> list[Chain]:
    """The `ring_pass` chains of a gather `variant` of `x` over `n` ranks."""
    d = 1 if shift_up else -1
    if variant == "unidirectional" or (variant == "bidirectional" and n <= 2):
        return [(x, d, n - 1)]
    if variant == "bidirectional":
        return [(x, 1, n // 2), (x, -1, (n - 1) // 2)]  # the up chain takes the odd hop
    h = x.shape[-1] // 2
    return [(x[..., :h], 1, n - 1), (x[..., h:], -1, n - 1)]


def scatter_chains(width: int, *, bidirectional: bool, shift_up: bool = True) -> list[SumChain]:
    """The `ring_reduce` chains over `width` features: one way, or halves both ways."""
    if not bidirectional or width < 2:
        return [(1 if shift_up else -1, 0, width)]
    return [(1, 0, width // 2), (-1, width // 2, width)]


def ring_pass(chains: Sequence[Chain], group: ProcessGroup | None, *,
              op: str = "ring_pass") -> Iterator[Arrival]:
    """Pass each (tensor, direction, hops) chain around the ring; yield pieces as they land.

    First every chain's local tensor (hop 0), then per hop the pieces of the chains still
    moving. Each hop is posted before the previous one's pieces are yielded, so work done on
    a yielded piece overlaps the next transfer. Every rank must pass chains of equal shapes.
    """
    ring = _Ring(group, op)
    tensors = [t.contiguous() for t, _, _ in chains]
    dirs = [d for _, d, _ in chains]
    hops = [h for _, _, h in chains]
    if any(not 0 <= h < max(ring.n, 1) for h in hops):
        raise ValueError(f"{op}: hops {hops} must lie in [0, {ring.n - 1}] on {ring.n} ranks")
    moving = [(c, tensors[c], dirs[c]) for c in range(len(chains)) if hops[c] >= 1]
    pending = ring.post(moving, 1) if moving else None
    try:
        for c, t in enumerate(tensors):
            yield Arrival(ring.rank, c, 0, t)
        hop = 1
        while pending is not None:
            got = pending.wait()
            pending = None
            moving = [(c, t, dirs[c]) for c, t in got.items() if hop < hops[c]]
            if moving:
                pending = ring.post(moving, hop + 1)
            for c, t in got.items():
                yield Arrival(ring.source(dirs[c], hop), c, hop, t)
            hop += 1
    finally:
        if pending is not None:  # abandoned early: never leave a P2P work unwaited
            pending.wait()


def ring_reduce(part: Callable[[int, int, int], Tensor], chains: Sequence[SumChain],
                group: ProcessGroup | None, *, side_work: Sequence[Callable[[], None]] = (),
                op: str = "ring_reduce") -> list[Tensor]:
    """Scatter-sum: per chain, the sum over ranks s of features [start, stop) of s's part.

    ``part(dest, start, stop)`` is this rank's contribution to rank `dest`'s features
    [start, stop). A running sum starts on every rank and moves n - 1 hops in its chain's
    direction d, each rank adding its part for the sum's destination; rank r computes the
    part of the next hop while the current one travels, its own part last:

        hop   running sum held by rank r          rank r adds its part for
        0     started here                        r - d
        k     started on r - k·d                  r - (k + 1)·d
        n-1   started on r + d: complete          r

    `side_work` callables run one per hop while it travels (the rest at the end).
    """
    ring = _Ring(group, op)
    n, r = ring.n, ring.rank
    work = iter(side_work)
    acc = [part((r - d) % n, a, b).contiguous() for d, a, b in chains]
    for hop in range(1, n):
        pending = ring.post([(c, acc[c], d) for c, (d, _, _) in enumerate(chains)], hop)
        step = next(work, None)
        if step is not None:
            step()
        parts = [part((r - (hop + 1) * d) % n, a, b) for d, a, b in chains]
        got = pending.wait()
        acc = [got[c].add_(parts[c]) for c in range(len(chains))]
    for step in work:
        step()
    return acc


# the public ring collectives -----------------------------------------------------------

def gather_order(n: int, rank: int, *, variant: str = "unidirectional",
                 shift_up: bool = True) -> list[str]:
    """What each element of a gather `variant` holds on `rank`, as ``"x3"`` or ``"x3[:h]"``.

    ``"x3"`` is the whole input of rank 3, ``"x3[:h]"`` / ``"x3[h:]"`` its first / second
    half of the features (``h = C // 2``). The tests hold these lists as literal tables.
    """
    if variant not in _VARIANTS:
        raise ValueError(f"variant must be one of {_VARIANTS}, got {variant!r}")
    if variant == "split":
        return ([f"x{rank}"] + [f"x{(rank - i) % n}[:h]" for i in range(1, n)]
                + [f"x{(rank + i) % n}[h:]" for i in range(1, n)])
    d = 1 if shift_up else -1
    return [f"x{(rank - d * i) % n}" for i in range(n)]


def _check_tensor(x: Any, op: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{op} takes a Tensor, got {type(x).__name__}")


def _check_split(width: int, op: str) -> None:
    if width < 2:
        raise ValueError(
            f"{op} splits the last dim into two halves, one per direction, but it has "
            f"{width} feature(s); give it at least 2, or use the unidirectional version"
        )


class _GatherRing(torch.autograd.Function):
    """Ring all-gather in forward; ring scatter-sum of the gradients (reversed) in backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: ProcessGroup, variant: str,
                shift_up: bool) -> tuple[Tensor, ...]:
        n, r = group_size(group), group_rank(group)
        op = f"async_gather ({variant})"
        arrivals = list(ring_pass(gather_chains(x, n, variant=variant, shift_up=shift_up),
                                  group, op=op))
        ctx.group, ctx.variant, ctx.shift_up, ctx.width = group, variant, shift_up, x.shape[-1]
        if variant == "split":
            pieces = {(a.chain, a.hop): a.tensor for a in arrivals if a.hop > 0}
            return (x, *[pieces[0, i] for i in range(1, n)], *[pieces[1, i] for i in range(1, n)])
        by_source = {a.source: a.tensor for a in arrivals}
        by_source[r] = x
        d = 1 if shift_up else -1
        return tuple(by_source[(r - d * i) % n] for i in range(n))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, None, None, None]:
        group, variant = ctx.group, ctx.variant
        n, r = group_size(group), group_rank(group)
        if variant == "split":
            # rank r's halves went up (first) and down (second): their gradients come back
            # the other way, each summed on the rank they came from
            first = {(r - i) % n: grads[i] for i in range(1, n)}
            second = {(r + i) % n: grads[n - 1 + i] for i in range(1, n)}
            full = {s: torch.cat([first[s], second[s]], dim=-1) for s in first}
            h = ctx.width // 2
            chains: list[SumChain] = [(-1, 0, h), (1, h, ctx.width)]
        else:
            d = 1 if ctx.shift_up else -1
            full = {(r - d * i) % n: grads[i] for i in range(n)}
            chains = scatter_chains(ctx.width, bidirectional=variant == "bidirectional",
                                    shift_up=not ctx.shift_up)
        full[r] = grads[0]
        sums = ring_reduce(lambda dest, a, b: full[dest][..., a:b], chains, group,
                           op=f"async_gather ({variant}) backward")
        return torch.cat(sums, dim=-1), None, None, None


class _ScatterRing(torch.autograd.Function):
    """Ring scatter-sum in forward; ring all-gather of the gradient (reversed) in backward."""

    @staticmethod
    def forward(ctx: Any, group: ProcessGroup, split: bool, shift_up: bool,
                *xs: Tensor) -> Tensor:
        ctx.group, ctx.split, ctx.shift_up = group, split, shift_up
        chains = scatter_chains(xs[0].shape[-1], bidirectional=split, shift_up=shift_up)
        op = "async_scatter_split" if split else "async_scatter"
        sums = ring_reduce(lambda dest, a, b: xs[dest][..., a:b], chains, group, op=op)
        return torch.cat(sums, dim=-1) if len(sums) > 1 else sums[0]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        n = group_size(ctx.group)
        # xs[j] of every rank fed rank j's sum: it gets rank j's gradient
        variant = "bidirectional" if ctx.split else "unidirectional"
        chains = gather_chains(grad, n, variant=variant, shift_up=not ctx.shift_up)
        by_source = {a.source: a.tensor for a in ring_pass(chains, ctx.group,
                                                           op="async_scatter backward")}
        return (None, None, None, *[by_source[j] for j in range(n)])


def _gather(x: Tensor, group: ProcessGroup | None, variant: str, shift_up: bool,
            op: str) -> list[Tensor]:
    _check_tensor(x, op)
    if variant == "split":
        _check_split(x.shape[-1], op)
    if group is None or group_size(group) == 1:
        return [x]
    return list(_GatherRing.apply(x, group, variant, shift_up))


def async_gather(x: Tensor, group: ProcessGroup | None, *,
                 shift_up: bool = True) -> list[Tensor]:
    """All-gather by n - 1 hops one way: element i is ``x`` of rank (r - i) mod n.

    shift_up=False passes downwards: element i is ``x`` of rank (r + i) mod n. n = 4:

        rank   shift_up=True     shift_up=False
        0      x0 x3 x2 x1       x0 x1 x2 x3
        1      x1 x0 x3 x2       x1 x2 x3 x0
    """
    return _gather(x, group, "unidirectional", shift_up, "async_gather")


def async_gather_bidirectional(x: Tensor, group: ProcessGroup | None, *,
                               shift_up: bool = True) -> list[Tensor]:
    """All-gather passing whole inputs both ways at once; returns `async_gather`'s list.

    The up chain makes ⌈(n-1)/2⌉ hops, the down chain ⌊(n-1)/2⌋, both in flight together,
    so the gather takes ⌈(n-1)/2⌉ hop times instead of n - 1. `shift_up` only picks the
    order of the result (that of `async_gather` with the same `shift_up`). Rank r, n = 4:

        element (shift_up=True)   x_r   x_(r-1)   x_(r-2)   x_(r-3) = x_(r+1)
        arrives at hop, chain     0     1, up     2, up     1, down
    """
    return _gather(x, group, "bidirectional", shift_up, "async_gather_bidirectional")


def async_gather_split(x: Tensor, group: ProcessGroup | None) -> list[Tensor]:
    """All-gather of feature halves, first half up and second half down; 2n - 1 pieces.

    With ``h = C // 2``, rank r gets: its own whole ``x``, then the first halves that came
    up (rank r - i at hop i), then the second halves that came down (rank r + i at hop i):

        element   0     1 .. n-1                   n .. 2n-2
        holds     x_r   x_(r-i)[..., :h], i=1..    x_(r+i)[..., h:], i=1..n-1
        n = 3, r = 0:   x0  x2[:h]  x1[:h]  x1[h:]  x2[h:]

    (xlstm-jax's code returns both local halves too, 2n pieces; its docstring and this
    function keep the local input whole.)
    """
    return _gather(x, group, "split", True, "async_gather_split")


def _scatter(xs: Sequence[Tensor], group: ProcessGroup | None, split: bool,
             shift_up: bool, op: str) -> Tensor:
    xs = list(xs)
    n = group_size(group)
    for x in xs:
        _check_tensor(x, op)
    if len(xs) != n:
        raise ValueError(
            f"{op} got {len(xs)} tensors for a tp group of {n} ranks; pass exactly one per "
            f"rank (xs[j] is this rank's contribution to the sum that rank j receives)"
        )
    shapes = {(tuple(x.shape), x.dtype, x.device) for x in xs}
    if len(shapes) > 1:
        raise ValueError(f"{op} needs tensors of one shape, dtype and device (every rank's "
                         f"share is summed with the others'), got "
                         f"{[(tuple(x.shape), x.dtype) for x in xs]}; make them alike")
    if split:
        _check_split(xs[0].shape[-1], op)
    if n == 1:
        return xs[0]
    return _ScatterRing.apply(group, split, shift_up, *xs)


def async_scatter(xs: Sequence[Tensor], group: ProcessGroup | None, *,
                  shift_up: bool = True) -> Tensor:
    """Scatter-sum by n - 1 hops one way: rank r gets the sum over ranks of their ``xs[r]``.

    ``len(xs)`` must equal the group size. The running sum bound for rank r starts on rank
    r + 1 (shift_up; r - 1 otherwise) and collects one term per hop (see `ring_reduce`).
    """
    return _scatter(xs, group, False, shift_up, "async_scatter")


def async_scatter_split(xs: Sequence[Tensor], group: ProcessGroup | None) -> Tensor:
    """`async_scatter` with features ``[..., :h]`` summed going up, ``[..., h:]`` going down.

    Both halves travel at once, so every link carries half the bytes per hop each way.
    """
    return _scatter(xs, group, True, True, "async_scatter_split")
