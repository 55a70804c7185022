"""HybridPipe: an nn.Sequential run as a multi-process pipeline of tensor-sharded stages."""

from __future__ import annotations

import contextlib
import functools
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridpar import generation
from hybridpar import trace as tracing
from hybridpar.balance.choose import choose_balance
from hybridpar.comm import p2p as comm
from hybridpar.comm.agreement import fail_together
from hybridpar.compile import block_classes, compile_blocks
from hybridpar.device import cuda, is_cuda
from hybridpar.keyed import KeyedInit
from hybridpar.pipeline.activations.checkpoint import RNGReplay, check_checkpoint
from hybridpar.pipeline.activations.kept import SavedActivations
from hybridpar.pipeline.failures.failure import PipelineError
from hybridpar.pipeline.parameters import clip, consolidate
from hybridpar.pipeline.parameters.build import (
    apply_plan,
    as_chunks,
    check_layer_names,
    stage_routes,
    watchdog_timeout,
)
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
from hybridpar.pipeline.parameters.replicas import ReplicaGroup, check_replicas
from hybridpar.pipeline.parameters.tied import (
    Tie,
    TiedGroups,
    aliases,
    detach_other_stages,
    find_ties,
)
from hybridpar.pipeline.runtime.batchnorm import (
    commit_deferred_batch_norms,
    convert_deferred_batch_norm,
)
from hybridpar.pipeline.runtime.executor import StageExecutor, StageSpec
from hybridpar.pipeline.runtime.loss import LossShare
from hybridpar.pipeline.runtime.microbatch import (
    TensorOrTensors,
    rows,
    signature,
    split_batch,
    to_device,
)
from hybridpar.pipeline.runtime.output import share_output
from hybridpar.pipeline.runtime.skip import SkipRoute
from hybridpar.pipeline.runtime.stage_module import StageModule
from hybridpar.pipeline.runtime.step import StepResult
from hybridpar.pipeline.runtime.virtual import RankStages
from hybridpar.pipeline.schedules.layout import Layout
from hybridpar.pipeline.schedules.lowering import lower
from hybridpar.pipeline.schedules.schedule import FORWARD
from hybridpar.precision import cast_parameters, check_dtype_runs, set_grad
from hybridpar.sharded.attrs import (
    get_parallel_dim,
    has_partial_grad,
    register_partial_grad,
)
from hybridpar.tensor_parallel import random as tp_random
from hybridpar.topology import Topology, current_topology

if TYPE_CHECKING:
    from hybridpar.pipeline.tracing.trace_report import TraceReport

__all__ = ["HybridPipe"]


