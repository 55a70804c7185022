"""A run's tensors as one flat DCP state dict: layout-free keys, tp shards at global offsets.

    key                          value on this rank                     saved by
    model/<name>                 parameter or buffer (shard if tp)      its stage's ranks
    optim/<name>/<exp_avg|...>   AdamW state, sharded like the param     its stage's ranks
    train/step                   int64 scalar                           every rank (one copy)
    data/<epoch|index|step>      int64 scalar: the data position        every rank (one copy)
    layout                       int64 (dp, pp, tp, balance...)          every rank (one copy)
    tied/<name>                  uint8: the canonical name of a tie      every rank (one copy)
    rng/<dp>.<pp>.<tp>/<...>     this rank's RNG streams                this rank

``<name>`` is the parameter's name in the unsharded `nn.Sequential` ("3.attn.q.weight"),
so the same key holds the same tensor whatever the (pp, tp, dp, ep, balance). A tp-sharded
tensor, or a slice of the experts (ep > 1: at its experts' global index along dim 0), is a
`ShardChunk`: DCP records where the shard sits in the full tensor, and a load
under another tp reads the overlapping pieces of the saved shards. Replicated tensors are
saved once (DCP de-duplicates equal keys), so keys that hold *different* values on two
ranks must differ: `check_unique` asserts it of the model keys before a save.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from hybridpar.pipeline.parameters.partition import layer_spans
from hybridpar.sharded.attrs import get_parallel_dim, is_expert_shard, tensor_shard_dim
from hybridpar.sharded.mappings import group_rank, group_size, shard_range
from hybridpar.tensor_parallel.fused import fused_parts, fused_ranges, fused_sizes, local_ranges
from hybridpar.tensor_parallel.state import full_shape

__all__ = ["Entry", "ShardChunk", "ShardLoadPlanner", "ShardSavePlanner", "check_unique",
           "flatten", "model_entries", "optimizer_entries", "read_ties", "tie_entries",
           "unflatten"]


class ShardChunk:
    """A tp shard as DCP sees it: blocks of `local` at their offsets in a tensor of `global_size`.

    Implements DCP's checkpointable protocol (what DTensor implements), so uneven shards
    (``shard_sizes``: the first ``n % tp`` ranks hold one more row) keep their exact offsets.
    A plain shard is one block; a fused one (q | k | v, `tensor_parallel.fused`) is one block
    per part. Save and load with `ShardSavePlanner` / `ShardLoadPlanner`, which hand DCP the
    blocks (views of `local`); loading copies into them in place.
    """

    def __init__(self, local: Tensor, global_size: torch.Size, offsets: torch.Size, *,
                 blocks: list[tuple[Tensor, torch.Size]] | None = None) -> None:
        self.local, self.global_size, self.offsets = local, global_size, offsets
        self.blocks = blocks if blocks is not None else [(local, offsets)]

    def size(self) -> torch.Size:
        """The full tensor's size (DCP compares it with the saved one)."""
        return self.global_size

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=offsets, sizes=block.size()),
                              properties=TensorProperties.create_from_tensor(self.local),
                              size=self.global_size))
                for block, offsets in self.blocks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=offsets, sizes=block.size())
                for block, offsets in self.blocks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        for block, offsets in self.blocks:
            if index.offset is None or torch.Size(index.offset) == offsets:
                return block
        raise KeyError(f"no block of {index.fqn} at offsets {index.offset}")

    def __repr__(self) -> str:
        return (f"ShardChunk(local={tuple(self.local.shape)}, global={tuple(self.global_size)}, "
                f"offsets={[tuple(o) for _, o in self.blocks]})")


Entry = Tensor | ShardChunk


class ShardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner for a flat state dict that may hold `ShardChunk` values."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        return obj.__get_tensor_shard__(index) if isinstance(obj, ShardChunk) \
            else super().lookup_object(index)


class ShardLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner for a flat state dict that may hold `ShardChunk` values."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None,
                       is_coordinator: bool = False) -> None:
        # the default would first pass every value through its meta-tensor initializer,
        # which replaces values of unknown types (a ShardChunk) with None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        obj = self.state_dict.get(index.fqn)
        return obj.__get_tensor_shard__(index) if isinstance(obj, ShardChunk) \
            else super().lookup_tensor(index)


