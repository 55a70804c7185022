"""The whole model's state dict from a pipe's stages and tp shards, and back into them.

    consolidated_state_dict   each rank gathers its stage's tp shards (`full_tensor`), then
                              every stage broadcasts its tensors over the pp group
                              (`broadcast_tensors`: no pickles); every rank gets the whole
    state_layout              every key's dtype and full shape, on every rank (a few int64s
                              per key over the pp group)
    stream_state_dict         one full tensor at a time, to one rank: the key's stage gathers
                              it (`full_tensor`) and sends it; what `export_pipe` writes from
    load_consolidated         each rank keeps its stage's keys, sliced to its tp shard (no
                              integer or bool into a float, every parameter finite: a
                              `ValueError` on every rank, `hybridpar.io.weight_checks`)

Names are the unsplit `nn.Sequential`'s. A tied parameter (`pipeline.parameters.tied`) travels once,
under its canonical name, and every other name gets the same tensor; a state dict may give
any one of a tie's names (Hugging Face files omit the tied head).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar import trace
from hybridpar.comm.agreement import fail_together
from hybridpar.comm.broadcast import broadcast_tensors
from hybridpar.comm.p2p import DTYPES
from hybridpar.io.weight_checks import check_finite, check_kind
from hybridpar.sharded.attrs import is_expert_shard
from hybridpar.sharded.mappings import all_gather_along
from hybridpar.tensor_parallel.state import full_shape, gather_full, shard_of
from hybridpar.topology import Topology

__all__ = ["TensorInfo", "consolidated_state_dict", "fill_aliases", "full_tensor",
           "load_consolidated", "state_layout", "stream_state_dict"]


def full_tensor(value: Tensor, param: Tensor | None, group: ProcessGroup | None,
                experts: ProcessGroup | None = None) -> Tensor:
    """One entry of a stage's state dict, unsharded and detached, where it lives: a tp-sharded
    parameter's shards all-gathered over `group` (a collective: every tp rank of the stage
    calls it), a slice of the experts over the ep group `experts` (along dim 0: the experts
    in their global order), any other entry (a replicated parameter, a buffer) as it is."""
    full = gather_full(value, param, group) if param is not None else value
    if experts is not None and param is not None and is_expert_shard(param):
        with torch.no_grad():
            full = all_gather_along(full.detach(), 0, experts)
    return full.detach()


def _expert_group(topology: Topology) -> ProcessGroup | None:
    return topology.ep_group if topology.ep > 1 else None


def _full_shape(param: Tensor, topology: Topology, group: ProcessGroup | None) -> torch.Size:
    """A parameter's unsharded shape: over tp, and over ep for a slice of the experts."""
    shape = list(full_shape(param, group))
    if topology.ep > 1 and is_expert_shard(param):
        shape[0] *= topology.ep
    return torch.Size(shape)


def _shard(full: Tensor, param: Tensor, topology: Topology,
           group: ProcessGroup | None) -> Tensor:
    """This rank's slice of a full tensor: its experts (ep), then its tp shard."""
    if topology.ep > 1 and is_expert_shard(param):
        local = param.shape[0]
        if full.shape[0] != local * topology.ep:
            raise ValueError(f"expected {local * topology.ep} experts along dim 0, got "
                             f"{tuple(full.shape)}")
        full = full.narrow(0, topology.ep_rank * local, local)
    return shard_of(full, param, group)


def _own_cpu(full: Tensor, live: Tensor) -> Tensor:
    """`full` on the CPU in storage of its own: a copy where it still is the live tensor."""
    out = full.cpu()
    if out.untyped_storage().data_ptr() == live.untyped_storage().data_ptr():
        out = out.clone()
    return out