class HybridPipe(StageModule):
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
        module, self.tp_plan_decisions = apply_plan(module, tp_plan, group=topo.tp_group)
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
        self.compiled_blocks = compile_blocks(
            local, classes=block_classes(module),
            backend=compile if isinstance(compile, str) else "inductor") if compile else []
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
        # dp averaging in buckets launched during each step's last backward (no-op at dp=1)
        self._dp_buckets: GradBuckets | ShardedGradBuckets = GradBuckets(
            list(local.parameters()), topo.dp_group if topo.dp > 1 else None,
            grad_dtype=None if param_dtype is None else torch.float32)
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
    def _executors(self) -> list[StageExecutor]:
        """The executor of every stage this rank holds."""
        if self._rank_stages is None:
            return [self._executor]
        return list(self._rank_stages.executors.values())

    @property
    def recorder(self) -> tracing.Recorder:
        """This rank's timeline of the last traced step (`trace=True`), owned by its executor."""
        return self._executor.recorder

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

    def _program(self, microbatches: int, *, train: bool) -> list[Any]:
        """This rank's actions for a step: the schedule lowered with every message in its
        slot (`pipeline.schedules.lowering.lower`; with virtual stages `plan_lowering.lower_plan`,
        as
        (stage, action) items); forward-only steps lower the forwards alone."""
        key = (microbatches, train)
        if key not in self._programs:
            if self._rank_stages is not None:
                self._programs[key] = self.layout.items(
                    self.stage, microbatches, train=train, routes=self._route_pairs)
            else:
                schedule = self.layout.schedule_of(microbatches)
                if not train:
                    schedule = [[a for a in actions if a.kind == FORWARD]
                                for actions in schedule]
                self._programs[key] = lower(schedule, routes=self._route_pairs)[self.stage]
        return self._programs[key]

    def _run(self, actions: list[Any], **options: Any) -> StepResult:
        """Run this rank's `actions` of a step (`StageExecutor.run`'s options)."""
        if self._rank_stages is not None:
            return self._rank_stages.run(actions, **options)
        return self._executor.run(actions, **options)

    # training ----------------------------------------------------------------------------
    def train_step(self, input: TensorOrTensors, target: Any) -> Tensor:
        """Forward and backward of every micro-batch; returns the loss on every rank.

        Gradients accumulate into ``.grad`` as `loss_fn(model(input), target).backward()`
        would on one device (micro-batch losses weighted by their share of the batch), then
        are averaged over the dp group: in buckets all-reduced as they become ready during
        the step's last backward (`pipeline.parameters.reduce.GradBuckets`; at dp > 1 each ``.grad``
        is a view of its bucket's buffer, no second copy). `loss_fn` must reduce by mean.
        """
        inputs, targets, weights = self._microbatches(input, target)
        self._dp_buckets.attach()
        actions = self._program(len(inputs), train=True)
        # as torchgpipe: `checkpoint` as it is now, and no checkpointing in evaluation mode
        mode = check_checkpoint(self.checkpoint) if self.training else "never"
        for executor in self._executors:
            executor.spec.checkpoint = mode
        with self._communicating("train_step"), self._recording("train_step", len(inputs)):
            result = self._run(actions, inputs=inputs, targets=targets,
                               loss_fn=self.loss_fn, weights=weights, train=True,
                               what="train_step", signature=signature(inputs),
                               before_last_backward=self._dp_buckets.arm,
                               when_idle=self._loss.post)
            commit_deferred_batch_norms(self)
            if self.topology.dp > 1:
                with self._guard("the all-reduce of the gradients over dp",
                                 self.topology.dp_group):
                    self._dp_buckets.finish()
            else:
                self._dp_buckets.finish()   # float32 gradients of bf16 weights: bookkeeping
            if self._partial:
                with self._guard("the all-reduce over tp of the gradients of replicated "
                                 "parameters used on shards", self.topology.tp_group):
                    self._partial.reduce(only=self._grads_here)
            if self._ties:
                with self._guard("the all-reduce of tied parameters' gradients over stages",
                                 self.topology.pp_group):
                    self._ties.reduce(only=self._grads_here)
            return self._loss.share(result.loss)

    @torch.no_grad()
    def eval_step(self, input: TensorOrTensors, target: Any) -> Tensor:
        """The loss of `loss_fn(model(input), target)` without gradients, on every rank.

        Forward only (the schedule's forward actions); layers behave as their mode says, so
        call ``.eval()`` first to turn dropout off. Averaged over the dp group.
        """
        inputs, targets, weights = self._microbatches(input, target)
        actions = self._program(len(inputs), train=False)
        with self._communicating("eval_step"), self._recording("eval_step", len(inputs)):
            result = self._run(actions, inputs=inputs, targets=targets,
                               loss_fn=self.loss_fn, weights=weights, train=False,
                               what="eval_step", signature=signature(inputs),
                               when_idle=self._loss.post)
            commit_deferred_batch_norms(self)   # a forward in training mode: as torchgpipe
            return self._loss.share(result.loss)

    @contextlib.contextmanager
    def _recording(self, what: str, microbatches: int) -> Iterator[None]:
        """Record this step's timeline when `trace` is on (replacing the previous one), and
        the peak bytes it kept for backward (`pipeline.activations.kept`: "kept" in the trace's
        table)."""
        if not self.trace:
            yield
            return
        clock = tracing.DeviceClock() if is_cuda(self.device, branch="trace clock") else None
        kept = SavedActivations(exclude=[*self.parameters(), *self.buffers()])
        with self.recorder.recording(what=what, microbatches=microbatches,
                                     schedule=self.schedule, checkpoint=self.checkpoint,
                                     clock=clock), kept.track():
            yield
        self.recorder.meta["kept"] = kept.peak

    def write_trace(self, folder: str | os.PathLike[str], *,
                    show: bool = True) -> TraceReport | None:
        """Write the last traced step of every rank to `folder`; call it on every rank.

        Rank 0 writes ``trace.json`` (Chrome trace: open in https://ui.perfetto.dev, a track
        per rank, arrows from each send to its receive), ``gantt.png`` (when matplotlib is
        installed) and ``table.txt`` (per stage: busy, bubble and wait against the analytic
        bubble), prints the table when `show`, and returns a `TraceReport`; other ranks
        return None. Raises `ValueError` on every rank when nothing was traced.
        """
        from hybridpar.pipeline.tracing.trace_report import write_trace

        return write_trace(self, folder, show=show)

    def _microbatches(self, input: TensorOrTensors, target: Any
                      ) -> tuple[list[Any], list[Any], list[float]]:
        """Input and target micro-batches, and each one's share of the batch."""
        if self.loss_fn is None:
            raise ValueError("train_step needs a loss: HybridPipe(..., loss_fn=fn) where "
                             "fn(output_microbatch, target_microbatch) returns a scalar")
        inputs = split_batch(input, self.chunks, "input")
        targets = split_batch(target, self.chunks, "target")
        if len(targets) != len(inputs) or rows(input) != rows(target):
            raise ValueError(f"input has {rows(input)} rows but target has {rows(target)}; "
                             "they must have the same batch size")
        total = rows(input)
        weights = [rows(x) / total for x in inputs]
        if 0 in self.stages:
            inputs = [to_device(x, self.device) for x in inputs]
        if self.layout.stages - 1 in self.stages:
            targets = [to_device(y, self.device) for y in targets]
        return inputs, targets, weights

    @contextlib.contextmanager
    def _communicating(self, what: str) -> Iterator[None]:
        """A block that talks to other ranks: refused on process groups a failed step broke
        (`generation`), which a `PipelineError` out of it breaks (so does a failed action:
        `StageStops.raise_at`; errors every rank raises together leave them usable). The
        rank's watchdog (if on) watches the block, and on a GPU afterwards until the device
        has done the work it queued (`pipeline.failures.watchdog`): the host may wait for that
        anywhere
        (``float(loss)``).
        """
        generation.check_usable(self.topology.generation, what)
        dog = self._executor.watchdog
        if dog is not None:
            dog.enter()
        until = None
        try:
            yield
            if dog is not None and is_cuda(self.device, branch="watch the device"):
                event = cuda().event()
                event.record()
                until = event.query
        except PipelineError as e:
            generation.mark_broken(f"{what} failed: {type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}")
            raise
        finally:
            if dog is not None:
                dog.leave(until=until)

    def _guard(self, operation: str, group: Any) -> contextlib.AbstractContextManager[None]:
        """A collective outside the schedule: a timeout becomes a `PipelineError` block."""
        return self._executor.guard(operation, dist.get_process_group_ranks(group), group)

    # inference ---------------------------------------------------------------------------
    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        """Inference over the pipeline (no grad); the full output on every rank.

        The last stage must return a Tensor or a tuple of Tensors (else a `TypeError` on every
        rank); its output reaches the other stages as tensors with a shape header (no pickles).
        """
        inputs = split_batch(input, self.chunks, "input")
        if 0 in self.stages:
            inputs = [to_device(x, self.device) for x in inputs]
        actions = self._program(len(inputs), train=False)
        with self._communicating("forward"):
            with self._recording("forward", len(inputs)):
                result = self._run(actions, inputs=inputs, targets=None, loss_fn=None,
                                   weights=[1.0] * len(inputs), train=False,
                                   what="forward", signature=signature(inputs))
            # deferred BatchNorm in training mode: this mini-batch's statistics, committed
            # now (torchgpipe commits after its last micro-batch; a later train_step is its
            # own update)
            commit_deferred_batch_norms(self)
            return share_output(result.outputs if self.layout.last_rank == self.stage else None,
                                self.topology, self._guard, last=self.layout.last_rank)

    # state -------------------------------------------------------------------------------
    def consolidated_state_dict(self) -> dict[str, Tensor]:
        """The unsharded model's full state dict (same keys and shapes), on every rank
        (`pipeline.parameters.consolidate`: no pickles)."""
        with self._communicating("consolidated_state_dict"):
            return consolidate.consolidated_state_dict(
                self, self.topology, stage_keys=self._stage_keys, state_keys=self._state_keys,
                aliases=self.tied_aliases)

    def load_consolidated_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Load a full (unsharded) state dict, keeping this rank's stage and tp shard."""
        with self._communicating("load_consolidated_state_dict"):
            consolidate.load_consolidated(self, state_dict, self.topology,
                                          state_keys=self._state_keys,
                                          aliases=self.tied_aliases)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the global norm over all stages and tp shards (`pipeline.parameters.clip`:
        replicated
        parameters and ties count once); returns the norm before clipping."""
        with self._communicating("clip_grad_norm_"):
            return clip.clip_grad_norm_(self.parameters(), max_norm, self.topology,
                                        guard=self._guard, not_counted=self._ties.not_counted,
                                        norm_type=norm_type,
                                        sharded=self._grads_here is not None)

    def shard_gradients(self, owners: Mapping[int, int]) -> None:
        """ZeRO-2 from the next step on: each gradient is reduced to the dp rank `owners`
        names (``id(parameter) -> dp rank``, the same on every rank; ties' copies and partial
        replicas with one owner over their groups: `hybridpar.optim.gradient_owners`) and
        lives there only (`pipeline.parameters.grad_shards`). No-op at dp = 1."""
        topo = self.topology
        if topo.dp == 1:
            return
        old = self._dp_buckets
        params = old.params
        old.remove()
        for p in params:                 # the old buckets' views: dropped with them
            set_grad(p, None)
            p.grad = None
        self._dp_buckets = ShardedGradBuckets(
            params, topo.dp_group, [owners.get(id(p), 0) for p in params],
            grad_dtype=old.grad_dtype)
        self._grads_here = {id(p) for p in params if owners.get(id(p), 0) == topo.dp_rank}

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
        if topo.dp > 1:   # zero 2: each gradient on its owner only, the values compared
            groups.append(ReplicaGroup("dp", topo.dp_group, named,
                                       grads=self._grads_here is None))
        name_of = {id(p): n for n, p in named}
        groups += [ReplicaGroup("tie", group, [(name_of[id(p)], p) for p in params])
                   for group, params in self._ties.groups]
        with self._communicating("check_replicas"):
            return check_replicas(groups, rank=topo.rank, world=topo.world_size,
                                  device=self.device, guard=self._guard, atol=atol)

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