def _entry(tensor: Tensor, param: Tensor | None, group: Any,
           experts: tuple[int, int] | None = None) -> Tensor | ShardChunk:
    """`tensor` (the param itself or state shaped like it) as DCP should see it; `experts`:
    (ep, ep rank), where a slice of the experts sits at its global index along dim 0."""
    if param is not None and experts is not None and experts[0] > 1 \
            and is_expert_shard(param) and tensor.shape == param.shape:
        ep, rank = experts
        local = param.shape[0]
        return ShardChunk(tensor, torch.Size([local * ep, *param.shape[1:]]),
                          _at(tensor.dim(), 0, rank * local))
    if param is None or get_parallel_dim(param) is None or tensor.shape != param.shape:
        return tensor
    dim = tensor_shard_dim(param)
    if dim is None or group is None or group_size(group) == 1:
        return tensor
    size = full_shape(param, group)
    if fused_parts(param) > 1:   # q | k | v: this rank's slice of each part, one block each
        sizes, tp = fused_sizes(param), group_size(group)
        blocks = [(tensor.narrow(dim, a, b - a), _at(tensor.dim(), dim, start))
                  for (a, b), (start, _) in zip(local_ranges(sizes, tp),
                                                fused_ranges(sizes, tp, group_rank(group)))]
        return ShardChunk(tensor, size, blocks[0][1], blocks=blocks)
    start, _ = shard_range(size[dim], group_size(group), group_rank(group))
    return ShardChunk(tensor, size, _at(tensor.dim(), dim, start))


def _at(ndim: int, dim: int, start: int) -> torch.Size:
    """Offsets of a block starting at `start` on `dim`, 0 elsewhere."""
    offsets = [0] * ndim
    offsets[dim] = start
    return torch.Size(offsets)


def model_entries(module: nn.Module, group: Any, *,
                  aliases: Mapping[str, str] | None = None,
                  masters: Mapping[int, Tensor] | None = None,
                  experts: tuple[int, int] | None = None) -> dict[str, Tensor | ShardChunk]:
    """``model/<name>`` for every tensor of `module`'s state dict (`group`: the tp group).

    A tied parameter (`aliases`: ``{name: canonical name}``, `HybridPipe.tied_aliases`) is
    saved once, under its canonical name, by every stage holding a copy (DCP de-duplicates).
    `masters` (bf16 weights: ``{id(param): float32 master}``, `MasterWeights.masters`): a
    parameter's entry is its master, and a parameter without one here is left to the rank
    that owns it. `experts`: (ep, ep rank) of a model whose experts are split over ep.
    """
    params = dict(module.named_parameters(remove_duplicate=False))
    out: dict[str, Tensor | ShardChunk] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        param = params.get(name)
        if masters is not None and param is not None:
            if id(param) not in masters:
                continue
            value = masters[id(param)]
        out.setdefault(f"model/{_canonical(name, aliases)}",
                       _entry(value, param, group, experts))
    return out


def tie_entries(aliases: Mapping[str, str]) -> dict[str, Tensor]:
    """``tied/<name>``: the canonical name (UTF-8 bytes) every other name of a tie reads."""
    return {f"tied/{alias}": torch.tensor(list(canonical.encode()), dtype=torch.uint8)
            for alias, canonical in aliases.items()}


def read_ties(state: Mapping[str, Any]) -> dict[str, str]:
    """The ``{name: canonical name}`` that `tie_entries` wrote into `state`."""
    return {key.removeprefix("tied/"): bytes(value.tolist()).decode()
            for key, value in state.items() if key.startswith("tied/")}


def _canonical(name: str, aliases: Mapping[str, str] | None) -> str:
    return aliases.get(name, name) if aliases else name


