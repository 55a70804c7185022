"""HybridPipe: an nn.Sequential run as a multi-process pipeline of tensor-sharded stages."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridpar import trace as tracing
from hybridpar.agreement import fail_together
from hybridpar.broadcast import broadcast_tensors
from hybridpar.pipeline.batchnorm import commit_deferred_batch_norms, convert_deferred_batch_norm
from hybridpar.pipeline.checkpoint import RNGReplay, check_checkpoint
from hybridpar.pipeline.executor import StageExecutor, StageSpec
from hybridpar.pipeline.lowering import lower
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
from hybridpar.tensor_parallel.mappings import all_gather_along
from hybridpar.tensor_parallel.state import gather_full, shard_of
from hybridpar.topology import Topology, current_topology

if TYPE_CHECKING:
    from hybridpar.pipeline.trace_report import TraceReport

__all__ = ["HybridPipe"]

log = logging.getLogger(__name__)

TensorOrTensors = Tensor | tuple[Tensor, ...]
LOSS_TAG = 1 << 13   # gloo only: the loss, last stage -> the others (NCCL: a broadcast)


def _split_batch(x: Any, chunks: int, what: str) -> list[Any]:
    """Split a Tensor or tuple of Tensors on dim 0 into at most `chunks` micro-batches."""
    if isinstance(x, Tensor):
        if x.dim() == 0 or x.shape[0] == 0:
            raise ValueError(f"{what} has no rows (shape {tuple(x.shape)}); pass a batch "
                             "with at least one row on dim 0")
        return list(x.chunk(chunks))
    if isinstance(x, tuple) and x and all(isinstance(t, Tensor) for t in x):
        parts = [_split_batch(t, chunks, what) for t in x]
        if len({len(p) for p in parts}) != 1 or len({t.shape[0] for t in x}) != 1:
            raise ValueError(f"the tensors of {what} have different batch sizes "
                             f"{[t.shape[0] for t in x]}; they must agree on dim 0")
        return [tuple(p[i] for p in parts) for i in range(len(parts[0]))]
    raise TypeError(f"{what} must be a Tensor or a tuple of Tensors, got {type(x).__name__}")


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


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _signature(inputs: Sequence[Any]) -> tuple[Any, ...]:
    """The shapes and dtypes of a step's input micro-batches: what its messages depend on."""
    return tuple(tuple((tuple(t.shape), str(t.dtype)) for t in (x if isinstance(x, tuple)
                                                                   else (x,)))
                 for x in inputs)


def _to(x: Any, device: torch.device) -> Any:
    """A micro-batch on `device` (a copy that overlaps compute when `x` is pinned)."""
    if isinstance(x, Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, tuple):
        return tuple(_to(t, device) for t in x)
    return x


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


def _rows(x: TensorOrTensors) -> int:
    return (x[0] if isinstance(x, tuple) else x).shape[0]


