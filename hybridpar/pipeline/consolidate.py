"""The whole model's state dict from a pipe's stages and tp shards, and back into them.

    consolidated_state_dict   each rank gathers its stage's tp shards (`gather_full`), then
                              every stage broadcasts its tensors over the pp group
                              (`broadcast_tensors`: no pickles); every rank gets the whole
    load_consolidated         each rank keeps its stage's keys, sliced to its tp shard

Names are the unsplit `nn.Sequential`'s. A tied parameter (`pipeline.tied`) travels once,
under its canonical name, and every other name gets the same tensor; a state dict may give
any one of a tie's names (Hugging Face files omit the tied head).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from hybridpar.broadcast import broadcast_tensors
from hybridpar.tensor_parallel.state import gather_full, shard_of
from hybridpar.topology import Topology

__all__ = ["consolidated_state_dict", "fill_aliases", "load_consolidated"]


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
        param = params.get(key)
        full = gather_full(value, param, group) if param is not None else value
        local[key] = full.detach().cpu().clone()
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
                      *, state_keys: Sequence[str], aliases: Mapping[str, str]) -> None:
    """Load a full (unsharded) state dict into `stage`, keeping its keys and tp shard."""
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
    for key in stage.state_dict():
        param = params.get(key)
        value = state_dict[key]
        local[key] = shard_of(value, param, group) if param is not None else value
    stage.load_state_dict(local)
