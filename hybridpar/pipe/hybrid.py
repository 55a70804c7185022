"""HybridPipe: an nn.Sequential run as a multi-process pipeline of tensor-sharded stages: its
construction (this rank's stages, ties, buckets, executors) and the views of them."""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from hybridpar.balance.choose import choose_balance
from hybridpar.comm import p2p as comm
from hybridpar.comm.agreement import fail_together
from hybridpar.keyed import KeyedInit
from hybridpar.moe.hf_blocks import shard_experts
from hybridpar.packing import SEQUENCE_PARALLEL_PACKED, is_packed
from hybridpar.pipe.build import (
    apply_plan,
    as_chunks,
    check_layer_names,
    stage_routes,
    watchdog_timeout,
)
from hybridpar.pipe.parameters import PipeParameters
from hybridpar.pipeline.activations.checkpoint import RNGReplay, check_checkpoint
from hybridpar.pipeline.parameters.grad_shards import ShardedGradBuckets
from hybridpar.pipeline.parameters.partial import PartialGrads
from hybridpar.pipeline.parameters.partition import (
    check_balance,
    check_sequential,
    free_layers,
    materialize,
    split,
    stage_bounds,
)
from hybridpar.pipeline.parameters.reduce import GradBuckets
from hybridpar.pipeline.parameters.tied import (
    Tie,
    TiedGroups,
    aliases,
    detach_other_stages,
    find_ties,
)
from hybridpar.pipeline.runtime.batchnorm import convert_deferred_batch_norm
from hybridpar.pipeline.runtime.executor import StageExecutor, StageSpec
from hybridpar.pipeline.runtime.loss import LossShare
from hybridpar.pipeline.runtime.microbatch import TensorOrTensors
from hybridpar.pipeline.runtime.skip import SkipRoute
from hybridpar.pipeline.runtime.virtual import RankStages
from hybridpar.pipeline.schedules.layout import Layout
from hybridpar.precision import cast_parameters, check_dtype_runs
from hybridpar.process import generation
from hybridpar.sharded.attrs import (
    has_partial_grad,
    is_expert_shard,
    register_partial_grad,
    tags_kept,
)
from hybridpar.tensor_parallel import random as tp_random
from hybridpar.topology import Topology, current_topology

if TYPE_CHECKING:
    pass

__all__ = ["HybridPipe"]


