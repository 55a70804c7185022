"""HybridPipe: an nn.Sequential run as a multi-process pipeline of tensor-sharded stages."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridpar import trace as tracing
from hybridpar.agreement import fail_together
from hybridpar.broadcast import broadcast_tensors
from hybridpar.pipeline import clip, consolidate
from hybridpar.pipeline.batchnorm import commit_deferred_batch_norms, convert_deferred_batch_norm
from hybridpar.pipeline.checkpoint import RNGReplay, check_checkpoint
from hybridpar.pipeline.executor import StageExecutor, StageSpec
from hybridpar.pipeline.loss import LossShare
from hybridpar.pipeline.lowering import lower
from hybridpar.pipeline.microbatch import TensorOrTensors, rows, signature, split_batch, to_device
from hybridpar.pipeline.output import share_output
from hybridpar.pipeline.partition import (
    check_balance,
    check_sequential,
    free_layers,
    materialize,
    split,
)
from hybridpar.pipeline.reduce import GradBuckets
from hybridpar.pipeline.schedule import FORWARD, get_schedule
from hybridpar.pipeline.skip import skip_routes
from hybridpar.pipeline.tied import (
    TiedGroups,
    aliases,
    check_kept,
    detach_other_stages,
    find_ties,
    names_by_id,
)
from hybridpar.tensor_parallel import random as tp_random
from hybridpar.tensor_parallel.attrs import get_parallel_dim
from hybridpar.topology import Topology, current_topology

if TYPE_CHECKING:
    from hybridpar.pipeline.trace_report import TraceReport

__all__ = ["HybridPipe"]

log = logging.getLogger(__name__)



def _choose_balance(module: nn.Sequential, name: str, topo: Topology,
                    sample: TensorOrTensors | None, chunks: int,
                    init_fn: Callable[[nn.Module], None] | None) -> list[int]:
    """Resolve ``balance="time" | "size" | "params" | "uniform"`` to the same list on every rank.

    Global rank 0 profiles and broadcasts its choice; when the model already holds sharded
    layers (their collectives need every tp peer), every rank profiles alongside it.
    """
    from hybridpar.balance import BALANCERS, balance_by

    if name not in BALANCERS:
        raise ValueError(f"unknown balance {name!r}; give a list of layer counts per stage or "
                         "one of " + ", ".join(repr(b) for b in BALANCERS))
    if name in ("time", "size") and sample is None:
        raise ValueError(f"balance={name!r} profiles the model on a sample: pass "
                         "balance_sample=<a mini-batch of input> (one rank profiles it), or use "
                         "balance='params' / 'uniform'")
    sharded = any(get_parallel_dim(p) is not None for p in module.parameters())
    # profiled on the run's device, under the caller's autocast (timing synchronises it)
    options: dict[str, Any] = {"tp": topo.tp, "device": topo.device, "init_fn": init_fn} \
        if name in ("time", "size") else {}
    if name == "size":
        options["chunks"] = chunks
    choice: list[int] = []
    with fail_together((ValueError, TypeError, RuntimeError)):  # profiling may fail on one rank
        if topo.rank == 0 or (sharded and name in ("time", "size")):
            choice = list(balance_by(name, topo.pp, module, sample, **options))
    (counts,) = broadcast_tensors(
        (torch.tensor(choice, dtype=torch.int64),) if topo.rank == 0 else None, 0,
        device=topo.device)
    if topo.rank == 0:
        log.info("balance=%r chose %s for %d stages", name, choice, topo.pp)
    return [int(c) for c in counts.tolist()]


def _as_chunks(chunks: object) -> int:
    """`chunks` as an int: an int or an integral number (torchgpipe takes ``int(chunks)``),
    at least 1; a bool, a fraction or anything else is a `ValueError`."""
    if isinstance(chunks, bool) or (not isinstance(chunks, (int, float)) and not hasattr(
            chunks, "__index__")):
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    value = int(chunks)
    if value != chunks or value < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    return value


def _check_layer_names(pipe: nn.Module, names: Sequence[str]) -> None:
    """A `ValueError` when a layer's name is an attribute of the pipe (``"checkpoint"``).

    The pipe holds its stage's layers under their own names (layout-free parameter names), so
    a layer may not take the name of one of its attributes. Every rank checks every layer's
    name, so a clash on one stage stops all of them alike.
    """
    clash = [name for name in names if hasattr(pipe, name)]
    if clash:
        raise ValueError(
            f"layer name(s) {clash} are attributes of HybridPipe (it keeps every layer under "
            "its own name, so that parameter names stay those of the model); rename them, e.g. "
            "nn.Sequential(OrderedDict([('ckpt', layer), ...])) instead of 'checkpoint'")


def _watchdog_timeout(watchdog: bool | float | None, topo: Topology
                      ) -> datetime.timedelta | None:
    """None / True / seconds / False -> how long a step may make no progress (None: off).

    By default the watchdog runs on GPUs only: on gloo every wait is bounded already.
    """
    if watchdog is None:
        watchdog = topo.device.type == "cuda"
    if watchdog is False:
        return None
    if watchdog is True:
        return topo.timeout
    if isinstance(watchdog, (int, float)) and watchdog > 0:
        return datetime.timedelta(seconds=float(watchdog))
    raise ValueError(f"watchdog must be True, False, None or positive seconds, got {watchdog!r}")


class HybridPipe(nn.Module):
    """Pipeline parallelism over `topology.pp` stages, with tp-sharded layers inside stages.

    Every rank builds the same `nn.Sequential` (same seed, or on the `meta` device); each keeps
    only the layers of its stage, under their original names (``"3.fc1.weight"``).

    ``watchdog``: a thread that reports a step with no progress for the topology timeout (or
    that many seconds) and stops the stage when a peer published its failure; on by default
    on GPUs, where NCCL waits do not time out on the host (`pipeline.watchdog`). On gloo
    without it, a lighter listener stops the stage when a peer failed (`pipeline.listener`).

    ``init_fn``: for a model built on the `meta` device, a callable applied to every module
    of the stage after `to_empty` (e.g. a Hugging Face model's ``_init_weights``); without it,
    each module's ``reset_parameters()``. A tensor left uninitialized is an error
    (`pipeline.partition.materialize`).

    ``trace=True`` (or setting ``pipe.trace = True`` between steps) records the timeline of
    every `train_step`, `eval_step` and forward, keeping the last one; `write_trace` then
    writes it for all ranks (Chrome trace, Gantt chart, bubble table). Off, it costs nothing.
    """

    def __init__(self, module: nn.Sequential, balance: Sequence[int] | str, *, chunks: int = 1,
                 topology: Topology | None = None, schedule: str = "gpipe",
                 checkpoint: str = "except_last", loss_fn: Callable[..., Tensor] | None = None,
                 tp_plan: Any = None, deferred_batch_norm: bool = False,
                 balance_sample: TensorOrTensors | None = None, trace: bool = False,
                 watchdog: bool | float | None = None,
                 init_fn: Callable[[nn.Module], None] | None = None) -> None:
        super().__init__()
        check_sequential(module)
        chunks = _as_chunks(chunks)
        checkpoint = check_checkpoint(checkpoint)   # any object whose str() is a mode
        self.schedule_fn = get_schedule(schedule)
        topo = topology if topology is not None else current_topology()
        self.tp_plan_decisions: list[str] = []
        if tp_plan is not None:
            from hybridpar.tensor_parallel.plan import apply_tp_plan, plan_decisions

            tied = names_by_id(module)
            module = check_sequential(apply_tp_plan(module, tp_plan, group=topo.tp_group))
            check_kept(tied, module)
            self.tp_plan_decisions = plan_decisions(module)
        if isinstance(balance, str):
            balance = _choose_balance(module, balance, topo, balance_sample, chunks, init_fn)
        counts = check_balance(module, balance, topo.pp)
        try:
            routes = skip_routes(module, counts)
        except TypeError as e:   # torchgpipe's verify_skippables says what, not how to fix
            raise TypeError(f"{e}\nEvery stash('name') needs one pop('name') in a later layer "
                            "and every pop a stash before it; a skippable layer used twice needs "
                            "its own namespace: layer.isolate(Namespace())") from None
        if deferred_batch_norm:
            module = convert_deferred_batch_norm(module, chunks)

        self.topology, self.balance, self.chunks = topo, counts, chunks
        self.stage, self.num_stages = topo.pp_rank, topo.pp
        self.checkpoint, self.schedule, self.loss_fn = checkpoint, schedule, loss_fn
        self.trace = trace
        ties = find_ties(module, counts)
        #: ``{name: canonical name}`` of parameters held under several names (`pipeline.tied`)
        self.tied_aliases = aliases(ties)
        self._state_keys = list(module.state_dict().keys())
        names = list(module._modules)
        stages = split(module, counts)
        self._stage_keys = [[k for k in stage.state_dict() if k not in self.tied_aliases]
                            for stage in stages]
        local = stages[self.stage]
        detach_other_stages(stages, self.stage, ties)
        free_layers(stages, keep=self.stage)
        self.device = topo.device
        with fail_together((TypeError, ValueError, RuntimeError, NotImplementedError)):
            # a stage of its own: may fail on this rank only
            materialize(local, self.device, init_fn=init_fn)
            local.to(self.device)
        # copies of a parameter tied across stages: equal at the start, gradients summed
        self._ties = TiedGroups(ties, dict(local.named_parameters(remove_duplicate=False)),
                                topo)
        self._ties.sync()
        # dp averaging in buckets launched during each step's last backward (no-op at dp=1)
        self._dp_buckets = GradBuckets(list(local.parameters()),
                                       topo.dp_group if topo.dp > 1 else None)
        self._route_pairs = [(r.src, r.dst) for r in routes]
        self._programs: dict[tuple[int, bool], list[Any]] = {}
        self._executor = StageExecutor(StageSpec(
            stage=self.stage, num_stages=self.num_stages, partition=local, routes=routes,
            rank_of_stage=topo.stage_rank, tp_group=topo.tp_group if topo.tp > 1 else None,
            timeout=topo.timeout, checkpoint=checkpoint,
            replay=RNGReplay(tp_random.get_rng_state_all, tp_random.set_rng_state_all,
                             device_type=self.device.type),
            device=self.device, p2p_tags=topo.p2p_tags,
            watchdog=_watchdog_timeout(watchdog, topo)))
        self._loss = LossShare(topo, self._guard)
        # the stage's layers, last: a name every rank checks against the pipe's attributes
        _check_layer_names(self, names)
        for name, layer in local.named_children():
            self.add_module(name, layer)

    # the local stage ---------------------------------------------------------------------
    @property
    def partition(self) -> nn.Sequential:
        """This rank's stage as an `nn.Sequential` (original layer names)."""
        return self._executor.spec.partition

    # sequence-like over this stage's layers, as torchgpipe's GPipe over the whole model
    def __len__(self) -> int:
        return len(self.partition)

    def __getitem__(self, index: int) -> nn.Module:
        return self.partition[index]

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self.partition)

    # moving is denied (as torchgpipe): the stage lives on `topology.device`; casts are allowed
    def cuda(self, device: int | torch.device | None = None) -> HybridPipe:
        target = torch.device("cuda", device) if isinstance(device, int) else \
            torch.device(device if device is not None else "cuda")
        self._deny_move(target)
        return super().cuda(device)

    def cpu(self) -> HybridPipe:
        self._deny_move(torch.device("cpu"))
        return super().cpu()

    def to(self, *args: Any, **kwargs: Any) -> HybridPipe:
        device = kwargs.get("device", args[0] if args else None)
        tensor = kwargs.get("tensor", device if isinstance(device, Tensor) else None)
        if tensor is not None:
            self._deny_move(tensor.device)
        elif isinstance(device, int) and not isinstance(device, bool):
            self._deny_move(torch.device(
                "cuda" if self.device.type == "cpu" else self.device.type, device))
        elif isinstance(device, (str, torch.device)):
            self._deny_move(torch.device(device))
        return super().to(*args, **kwargs)

    def _deny_move(self, target: torch.device) -> None:
        """A `TypeError` unless `target` is this stage's device (then nothing moves)."""
        if target.type == self.device.type and target.index in (None, self.device.index):
            return
        raise TypeError(
            f"HybridPipe keeps its stage on {self.device} (topology.device) and cannot move it "
            f"to {target}: the stage's messages and micro-batches live there. Choose the device "
            "through hybridpar.init (one device per rank, cuda:LOCAL_RANK with NCCL); casting is "
            "allowed (pipe.to(torch.bfloat16))")

    @property
    def recorder(self) -> tracing.Recorder:
        """This rank's timeline of the last traced step (`trace=True`), owned by its executor."""
        return self._executor.recorder

    @property
    def p2p_log(self) -> list[Any] | None:
        """Set to a list to record every group of P2P operations this rank issues (a list of
        `hybridpar.pipeline.replay.P2POp` per group) for the NCCL replay; None: off."""
        return self._executor.wire.log

    @p2p_log.setter
    def p2p_log(self, log: list[Any] | None) -> None:
        self._executor.wire.log = log

    def _program(self, microbatches: int, *, train: bool) -> list[Any]:
        """This stage's actions for a step: the schedule lowered with every message in its
        slot (`pipeline.lowering.lower`); forward-only steps lower the forwards alone."""
        key = (microbatches, train)
        if key not in self._programs:
            schedule = self.schedule_fn(self.num_stages, microbatches)
            if not train:
                schedule = [[a for a in actions if a.kind == FORWARD] for actions in schedule]
            self._programs[key] = lower(schedule, routes=self._route_pairs)[self.stage]
        return self._programs[key]

    def _last_rank(self) -> int:
        return self.topology.stage_rank(self.num_stages - 1)

    # training ----------------------------------------------------------------------------
    def train_step(self, input: TensorOrTensors, target: Any) -> Tensor:
        """Forward and backward of every micro-batch; returns the loss on every rank.

        Gradients accumulate into ``.grad`` as `loss_fn(model(input), target).backward()`
        would on one device (micro-batch losses weighted by their share of the batch), then
        are averaged over the dp group: in buckets all-reduced as they become ready during
        the step's last backward (`pipeline.reduce.GradBuckets`). `loss_fn` must reduce by
        mean.
        """
        inputs, targets, weights = self._microbatches(input, target)
        actions = self._program(len(inputs), train=True)
        # as torchgpipe: `checkpoint` as it is now, and no checkpointing in evaluation mode
        self._executor.spec.checkpoint = check_checkpoint(self.checkpoint) \
            if self.training else "never"
        with self._recording("train_step", len(inputs)):
            self._loss.post()
            result = self._executor.run(actions, inputs=inputs, targets=targets,
                                        loss_fn=self.loss_fn, weights=weights, train=True,
                                        what="train_step", signature=signature(inputs),
                                        before_last_backward=self._dp_buckets.arm)
            commit_deferred_batch_norms(self)
            if self.topology.dp > 1:
                with self._guard("the all-reduce of the gradients over dp",
                                 self.topology.dp_group):
                    self._dp_buckets.finish()
            if self._ties:
                with self._guard("the all-reduce of tied parameters' gradients over stages",
                                 self.topology.pp_group):
                    self._ties.reduce()
            return self._loss.share(result.loss)

    @torch.no_grad()
    def eval_step(self, input: TensorOrTensors, target: Any) -> Tensor:
        """The loss of `loss_fn(model(input), target)` without gradients, on every rank.

        Forward only (the schedule's forward actions); layers behave as their mode says, so
        call ``.eval()`` first to turn dropout off. Averaged over the dp group.
        """
        inputs, targets, weights = self._microbatches(input, target)
        actions = self._program(len(inputs), train=False)
        with self._recording("eval_step", len(inputs)):
            self._loss.post()
            result = self._executor.run(actions, inputs=inputs, targets=targets,
                                        loss_fn=self.loss_fn, weights=weights, train=False,
                                        what="eval_step", signature=signature(inputs))
            commit_deferred_batch_norms(self)   # a forward in training mode: as torchgpipe
            return self._loss.share(result.loss)

    def _recording(self, what: str, microbatches: int) -> contextlib.AbstractContextManager[None]:
        """Record this step's timeline when `trace` is on (replacing the previous one)."""
        if not self.trace:
            return contextlib.nullcontext()
        clock = tracing.DeviceClock() if self.device.type == "cuda" else None
        return self.recorder.recording(what=what, microbatches=microbatches,
                                      schedule=self.schedule, checkpoint=self.checkpoint,
                                      clock=clock)

    def write_trace(self, folder: str | os.PathLike[str], *,
                    show: bool = True) -> TraceReport | None:
        """Write the last traced step of every rank to `folder`; call it on every rank.

        Rank 0 writes ``trace.json`` (Chrome trace: open in https://ui.perfetto.dev, a track
        per rank, arrows from each send to its receive), ``gantt.png`` (when matplotlib is
        installed) and ``table.txt`` (per stage: busy, bubble and wait against the analytic
        bubble), prints the table when `show`, and returns a `TraceReport`; other ranks
        return None. Raises `ValueError` on every rank when nothing was traced.
        """
        from hybridpar.pipeline.trace_report import write_trace

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
        if self.stage == 0:
            inputs = [to_device(x, self.device) for x in inputs]
        if self.stage == self.num_stages - 1:
            targets = [to_device(y, self.device) for y in targets]
        return inputs, targets, weights

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
        if self.stage == 0:
            inputs = [to_device(x, self.device) for x in inputs]
        actions = self._program(len(inputs), train=False)
        with self._recording("forward", len(inputs)):
            result = self._executor.run(actions, inputs=inputs, targets=None, loss_fn=None,
                                        weights=[1.0] * len(inputs), train=False,
                                        what="forward", signature=signature(inputs))
        # deferred BatchNorm in training mode: this mini-batch's statistics, committed now
        # (torchgpipe commits after its last micro-batch; a later train_step is its own update)
        commit_deferred_batch_norms(self)
        return share_output(result.outputs if self.stage == self.num_stages - 1 else None,
                            self.topology, self._guard)

    # state -------------------------------------------------------------------------------
    def consolidated_state_dict(self) -> dict[str, Tensor]:
        """The unsharded model's full state dict (same keys and shapes), on every rank
        (`pipeline.consolidate`: no pickles)."""
        return consolidate.consolidated_state_dict(
            self, self.topology, stage_keys=self._stage_keys, state_keys=self._state_keys,
            aliases=self.tied_aliases)

    def load_consolidated_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Load a full (unsharded) state dict, keeping this rank's stage and tp shard."""
        consolidate.load_consolidated(self, state_dict, self.topology,
                                      state_keys=self._state_keys, aliases=self.tied_aliases)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the global norm over all stages and tp shards (`pipeline.clip`: replicated
        parameters and ties count once); returns the norm before clipping."""
        return clip.clip_grad_norm_(self.parameters(), max_norm, self.topology,
                                    guard=self._guard, not_counted=self._ties.not_counted,
                                    norm_type=norm_type)

    def extra_repr(self) -> str:
        return (f"stage={self.stage}/{self.num_stages}, balance={self.balance}, "
                f"chunks={self.chunks}, schedule={self.schedule!r}, "
                f"checkpoint={self.checkpoint!r}")
