"""HybridPipe's steps: `train_step`, `eval_step` and `forward` run this rank's program of the
schedule (lowered once per micro-batch count), traced on demand, watched, guarded."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from hybridpar import trace as tracing
from hybridpar.device import cuda, is_cuda
from hybridpar.pipeline.activations.checkpoint import check_checkpoint
from hybridpar.pipeline.activations.kept import SavedActivations
from hybridpar.pipeline.failures.failure import PipelineError
from hybridpar.pipeline.parameters.grad_shards import ShardedGradBuckets
from hybridpar.pipeline.parameters.partial import PartialGrads
from hybridpar.pipeline.parameters.reduce import GradBuckets
from hybridpar.pipeline.parameters.tied import TiedGroups
from hybridpar.pipeline.runtime.batchnorm import commit_deferred_batch_norms
from hybridpar.pipeline.runtime.executor import StageExecutor
from hybridpar.pipeline.runtime.loss import LossShare
from hybridpar.pipeline.runtime.microbatch import (
    TensorOrTensors,
    rows,
    signature,
    split_batch,
    to_device,
)
from hybridpar.pipeline.runtime.output import share_output
from hybridpar.pipeline.runtime.stage_module import StageModule
from hybridpar.pipeline.runtime.step import StepResult
from hybridpar.pipeline.runtime.virtual import RankStages
from hybridpar.pipeline.schedules.layout import Layout
from hybridpar.pipeline.schedules.lowering import lower
from hybridpar.pipeline.schedules.schedule import FORWARD
from hybridpar.process import generation
from hybridpar.topology import Topology

if TYPE_CHECKING:
    from hybridpar.pipeline.tracing.trace_report import TraceReport

__all__ = ["PipeSteps"]


class PipeSteps(StageModule):
    """The step methods of `HybridPipe` (its base: the pipe builds the state they read)."""

    # set by `HybridPipe.__init__` (hybrid.py)
    topology: Topology
    layout: Layout
    chunks: int
    stage: int
    stages: tuple[int, ...]
    checkpoint: str
    schedule: str
    loss_fn: Callable[..., Tensor] | None
    trace: bool
    _dp_buckets: GradBuckets | ShardedGradBuckets
    _expert_buckets: GradBuckets | ShardedGradBuckets | None
    _partial: PartialGrads
    _ties: TiedGroups
    _grads_here: set[int] | None
    _programs: dict[tuple[int, bool], list[Any]]
    _route_pairs: list[tuple[int, int]]
    _executor: StageExecutor
    _rank_stages: RankStages | None
    _loss: LossShare

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

    def _program(self, microbatches: int, *, train: bool) -> list[Any]:
        """This rank's actions for a step: the schedule lowered with every message in its
        slot (`pipeline.schedules.lowering.lower`; with virtual stages `plan_lowering.lower_plan`,
        as (stage, action) items); forward-only steps lower the forwards alone."""
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
        if self._expert_buckets is not None:
            self._expert_buckets.attach()
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
            if self._expert_buckets is not None:   # (zero 0 / 1: reduced after the step;
                # zero 2: during each backward, as the dense buckets, then drained here)
                with self._guard("the all-reduce of the experts' gradients over the dp ranks "
                                 "holding them", self.topology.expert_dp_group):
                    self._expert_buckets.finish()
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
        anywhere (``float(loss)``).
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