class HybridPipe(PipeParameters):
    """Pipeline parallelism over `topology.pp` stages, with tp-sharded layers inside stages.

    Every rank builds the same `nn.Sequential` (same seed, or on the `meta` device); each keeps
    only the layers of its stage, under their original names (``"3.fc1.weight"``).

    ``watchdog``: a thread that reports a step with no progress for the topology timeout (or
    that many seconds) and stops the stage when a peer published its failure; on by default
    on GPUs, where NCCL waits do not time out on the host (`pipeline.failures.watchdog`). On gloo
    without it, a lighter listener stops the stage when a peer failed
    (`pipeline.failures.listener`).

    ``init_fn``: for a model built on the `meta` device, a callable applied to every module
    of the stage after `to_empty` (e.g. a Hugging Face model's ``_init_weights``), or a
    `hybridpar.keyed.KeyedInit` (each module drawn under a seed keyed by its name: the same
    values in every layout); without it, ``KeyedInit(torch.initial_seed())``: each module's
    ``reset_parameters()``, keyed. A tensor left uninitialized is an error
    (`pipeline.parameters.partition.materialize`).

    ``schedule="interleaved"`` (``virtual_stages=v``, default 2) or ``"zbv"`` (2) cut the model
    into pp * v stages, `balance` giving one layer count per stage, and each rank holds v of
    them (looped, or a V: `pipeline.schedules.layout`), run as one program
    (`pipeline.runtime.virtual`).

    ``param_dtype=torch.bfloat16``: the stage's parameters in bf16, their gradients summed
    over micro-batches (and dp) in float32 as ``param.main_grad`` (`hybridpar.precision`);
    step them with `hybridpar.optim.MasterWeights` (float32 master weights) under autocast.

    ``trace=True`` (or setting ``pipe.trace = True`` between steps) records the timeline of
    every `train_step`, `eval_step` and forward, keeping the last one; `write_trace` then
    writes it for all ranks (Chrome trace, Gantt chart, bubble table). Off, it costs nothing.

    ``sequence_parallel=True`` (tp > 1): a Hugging Face model (`hybridpar.hf.to_sequential`
    with a tp plan) runs its norms and residuals on 1 / tp of the tokens (`hf.sequence`); the
    built-in gpt takes it at build time instead (``gpt(sequence_parallel=True)``).

    ``compile=True``: each of the stage's blocks (a layer class with parameters that the model
    repeats) compiled in place with `torch.compile`, once per class (`hybridpar.compile`); a
    string names the backend instead of ``"inductor"`` (``"aot_eager"``: no C++ compiler).
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int] | str, *, chunks: int = 1,
                 topology: Topology | None = None, schedule: str = "gpipe",
                 checkpoint: str = "except_last", loss_fn: Callable[..., Tensor] | None = None,
                 tp_plan: Any = None, deferred_batch_norm: bool = False,
                 balance_sample: TensorOrTensors | None = None, trace: bool = False,
                 watchdog: bool | float | None = None,
                 init_fn: Callable[[nn.Module], None] | None = None,
                 virtual_stages: int | None = None,
                 param_dtype: torch.dtype | None = None, compile: bool | str = False,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        check_sequential(module)
        chunks = as_chunks(chunks)
        checkpoint = check_checkpoint(checkpoint)   # any object whose str() is a mode
        topo = topology if topology is not None else current_topology()
        generation.check_usable(topo.generation, "HybridPipe(...)")
        if param_dtype is not None:
            check_dtype_runs(param_dtype, topo.device, what="HybridPipe(param_dtype=...)")
        if init_fn is None:   # a meta-built model: drawn by name, the same in every layout
            init_fn = KeyedInit(torch.initial_seed())
        #: the virtual stages of the model, where each lives (stage -> pp rank), the plan
        self.layout = Layout.of(schedule, topo.pp, virtual_stages)
        if sequence_parallel and topo.tp > 1 and is_packed(module):   # the config's refusal
            raise ValueError(SEQUENCE_PARALLEL_PACKED)
        module, self.tp_plan_decisions = apply_plan(module, tp_plan, group=topo.tp_group)
        if topo.ep > 1:   # a Hugging Face model's sparse blocks: this rank's experts
            shard_experts(module, topo.ep_group)
        if sequence_parallel and topo.tp > 1:   # a Hugging Face decoder (`hf.sequence`)
            from hybridpar.hf.sequence import sequence_parallel as shard_sequence

            shard_sequence(module, topo.tp_group)
        partial = {n for n, p in module.named_parameters(remove_duplicate=False)
                   if has_partial_grad(p)}   # (kept by name: a meta build loses attributes)
        if isinstance(balance, str):
            balance = choose_balance(module, balance, topo, sample=balance_sample, chunks=chunks,
                                     init_fn=init_fn, parts=self.layout.stages)
        counts = check_balance(module, balance, self.layout.stages,
                               unit=self.layout.unit)
        routes = stage_routes(module, counts)
        if deferred_batch_norm:
            module = convert_deferred_batch_norm(module, chunks)

        self.topology, self.balance, self.chunks = topo, counts, chunks
        self.stage, self.num_stages = topo.pp_rank, topo.pp
        #: the virtual stages this rank holds, in forward order (``(stage,)`` without them)
        self.stages = self.layout.stages_of(self.stage)
        self.checkpoint, self.schedule, self.loss_fn = checkpoint, schedule, loss_fn
        self.trace = trace
        self.device = topo.device
        ties = find_ties(module, counts)
        #: ``{name: canonical name}`` of parameters held under several names
        # (`pipeline.parameters.tied`)
        self.tied_aliases = aliases(ties)
        self._state_keys = list(module.state_dict().keys())
        names = list(module._modules)
        local = self._keep_stage(module, counts, ties, init_fn=init_fn)
        if param_dtype is not None:   # low-precision weights, float32 gradients (`precision`)
            cast_parameters(local, param_dtype)
        #: the layers compiled (`hybridpar.compile`: the model's repeated blocks, in place)
        self.compiled_blocks: list[str] = []
        if compile:   # imported here: torch._dynamo takes 2 s to import, a run without it none
            from hybridpar.compile import block_classes, compile_blocks

            self.compiled_blocks = compile_blocks(
                local, classes=block_classes(module),
                backend=compile if isinstance(compile, str) else "inductor")
        # copies of a parameter tied across stages: equal at the start, gradients summed
        self._ties = TiedGroups(ties, dict(local.named_parameters(remove_duplicate=False)),
                                topo, placement=self.layout.placement)
        self._ties.sync()
        # replicated parameters used on tp shards: their gradients summed over tp
        mine = [(n, p) for n, p in local.named_parameters(remove_duplicate=False)
                if n in partial]
        for _, p in mine:
            register_partial_grad(p)
        #: the parameters of this rank whose gradients are summed over tp after each step
        #: (`pipeline.parameters.partial`), by name
        self.partial_grads = [n for n, _ in mine]
        self._partial = PartialGrads([p for _, p in mine], topo.tp_group if topo.tp > 1
                                     else None)
        # dp averaging in buckets launched during each step's last backward (no-op at dp=1);
        # experts sharded over ep: summed over the dp ranks holding the same ones, / dp
        experts = [p for p in local.parameters() if is_expert_shard(p)]
        if experts and topo.ep == 1:
            raise ValueError("the model holds a slice of its experts (built with ep > 1) but "
                             "the topology has ep = 1; pass hybridpar.init(ep=...) the ep the "
                             "model was built with")
        grad_dtype = None if param_dtype is None else torch.float32
        self._dp_buckets: GradBuckets | ShardedGradBuckets = GradBuckets(
            [p for p in local.parameters() if not is_expert_shard(p)],
            topo.dp_group if topo.dp > 1 else None, grad_dtype=grad_dtype)
        self._expert_buckets: GradBuckets | ShardedGradBuckets | None = GradBuckets(
            experts, topo.expert_dp_group if topo.dp > topo.ep else None,
            grad_dtype=grad_dtype, divisor=topo.dp) if experts else None
        self._grads_here: set[int] | None = None   # zero 2: ids of the parameters owned
        #: called before the parameters are read outside a forward (the replica check): a
        #: sharded optimizer's update still on the wire (`optim.update_broadcast`)
        self.param_waiters: list[Callable[[], None]] = []
        self._route_pairs = [(r.src, r.dst) for r in routes]
        self._programs: dict[tuple[int, bool], list[Any]] = {}
        self._executor, self._rank_stages = self._build_executors(routes, watchdog=watchdog)
        self._loss = LossShare(topo, self._guard, last=self.layout.last_rank)
        # the stage's layers, last: a name every rank checks against the pipe's attributes
        check_layer_names(self, names)
        for name, layer in local.named_children():
            self.add_module(name, layer)

    def _keep_stage(self, module: nn.Sequential, counts: list[int], ties: list[Tie], *,
                    init_fn: Callable[[nn.Module], None] | None) -> nn.Sequential:
        """Split `module` by `counts` and keep this rank's stages, materialized on its device
        (the other stages' layers are released); notes each rank's state-dict keys."""
        stages = split(module, counts)
        mine = set(self.stages)
        self._stage_keys = [[k for s in self.layout.stages_of(r) for k in stages[s].state_dict()
                             if k not in self.tied_aliases] for r in range(self.num_stages)]
        detach_other_stages(stages, mine, ties)
        free_layers(stages, keep=mine)
        self._parts = {s: stages[s] for s in self.stages}
        local = nn.Sequential(OrderedDict((name, layer) for s in self.stages
                                          for name, layer in stages[s].named_children()))
        with fail_together((TypeError, ValueError, RuntimeError, NotImplementedError)):
            # a stage of its own: may fail on this rank only
            materialize(local, self.device, init_fn=init_fn)
            with tags_kept(local):
                local.to(self.device)
        return local

    def _build_executors(self, routes: list[SkipRoute], *, watchdog: bool | float | None
                         ) -> tuple[StageExecutor, RankStages | None]:
        """The executor of each stage this rank holds (`pipeline.runtime.executor`): the first, and
        with virtual stages the rank's program over all of them (`pipeline.runtime.virtual`)."""
        topo, layout = self.topology, self.layout
        timeout = watchdog_timeout(watchdog, topo)
        wire = comm.Wire(tags=topo.p2p_tags, coalesce=self.device.type != "cpu")
        executors = [StageExecutor(StageSpec(
            stage=s, num_stages=layout.stages, partition=self._parts[s], routes=routes,
            rank_of_stage=lambda t: topo.stage_rank(layout.placement[t]),
            tp_group=topo.tp_group if topo.tp > 1 else None,
            timeout=topo.timeout, checkpoint=self.checkpoint,
            replay=RNGReplay(functools.partial(tp_random.get_rng_state_all, self.device),
                             tp_random.set_rng_state_all, device_type=self.device.type),
            device=self.device, p2p_tags=topo.p2p_tags,
            watchdog=timeout if k == 0 else None,
            local_stages=frozenset(self.stages) - {s}, listen=k == 0), wire=wire)
            for k, s in enumerate(self.stages)]
        if layout.virtual == 1:
            return executors[0], None
        return executors[0], RankStages(executors)

    # the local stage ---------------------------------------------------------------------
    @property
    def partition(self) -> nn.Sequential:
        """This rank's stage as an `nn.Sequential` (original layer names; with virtual stages
        all of the rank's layers, in order)."""
        if self._rank_stages is None:
            return self._executor.spec.partition
        return nn.Sequential(OrderedDict(self.named_children()))

    @property
    def layers(self) -> tuple[int, ...]:
        """The indices in the model of the layers this rank holds, ascending."""
        bounds = stage_bounds(self.balance)
        return tuple(i for s in self.stages for i in range(*bounds[s]))

    @property
    def p2p_log(self) -> list[Any] | None:
        """Set to a list to record every group of P2P operations this rank issues (a list of
        `hybridpar.pipeline.schedules.replay.P2POp` per group) for the NCCL replay; None: off."""
        return self._executor.wire.log

    @p2p_log.setter
    def p2p_log(self, log: list[Any] | None) -> None:
        self._executor.wire.log = log

    @property
    def skip_routes(self) -> tuple[dict[int, list[SkipRoute]], dict[int, list[SkipRoute]]]:
        """The skips this rank's (first) stage receives and sends: ({source stage: routes},
        {destination stage: routes}), each list in the order its message carries them."""
        return self.skips_of(self.stages[0])

    def skips_of(self, stage: int) -> tuple[dict[int, list[SkipRoute]],
                                            dict[int, list[SkipRoute]]]:
        """`skip_routes` of one of the stages this rank holds (`stages`)."""
        executor = self._executor_of(stage)
        return executor.skip_in, executor.skip_out

    def partition_of(self, stage: int) -> nn.Sequential:
        """The layers of one of the stages this rank holds (`stages`), original names."""
        return self._executor_of(stage).spec.partition

    def _executor_of(self, stage: int) -> StageExecutor:
        for executor in self._executors:
            if executor.spec.stage == stage:
                return executor
        raise ValueError(f"rank {self.stage} holds stages {list(self.stages)}, not {stage}")

    def close(self) -> None:
        """Stop this rank's helper threads (the listener, the watchdog) before the process
        group goes: a thread inside a store read while the interpreter exits aborts it.
        Steps still run afterwards, without them."""
        for executor in self._executors:
            executor.listener.close()
            if executor.watchdog is not None:
                executor.watchdog.close()

    def extra_repr(self) -> str:
        return (f"stage={self.stage}/{self.num_stages}, balance={self.balance}, "
                f"chunks={self.chunks}, schedule={self.schedule!r}, "
                f"checkpoint={self.checkpoint!r}")