def consolidated_state_dict(stage: nn.Module, topology: Topology, *,
                            stage_keys: Sequence[Sequence[str]], state_keys: Sequence[str],
                            aliases: Mapping[str, str]) -> dict[str, Tensor]:
    """The unsharded model's state dict (CPU tensors, the model's key order), on every rank.

    `stage_keys`: the keys each stage broadcasts (its state-dict keys less tie aliases);
    `state_keys`: the whole model's keys.
    """
    group = topology.tp_group if topology.tp > 1 else None
    params = dict(stage.named_parameters())
    local = {}
    for key, value in stage.state_dict().items():
        local[key] = _own_cpu(full_tensor(value, params.get(key), group,
                                          _expert_group(topology)), value)
    merged: dict[str, Tensor] = dict(local)
    if topology.pp > 1:
        for s in range(topology.pp):
            keys = stage_keys[s]
            mine = [local[k] for k in keys] if s == topology.pp_rank else None
            received = broadcast_tensors(mine, topology.stage_rank(s), group=topology.pp_group,
                                         device=topology.device)
            merged.update((k, v.cpu()) for k, v in zip(keys, received))
    for alias, canonical in aliases.items():   # one tensor under every name
        merged[alias] = merged[canonical]
    return {key: merged[key] for key in state_keys}


class TensorInfo(NamedTuple):
    """A full tensor's dtype and shape: what a receiver allocates, what a file plan counts."""

    dtype: torch.dtype
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _encode(infos: Sequence[TensorInfo]) -> Tensor:
    """``[count, (dtype, ndim, *shape) per tensor]`` as int64s (the dtype: its `DTYPES` index)."""
    values = [len(infos)]
    for info in infos:
        values += [DTYPES.index(info.dtype), len(info.shape), *info.shape]
    return torch.tensor(values, dtype=torch.int64)


def _decode(codes: Tensor) -> list[TensorInfo]:
    values, pos, infos = codes.tolist(), 1, []
    for _ in range(values[0]):
        ndim = values[pos + 1]
        infos.append(TensorInfo(DTYPES[values[pos]], torch.Size(values[pos + 2:pos + 2 + ndim])))
        pos += 2 + ndim
    return infos


def state_layout(stage: nn.Module, topology: Topology, *,
                 stage_keys: Sequence[Sequence[str]]) -> dict[str, TensorInfo]:
    """The dtype and full (unsharded) shape of every stage's keys, on every rank.

    Each rank describes its own stage's keys (a sharded parameter by its full shape); each
    stage then broadcasts its description over the pp group (`_encode`: a few int64s per key,
    no values). `stage_keys` as for `consolidated_state_dict`.
    """
    group = topology.tp_group if topology.tp > 1 else None
    params = dict(stage.named_parameters())
    state = stage.state_dict()

    def info(key: str) -> TensorInfo:
        value, param = state[key], params.get(key)
        shape = _full_shape(param, topology, group) if param is not None else value.shape
        return TensorInfo(value.dtype, torch.Size(shape))

    mine = [info(k) for k in stage_keys[topology.pp_rank]]
    if topology.pp == 1:
        return dict(zip(stage_keys[0], mine))
    layout: dict[str, TensorInfo] = {}
    for s in range(topology.pp):
        codes = [_encode(mine)] if s == topology.pp_rank else None
        (received,) = broadcast_tensors(codes, topology.stage_rank(s), group=topology.pp_group,
                                        device=topology.device)
        layout.update(zip(stage_keys[s], _decode(received.cpu())))
    return layout


