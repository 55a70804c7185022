"""NCCL replay: each rank's P2P groups checked against NCCL's matching and rendezvous rules.

Each rank issues its point-to-point ops in groups (one `batch_isend_irecv` = one group), in
order, on one stream. `replay` runs those groups the way NCCL would and raises
`NCCLOrderError` where NCCL would hang or move the wrong bytes:

    rule          NCCL                                        replay raises
    ops           peer is another rank; send or recv          self-send, unknown peer, ...
    matching      k-th send a -> b meets k-th recv on b       "size mismatch" (numel, dtype);
                  from a, tags ignored                        labels too with `check_labels`
    counts        every send needs a recv and back            "unmatched"
    rendezvous    a rank waits at its group until every op    "deadlock", listing what each
                  in it meets its issued partner              blocked rank waits for

Gloo buffers sends, so a schedule can pass on gloo and still hang on NCCL; this finds it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["NCCLOrderError", "P2POp", "ReplayResult", "replay"]


@dataclass(frozen=True)
class P2POp:
    """One isend / irecv as issued: its direction, the other end, and what it moves."""

    kind: str           # "send" | "recv"
    peer: int           # global rank of the other end
    numel: int
    dtype: str          # e.g. "torch.float32" (compared for equality only)
    label: str = ""     # what the message is, for error messages, e.g. "FWD mb 3 [0]"

    def _replace(self, **changes: Any) -> P2POp:
        """A copy with `changes` (NamedTuple spelling, kept for callers that use it)."""
        return replace(self, **changes)


class NCCLOrderError(RuntimeError):
    """A P2P program NCCL cannot run as meant: a bad op, mismatched partners or a deadlock."""


@dataclass(frozen=True)
class ReplayResult:
    """A replay that completed: groups and ops per rank, pairs matched, rounds (waves) taken."""

    groups: dict[int, int]
    ops: dict[int, int]
    pairs: int
    rounds: int


# A message is keyed (src, dst, k): the k-th send from src to dst, which is also the k-th
# recv on dst from src. Both ends carry the same key; an end is (group index, op).
_Key = tuple[int, int, int]
_End = tuple[int, P2POp]
_Groups = Mapping[int, Sequence[Sequence[P2POp]]]


def _show(op: P2POp) -> str:
    """An op as errors name it: `send 'FWD mb 3 [0]' to rank 2`."""
    return f"{op.kind} {op.label or '(no label)'!r} {'to' if op.kind == 'send' else 'from'} " \
           f"rank {op.peer}"


def _bad_op(rank: int, g: int, op: P2POp, ranks: list[int]) -> str:
    """What is wrong with an op on its own (rule: ops)."""
    where = f"rank {rank} group {g}"
    if op.kind not in ("send", "recv"):
        return f"{where}: op {op.label!r} has kind {op.kind!r}; it must be 'send' or 'recv'"
    if op.peer == rank or op.peer not in ranks:
        return (f"{where}: {_show(op)} names "
                f"{'its own rank' if op.peer == rank else 'a rank with no entry'}; "
                f"the peer must be another of the ranks {ranks}")
    return f"{where}: {_show(op)} has numel {op.numel} < 0"


def _index(groups: _Groups) -> tuple[dict[int, list[list[_Key]]], dict[_Key, _End],
                                     dict[_Key, _End]]:
    """Check every op (rule: ops) and key it; returns the keys per rank and group, and the
    send and recv end of every key."""
    count: dict[tuple[int, int, str], int] = {}
    keys: dict[int, list[list[_Key]]] = {}
    ends: dict[str, dict[_Key, _End]] = {"send": {}, "recv": {}}
    for rank, rank_groups in groups.items():
        keys[rank] = []
        for g, group in enumerate(rank_groups):
            keys[rank].append([])
            for op in group:
                if op.kind not in ends or op.peer == rank or op.peer not in groups \
                        or op.numel < 0:
                    raise NCCLOrderError(_bad_op(rank, g, op, sorted(groups)))
                src, dst = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
                k = count.get((src, dst, op.kind), 0)
                count[src, dst, op.kind] = k + 1
                ends[op.kind][src, dst, k] = (g, op)
                keys[rank][-1].append((src, dst, k))
    return keys, ends["send"], ends["recv"]


def _match(sends: dict[_Key, _End], recvs: dict[_Key, _End], check_labels: bool) -> None:
    """Rules counts and matching: every send has its recv and back, with equal numel and
    dtype (and label with `check_labels`)."""
    for mine, theirs, what in ((sends, recvs, "recv"), (recvs, sends, "send")):
        for (src, dst, k), (g, op) in mine.items():
            if (src, dst, k) not in theirs:
                n = sum(1 for key in theirs if key[:2] == (src, dst))
                raise NCCLOrderError(
                    f"unmatched: rank {src if op.kind == 'send' else dst} group {g}: "
                    f"{_show(op)} is message #{k} from rank {src} to rank {dst}, but there "
                    f"{'is' if n == 1 else 'are'} only {n} {what}(s) for it")
    for key, (g, send) in sends.items():
        src, dst, k = key
        h, recv = recvs[key]
        sizes = (send.numel, send.dtype) != (recv.numel, recv.dtype)
        if sizes or (check_labels and send.label != recv.label):
            rule = "size mismatch" if sizes else "label mismatch"
            raise NCCLOrderError(
                f"{rule}: message #{k} from rank {src} to rank {dst} is sent as "
                f"{send.label!r} ({send.numel} x {send.dtype}, rank {src} group {g}) but "
                f"received as {recv.label!r} ({recv.numel} x {recv.dtype}, rank {dst} group "
                f"{h}); NCCL pairs them by order alone")


def replay(groups: _Groups, *, check_labels: bool = False) -> ReplayResult:
    """Replay every rank's groups in order under NCCL's rules; raise NCCLOrderError on the
    first violation. `check_labels`: matched ops must carry equal labels too."""
    keys, sends, recvs = _index(groups)
    _match(sends, recvs, check_labels)

    # Event-driven rendezvous. `at[r]` is the group rank r is blocked at, `left[r]` how many
    # of its ops still lack an issued partner, `issued[key]` how many ends of a key are
    # issued. Issuing a group bumps its keys; a key reaching 2 completes on both ranks (the
    # partner end can only sit in the peer's current group: a rank never passes an open op).
    # A rank whose `left` reaches 0 goes into the next wave; each wave advances all its ranks.
    at = dict.fromkeys(keys, 0)
    left = dict.fromkeys(keys, 0)
    issued: dict[_Key, int] = {}

    def issue(rank: int, wave: list[int]) -> None:
        group = keys[rank][at[rank]]
        left[rank] = len(group)
        if not group:
            wave.append(rank)               # an empty group completes at once
        for key in group:
            issued[key] = issued.get(key, 0) + 1
            if issued[key] == 2:
                for end in key[:2]:
                    left[end] -= 1
                    if left[end] == 0:
                        wave.append(end)

    wave: list[int] = []
    for rank in keys:
        if keys[rank]:
            issue(rank, wave)
    rounds = 0
    while wave:
        rounds += 1
        done, wave = wave, []
        for rank in done:
            at[rank] += 1
            if at[rank] < len(keys[rank]):
                issue(rank, wave)

    blocked = [r for r in keys if at[r] < len(keys[r])]
    if blocked:
        lines = []
        for r in blocked:
            g = at[r]
            waits = []
            for key, op in zip(keys[r][g], groups[r][g]):
                if issued[key] < 2:
                    there = (recvs if op.kind == "send" else sends)[key][0]
                    waits.append(f"{_show(op)} (issued there in group {there}, rank "
                                 f"{op.peer} is blocked at group {at[op.peer]})")
            lines.append(f"rank {r} group {g} waits for: " + "; ".join(waits))
        raise NCCLOrderError(
            f"deadlock: ranks {blocked} are blocked for good under NCCL's rendezvous rule:\n  "
            + "\n  ".join(lines) + "\nthe sends and recvs of one schedule slot should be in "
            "one batch_isend_irecv on each rank (like send_forward_recv_backward)")
    return ReplayResult(groups={r: len(g) for r, g in groups.items()},
                        ops={r: sum(len(group) for group in g) for r, g in groups.items()},
                        pairs=len(sends), rounds=rounds)