class HybridPipe(nn.Module):
    """Pipeline parallelism over `topology.pp` stages, with tp-sharded layers inside stages.

    Every rank builds the same `nn.Sequential` (same seed, or on the `meta` device); each keeps
    only the layers of its stage, under their original names (``"3.fc1.weight"``).

    ``watchdog``: a thread that reports a step with no progress for the topology timeout (or
    that many seconds) and stops the stage when a peer published its failure; on by default
    on GPUs, where NCCL waits do not time out on the host (`pipeline.watchdog`).

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
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
        check_checkpoint(checkpoint)
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
        for name, layer in local.named_children():
            self.add_module(name, layer)
        # copies of a parameter tied across stages: equal at the start, gradients summed
        self._ties = TiedGroups(ties, dict(local.named_parameters(remove_duplicate=False)),
                                topo)
        self._ties.sync()
        # dp averaging in buckets launched during each step's last backward (no-op at dp=1)
        self._dp_buckets = GradBuckets(list(self.parameters()),
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

    # the local stage ---------------------------------------------------------------------
    @property
    def partition(self) -> nn.Sequential:
        """This rank's stage as an `nn.Sequential` (original layer names)."""
        return self._executor.spec.partition

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
        with self._recording("train_step", len(inputs)):
            posted = self._post_loss_recv()
            result = self._executor.run(actions, inputs=inputs, targets=targets,
                                        loss_fn=self.loss_fn, weights=weights, train=True,
                                        what="train_step", signature=_signature(inputs),
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
            return self._share_loss(result.loss, posted)

    @torch.no_grad()
    def eval_step(self, input: TensorOrTensors, target: Any) -> Tensor:
        """The loss of `loss_fn(model(input), target)` without gradients, on every rank.

        Forward only (the schedule's forward actions); layers behave as their mode says, so
        call ``.eval()`` first to turn dropout off. Averaged over the dp group.
        """
        inputs, targets, weights = self._microbatches(input, target)
        actions = self._program(len(inputs), train=False)
        with self._recording("eval_step", len(inputs)):
            posted = self._post_loss_recv()
            result = self._executor.run(actions, inputs=inputs, targets=targets,
                                        loss_fn=self.loss_fn, weights=weights, train=False,
                                        what="eval_step", signature=_signature(inputs))
            commit_deferred_batch_norms(self)   # a forward in training mode: as torchgpipe
            return self._share_loss(result.loss, posted)

    def _recording(self, what: str, microbatches: int) -> contextlib.AbstractContextManager[None]:
        """Record this step's timeline when `trace` is on (replacing the previous one)."""
        if not self.trace:
            return contextlib.nullcontext()
        clock = tracing.DeviceClock() if self.device.type == "cuda" else None
        return tracing.RECORDER.recording(what=what, microbatches=microbatches,
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
        inputs = _split_batch(input, self.chunks, "input")
        targets = _split_batch(target, self.chunks, "target")
        if len(targets) != len(inputs) or _rows(input) != _rows(target):
            raise ValueError(f"input has {_rows(input)} rows but target has {_rows(target)}; "
                             "they must have the same batch size")
        total = _rows(input)
        weights = [_rows(x) / total for x in inputs]
        if self.stage == 0:
            inputs = [_to(x, self.device) for x in inputs]
        if self.stage == self.num_stages - 1:
            targets = [_to(y, self.device) for y in targets]
        return inputs, targets, weights

    def _post_loss_recv(self) -> tuple[Tensor, Any] | None:
        """gloo, before the schedule: post the receive of the step's loss from the last stage.

        gloo moves a message once its receive is posted, so a loss received only after the
        schedule costs a round trip at the end of every step, on the stage that ends last.
        gloo has no rendezvous and honours tags: on its own tag (`LOSS_TAG`) the loss never
        meets a stage-to-stage message (all on tag 0), so posting it first is safe there. On
        NCCL it would hold the rank's P2P stream: there the loss is broadcast after the
        schedule (`_share_loss`).
        """
        if self.device.type != "cpu" or self.stage == self.num_stages - 1 \
                or self.num_stages == 1:
            return None
        box = torch.zeros((), dtype=torch.float32, device=self.device)
        return box, dist.irecv(box, self._last_rank(), tag=LOSS_TAG)

    def _share_loss(self, local: Tensor | None, posted: tuple[Tensor, Any] | None = None
                    ) -> Tensor:
        """The last stage's loss on every rank of the pipeline, averaged over dp replicas.

        A one-to-all over the pp group after the schedule, counted as one broadcast per rank:
        `dist.broadcast` on NCCL; on gloo point to point, into the receive `_post_loss_recv`
        posted before the schedule.
        """
        loss = local.detach().clone() if local is not None else torch.zeros(())
        loss = loss.to(self.device, torch.float32)
        if self.num_stages > 1:
            with tracing.collective("broadcast", _nbytes(loss)), self._guard(
                    "the loss from the last stage", self.topology.pp_group):
                if self.device.type != "cpu":
                    dist.broadcast(loss, self._last_rank(), group=self.topology.pp_group)
                elif posted is not None:
                    loss, work = posted
                    work.wait(self.topology.timeout)
                else:
                    works = [dist.isend(loss, self.topology.stage_rank(s), tag=LOSS_TAG)
                             for s in range(self.num_stages - 1)]
                    for work in filter(None, works):
                        work.wait(self.topology.timeout)
        if self.topology.dp > 1:
            with tracing.collective("all_reduce", _nbytes(loss)), self._guard(
                    "the all-reduce of the loss over dp", self.topology.dp_group):
                dist.all_reduce(loss, group=self.topology.dp_group)
            loss /= self.topology.dp
        return loss

    def _guard(self, operation: str, group: Any) -> contextlib.AbstractContextManager[None]:
        """A collective outside the schedule: a timeout becomes a `PipelineError` block."""
        return self._executor.guard(operation, dist.get_process_group_ranks(group))

    # inference ---------------------------------------------------------------------------
    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        """Inference over the pipeline (no grad); the full output on every rank.

        The last stage must return a Tensor or a tuple of Tensors (else a `TypeError` on every
        rank); its output reaches the other stages as tensors with a shape header (no pickles).
        """
        inputs = _split_batch(input, self.chunks, "input")
        if self.stage == 0:
            inputs = [_to(x, self.device) for x in inputs]
        actions = self._program(len(inputs), train=False)
        with self._recording("forward", len(inputs)):
            result = self._executor.run(actions, inputs=inputs, targets=None, loss_fn=None,
                                        weights=[1.0] * len(inputs), train=False,
                                        what="forward", signature=_signature(inputs))
        # deferred BatchNorm in training mode: this mini-batch's statistics, committed now
        # (torchgpipe commits after its last micro-batch; a later train_step is its own update)
        commit_deferred_batch_norms(self)
        output: TensorOrTensors | TypeError | None = None
        if self.stage == self.num_stages - 1:
            try:
                output = self._gather_outputs(result.outputs)
            except TypeError as e:
                if self.num_stages == 1:
                    raise
                output = e
        if self.num_stages == 1:
            assert isinstance(output, (Tensor, tuple))
            return output
        payload: tuple[Tensor, ...] | TypeError | None = output \
            if isinstance(output, TypeError) else None
        if isinstance(output, (Tensor, tuple)):   # a flag first: a bare Tensor or a tuple
            single = torch.tensor([int(isinstance(output, Tensor))], dtype=torch.int64)
            payload = (single, output) if isinstance(output, Tensor) else (single, *output)
        with self._guard("the broadcast of the output from the last stage",
                         self.topology.pp_group):
            tensors = broadcast_tensors(payload, self._last_rank(),
                                             group=self.topology.pp_group, device=self.device)
        return tensors[1] if int(tensors[0]) else tuple(tensors[1:])

    def _gather_outputs(self, outputs: list[TensorOrTensors]) -> TensorOrTensors:
        """Concatenate the micro-batch outputs; all-gather class-sharded ones over tp."""
        kinds = {type(o).__name__ for o in outputs}
        if not all(isinstance(o, Tensor) or (isinstance(o, tuple) and o and all(
                isinstance(t, Tensor) for t in o)) for o in outputs) or len(kinds) != 1:
            raise TypeError(f"the last stage returned {' / '.join(sorted(kinds))}; "
                            "HybridPipe's forward returns a Tensor or a tuple of Tensors (make "
                            "the last layer return one, or use train_step / eval_step with a "
                            "loss_fn that reads this output)")

        def full(parts: list[Tensor]) -> Tensor:
            whole = torch.cat(parts)  # cat drops the tag: read it from a part
            if get_parallel_dim(parts[0]) in (-1, 1) and self.topology.tp > 1:
                return all_gather_along(whole, -1, self.topology.tp_group)
            return whole

        if isinstance(outputs[0], tuple):
            return tuple(full([o[k] for o in outputs if isinstance(o, tuple)])
                         for k in range(len(outputs[0])))
        return full([o for o in outputs if isinstance(o, Tensor)])

    # state -------------------------------------------------------------------------------
    def consolidated_state_dict(self) -> dict[str, Tensor]:
        """The unsharded model's full state dict (same keys and shapes), on every rank.

        Each stage's tensors reach the others by `broadcast_tensors` (no pickles).
        """
        group = self.topology.tp_group if self.topology.tp > 1 else None
        tensors = dict(self.named_parameters())
        local = {}
        for key, value in self.state_dict().items():
            param = tensors.get(key)
            local[key] = gather_full(value, param, group) if param is not None else value
            local[key] = local[key].detach().cpu().clone()
        merged: dict[str, Tensor] = dict(local)
        for stage in range(self.num_stages):
            if self.num_stages == 1:
                break
            keys = self._stage_keys[stage]
            mine = [local[k] for k in keys] if stage == self.stage else None
            received = broadcast_tensors(mine, self.topology.stage_rank(stage),
                                              group=self.topology.pp_group, device=self.device)
            merged.update((k, v.cpu()) for k, v in zip(keys, received))
        for alias, canonical in self.tied_aliases.items():   # one tensor under every name
            merged[alias] = merged[canonical]
        return {key: merged[key] for key in self._state_keys}

    def load_consolidated_state_dict(self, state_dict: Mapping[str, Tensor]) -> None:
        """Load a full (unsharded) state dict, keeping this rank's stage and tp shard."""
        known = set(self._state_keys)
        state_dict = self._fill_aliases(state_dict)
        missing = [k for k in self._state_keys if k not in state_dict]
        unexpected = [k for k in state_dict if k not in known]
        if missing or unexpected:
            raise KeyError(f"state dict does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}; give the full state dict of this "
                           "nn.Sequential (its state_dict(), consolidated_state_dict(), or "
                           "the file hybridpar export writes)")
        group = self.topology.tp_group if self.topology.tp > 1 else None
        tensors = dict(self.named_parameters())
        local = {}
        for key in self.state_dict():
            param = tensors.get(key)
            value = state_dict[key]
            local[key] = shard_of(value, param, group) if param is not None else value
        self.load_state_dict(local)

    def _fill_aliases(self, state_dict: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """`state_dict` with every tied name present (a file may hold the canonical one only,
        as Hugging Face checkpoints do); a `ValueError` if two names of one tie differ."""
        if not self.tied_aliases:
            return state_dict
        full = dict(state_dict)
        for alias, canonical in self.tied_aliases.items():
            if alias in full and canonical in full:
                if full[alias].shape != full[canonical].shape or \
                        not torch.equal(full[alias], full[canonical]):
                    raise ValueError(f"the state dict holds different values for '{canonical}' "
                                     f"and '{alias}', which are one tied parameter of this "
                                     "model; give them equal values (or only one of the names)")
            elif alias in full:
                full[canonical] = full[alias]
            elif canonical in full:
                full[alias] = full[canonical]
        return full

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip by the global norm over all stages and tp shards (replicated params once)."""
        if norm_type != 2.0:
            raise ValueError(f"clip_grad_norm_ supports the 2-norm only, got norm_type="
                             f"{norm_type}; leave norm_type at 2.0")
        tp = self.topology.tp
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self.parameters():
            if p.grad is None or id(p) in self._ties.not_counted:   # a tie counts once
                continue
            square = p.grad.detach().double().pow(2).sum()
            sharded = get_parallel_dim(p) is not None
            total += square if sharded or tp == 1 else square / tp
        if tp > 1:
            with tracing.collective("all_reduce", _nbytes(total)), self._guard(
                    "the all-reduce of the gradient norm over tp", self.topology.tp_group):
                dist.all_reduce(total, group=self.topology.tp_group)
        if self.num_stages > 1:
            with tracing.collective("all_reduce", _nbytes(total)), self._guard(
                    "the all-reduce of the gradient norm over pp", self.topology.pp_group):
                dist.all_reduce(total, group=self.topology.pp_group)
        norm = total.sqrt()
        # min(1, max_norm / norm) as a tensor, in float64 (float64 models clip as on one
        # device): no host synchronisation; a multiply by 1.0 leaves a gradient as it was
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype))
        return norm.to(torch.float32)

    def extra_repr(self) -> str:
        return (f"stage={self.stage}/{self.num_stages}, balance={self.balance}, "
                f"chunks={self.chunks}, schedule={self.schedule!r}, "
                f"checkpoint={self.checkpoint!r}")