def _wire(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor travels as (bool as uint8, as `broadcast_tensors` sends it)."""
    return torch.uint8 if dtype == torch.bool else dtype


def stream_state_dict(stage: nn.Module, topology: Topology, *, keys: Sequence[str],
                      stage_keys: Sequence[Sequence[str]], aliases: Mapping[str, str],
                      layout: Mapping[str, TensorInfo]) -> Iterator[Tensor | None]:
    """Each of `keys` in turn, unsharded: on the writer (global rank 0) a CPU tensor of its
    own, None on every other rank. One full tensor is in flight at a time.

        for a key of stage s (a tie's alias: its canonical name's stage), at dp rank 0:
        stage s's tp ranks          all-gather it (`full_tensor`; replicated: nothing to do;
                                    experts: over dp rank 0's ep group too)
        stage s's tp rank 0         sends it to the writer (unless it is the writer)
        the writer                  receives it into a buffer shaped as `layout` says
        every other rank            nothing (the dp ranks > 0 hold the same values)

    A generator that is the protocol: every rank iterates it to the end, in step (the
    gathers, sends and receives match by order). `keys` may repeat a tensor (every name of a
    tie); `layout` is `state_layout`'s.
    """
    group = topology.tp_group if topology.tp > 1 else None
    writer, me = topology.global_rank(0, 0, 0), dist.get_rank()
    owner = {k: s for s, names in enumerate(stage_keys) for k in names}
    params = dict(stage.named_parameters())
    # dp ranks 0 .. ep - 1 form dp rank 0's ep group: together they hold every expert
    state: dict[str, Tensor] = stage.state_dict() if topology.dp_rank < topology.ep else {}
    for key in keys:
        canonical = aliases.get(key, key)
        s = owner[canonical]
        src = topology.global_rank(0, s, 0)
        param = params.get(canonical)
        experts = _expert_group(topology) if param is not None and is_expert_shard(param) \
            else None
        if topology.pp_rank == s and (topology.dp_rank == 0 or (
                experts is not None and topology.dp_rank < topology.ep)):
            value = state[canonical]
            full = full_tensor(value, param, group, experts)
            if topology.dp_rank > 0:   # (its experts gathered to dp rank 0's side)
                del full
                yield None
                continue
            if me == writer:
                out = _own_cpu(full, value)
                del full
                yield out
                del out   # (held by the writer now, or written and freed)
                continue
            if me == src:
                wire = full.to(_wire(full.dtype)).contiguous()
                with trace.collective("send", wire.numel() * wire.element_size()):
                    dist.send(wire, writer)
                del wire
            del full
        elif me == writer:
            info = layout[canonical]
            buffer = torch.empty(info.shape, dtype=_wire(info.dtype), device=topology.device)
            with trace.collective("recv", info.nbytes):
                dist.recv(buffer, src)
            out = buffer.to(info.dtype).cpu()
            del buffer
            yield out
            del out
            continue
        yield None


def fill_aliases(state_dict: Mapping[str, Tensor], aliases: Mapping[str, str]
                 ) -> Mapping[str, Tensor]:
    """`state_dict` with every name of a tie present; a `ValueError` if two of them differ."""
    if not aliases:
        return state_dict
    full = dict(state_dict)
    for alias, canonical in aliases.items():
        if alias in full and canonical in full:
            if full[alias].shape != full[canonical].shape or \
                    not torch.equal(full[alias], full[canonical]):
                raise ValueError(f"the state dict holds different values for '{canonical}' "
                                 f"and '{alias}', which are one tied parameter of this model; "
                                 "give them equal values (or only one of the names)")
        elif alias in full:
            full[canonical] = full[alias]
        elif canonical in full:
            full[alias] = full[canonical]
    return full


def load_consolidated(stage: nn.Module, state_dict: Mapping[str, Tensor], topology: Topology,
                      *, state_keys: Sequence[str], aliases: Mapping[str, str],
                      source: str = "the state dict") -> None:
    """Load a full (unsharded) state dict into `stage`, keeping its keys and tp shard.

    A collective: each rank checks its own keys (dtype kind, a parameter's values finite)
    and a `ValueError` naming the key and `source` is raised on every rank."""
    known = set(state_keys)
    state_dict = fill_aliases(state_dict, aliases)
    missing = [k for k in state_keys if k not in state_dict]
    unexpected = [k for k in state_dict if k not in known]
    if missing or unexpected:
        raise KeyError(f"state dict does not match the model: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}; give the full state dict of this "
                       "nn.Sequential (its state_dict(), consolidated_state_dict(), or "
                       "the file hybridpar export writes)")
    group = topology.tp_group if topology.tp > 1 else None
    params = dict(stage.named_parameters())
    local = {}
    with fail_together(ValueError):
        for key, target in stage.state_dict(keep_vars=True).items():
            param = params.get(key)
            value = state_dict[key]
            check_kind(key, source, value.dtype, target)
            local[key] = _shard(value, param, topology, group) if param is not None else value
            if param is not None:
                check_finite(key, source, local[key])
    stage.load_state_dict(local)
