"""HybridPipe's collective jobs on its parameters: consolidated state dicts, clipping by the
global norm, ZeRO-2's gradient owners, the replica check."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from hybridpar.pipe import consolidate
from hybridpar.pipe.steps import PipeSteps
from hybridpar.pipeline.parameters import clip
from hybridpar.pipeline.parameters.grad_shards import ZERO2_BUCKET_BYTES, ShardedGradBuckets
from hybridpar.pipeline.parameters.reduce import GradBuckets
from hybridpar.pipeline.parameters.replicas import ReplicaGroup, check_replicas
from hybridpar.precision import set_grad
from hybridpar.sharded.attrs import get_parallel_dim, is_expert_shard

__all__ = ["PipeParameters"]


class PipeParameters(PipeSteps):
    """The parameter methods of `HybridPipe` (its base, above `PipeSteps`)."""

    # set by `HybridPipe.__init__` (hybrid.py)
    _stage_keys: list[list[str]]
    _state_keys: list[str]
    tied_aliases: dict[str, str]
    param_waiters: list[Callable[[], None]]

    def consolidated_state_dict(self) -> dict[str, Tensor]:
        """The unsharded model's full state dict (same keys and shapes), on every rank
        (`pipe.consolidate`: no pickles)."""
        with self._communicating("consolidated_state_dict"):
            return consolidate.consolidated_state_dict(
                self, self.topology, stage_keys=self._stage_keys, state_keys=self._state_keys,
                aliases=self.tied_aliases)

    def load_consolidated_state_dict(self, state_dict: Mapping[str, Tensor], *,
                                     source: str = "the state dict") -> None:
        """Load a full (unsharded) state dict, keeping this rank's stage and tp shard; an
        integer / bool value for a float tensor or a non-finite parameter is a `ValueError`
        naming the key and `source` (its file), on every rank."""
        with self._communicating("load_consolidated_state_dict"):
            consolidate.load_consolidated(self, state_dict, self.topology,
                                          state_keys=self._state_keys,
                                          aliases=self.tied_aliases, source=source)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the global norm over all stages and tp shards (`pipeline.parameters.clip`:
        replicated parameters and ties count once); returns the norm before clipping."""
        with self._communicating("clip_grad_norm_"):
            return clip.clip_grad_norm_(self.parameters(), max_norm, self.topology,
                                        guard=self._guard, not_counted=self._ties.not_counted,
                                        norm_type=norm_type,
                                        sharded=self._grads_here is not None)

    def shard_gradients(self, owners: Mapping[int, int], *,
                        bucket_bytes: int = ZERO2_BUCKET_BYTES,
                        expert_owners: Mapping[int, int] | None = None) -> None:
        """ZeRO-2 from the next step on: each gradient is reduced to the dp rank `owners`
        names (``id(parameter) -> dp rank``, the same on every rank; ties' copies and partial
        replicas with one owner over their groups: `hybridpar.optim.gradient_owners`) and
        lives there only (`pipeline.parameters.grad_shards`), in buckets of up to
        `bucket_bytes` (8 MiB: two are alive during the backward). Under expert parallelism
        the experts' gradients go to the rank of their expert dp group `expert_owners` names
        (none needed when dp = ep: each rank's experts are its own). No-op at dp = 1."""
        topo = self.topology
        if topo.dp == 1:
            return
        experts = self._expert_buckets
        if experts is not None and topo.dp > topo.ep:
            if expert_owners is None:
                raise ValueError("ZeRO-2 with expert parallelism needs expert_owners (each "
                                 "expert slice's rank in its expert dp group): "
                                 "hybridpar.optim.pipe_optimizer(pipe, ..., zero=2) gives them")
            self._expert_buckets = _sharded(experts, topo.expert_dp_group, expert_owners,
                                            bucket_bytes, divisor=topo.dp)
        dense = self._dp_buckets
        self._dp_buckets = _sharded(dense, topo.dp_group, owners, bucket_bytes)
        self._grads_here = {id(p) for p in dense.params if owners.get(id(p), 0) == topo.dp_rank}
        if experts is not None:     # its expert dp rank's share, or (dp = ep) all its own
            mine = dist.get_rank(topo.expert_dp_group) if topo.dp > topo.ep else None
            self._grads_here |= {id(p) for p in experts.params if mine is None
                                 or (expert_owners or {}).get(id(p), 0) == mine}

    def check_replicas(self, *, atol: float = 0.0) -> float:
        """Raise `ReplicaMismatchError` on every rank if the copies of a replicated parameter
        (over tp, over dp, a tie's copies over stages) differ, in values or gradients, by
        more than `atol`; call it on every rank after a `train_step`
        (`pipeline.parameters.replicas`).
        Returns the largest difference."""
        for wait in self.param_waiters:
            wait()
        topo = self.topology
        named = list(dict(self.named_parameters()).items())
        groups = []
        if topo.tp > 1:
            groups.append(ReplicaGroup("tp", topo.tp_group, [
                (n, p) for n, p in named if get_parallel_dim(p) is None]))
        dense = [(n, p) for n, p in named if not is_expert_shard(p)]
        if topo.dp > 1:   # zero 2: each gradient on its owner only, the values compared
            groups.append(ReplicaGroup("dp", topo.dp_group, dense,
                                       grads=self._grads_here is None))
        if topo.dp > topo.ep and len(dense) < len(named):   # the same experts' copies
            groups.append(ReplicaGroup("expert dp", topo.expert_dp_group, [
                (n, p) for n, p in named if is_expert_shard(p)],
                grads=self._grads_here is None))
        name_of = {id(p): n for n, p in named}
        groups += [ReplicaGroup("tie", group, [(name_of[id(p)], p) for p in params])
                   for group, params in self._ties.groups]
        with self._communicating("check_replicas"):
            return check_replicas(groups, rank=topo.rank, world=topo.world_size,
                                  device=self.device, guard=self._guard, atol=atol)


def _sharded(old: GradBuckets | ShardedGradBuckets, group: ProcessGroup,
             owners: Mapping[int, int], bucket_bytes: int, *,
             divisor: int | None = None) -> ShardedGradBuckets:
    """`old`'s parameters' gradients reduced to their `owners` over `group` from now on (the
    old buckets removed, with the gradient views they held)."""
    old.remove()
    for p in old.params:
        set_grad(p, None)
        p.grad = None
    return ShardedGradBuckets(old.params, group, [owners.get(id(p), 0) for p in old.params],
                              bucket_bytes=bucket_bytes, grad_dtype=old.grad_dtype,
                              divisor=divisor)