def optimizer_entries(module: nn.Module, optimizer: torch.optim.Optimizer, group: Any, *,
                      aliases: Mapping[str, str] | None = None,
                      owned: set[int] | None = None,
                      masters: Mapping[int, Tensor] | None = None,
                      experts: tuple[int, int] | None = None
                      ) -> dict[str, Tensor | ShardChunk]:
    """``optim/<name>/<key>`` for every tensor of the optimizer state of `module`'s params
    (`owned`: of those whose ``id`` is in it, the ones this rank's ZeRO shard holds;
    `masters`: the state is `optimizer`'s of each parameter's master, `MasterWeights`).

    State that does not exist yet (no step taken) is created first, as the optimizer's first
    step would (AdamW: ``step`` 0, ``exp_avg`` and ``exp_avg_sq`` zeros; any other class:
    `_initial_state`), so a load has tensors to fill in place.
    """
    out: dict[str, Tensor | ShardChunk] = {}
    for name, param in module.named_parameters():
        if owned is not None and id(param) not in owned:
            continue
        key_of = param if masters is None else masters[id(param)]
        state = optimizer.state[key_of]
        if not state:
            state.update(_initial_state(optimizer, key_of))
        for key, value in state.items():
            if value is None:   # (SGD without momentum: momentum_buffer = None)
                continue
            if not isinstance(value, Tensor):
                raise TypeError(f"optimizer state {name}/{key} is {type(value).__name__}; "
                                "only tensor state can be checkpointed")
            out[f"optim/{_canonical(name, aliases)}/{key}"] = _entry(value, param, group,
                                                                     experts)
    return out


def _initial_state(optimizer: torch.optim.Optimizer, param: Tensor) -> dict[str, Tensor]:
    """The state `optimizer`'s first step would give `param`, before it took one.

    Adam / AdamW: ``step`` 0 and zero moments, made directly. Any other class: the state a
    throwaway optimizer of the same class and hyper-parameters (lr 0) makes in one step on a
    zero tensor like `param` with a zero gradient (SGD: its momentum buffer); state that is
    None (SGD without momentum keeps ``momentum_buffer = None``) is no state.
    """
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        if any(g.get("amsgrad") for g in optimizer.param_groups):
            raise ValueError("checkpoints of amsgrad optimizers are not supported")
        zeros = torch.zeros_like(param, memory_format=torch.preserve_format)
        return {"step": torch.zeros((), dtype=torch.float32), "exp_avg": zeros,
                "exp_avg_sq": zeros.clone()}
    group = next(g for g in optimizer.param_groups if any(p is param for p in g["params"]))
    probe = torch.zeros_like(param, memory_format=torch.preserve_format, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    options = {k: v for k, v in group.items() if k != "params"}
    throwaway = type(optimizer)([probe], **{**options, "lr": 0.0})
    throwaway.step()
    return {k: v for k, v in throwaway.state[probe].items() if v is not None}


def check_unique(keys: Iterable[str], layers: Sequence[int], *,
                 tied: Iterable[str] = ()) -> None:
    """Raise unless every model / optimizer key names a layer of this stage (`layers`).

    Stages hold disjoint layers, so their keys cannot collide: two ranks that save one key
    are tp peers or dp replicas of one stage, whose replicated tensors are equal, or hold
    copies of one tied parameter (its canonical names: `tied`), kept equal by the pipe.
    """
    shared = set(tied)
    for key in keys:
        kind, _, name = key.partition("/")
        if kind not in ("model", "optim") or name.rsplit("/", 1)[0] in shared \
                or name in shared:
            continue
        head = name.split(".", 1)[0]
        if not head.isdigit() or int(head) not in layers:
            raise RuntimeError(f"checkpoint key {key!r} does not name a layer of this stage "
                               f"(layers {layer_spans(layers)}); keys must be the layout-free "
                               "names of the nn.Sequential")



def flatten(prefix: str, tree: Mapping[str, Any] | list[Any] | Tensor) -> dict[str, Tensor]:
    """Nested dicts / lists of tensors as ``{prefix/a/0/b: tensor}``."""
    if isinstance(tree, Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, Mapping) else enumerate(tree)
    out: dict[str, Tensor] = {}
    for key, value in items:
        out.update(flatten(f"{prefix}/{key}", value))
    return out


def unflatten(prefix: str, flat: Mapping[str, Tensor], like: Any) -> Any:
    """The inverse of `flatten` for a tree shaped like `like`."""
    if isinstance(like, Tensor):
        return flat[prefix]
    if isinstance(like, Mapping):
        return {k: unflatten(f"{prefix}/{k}", flat, v) for k, v in like.items()}
    return [unflatten(f"{prefix}/{i}", flat, v) for i, v in enumerate(like)]
