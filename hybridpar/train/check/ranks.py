"""The ranks of one dry run in this process, one after another: build, shape pass, fake steps.

Each rank joins the `fake` process-group backend, builds its HybridPipe as `hybridpar run`
does (`train.trainer.build_pipe`) on a fake GPU, puts it in the steady state of a run
(`memory.steady_state`: AdamW's state and the dp buckets made, as after a step) and takes two
training steps under `FakeTensorMode` as the trainer takes them (`_Step`: gradients to
None, the batch pinned, `train_step` under the run's autocast), each of new shapes:

    step   batch                                    then
    1      the first batch `hybridpar run` draws    the clip and the AdamW update; the
                                                    numbers reported, the peak tracked over
                                                    it (`memory.LiveBytes`)
    2      the same, one row short (a short last    -
           batch: the last micro-batch smaller
           when chunks does not divide it)

Its numbers become a `RankReport`, its failures one `CheckError` line (`failure`).
After the last rank, the P2P of all of them (both steps) is replayed under NCCL's rules.

Their headers travel; what a received one says comes from the shape pass that runs first
(`shapes`), since a fake receive delivers nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hybridpar.comm import p2p as comm
from hybridpar.device import pinned, standing_in
from hybridpar.moe.bias_update import ExpertBiasUpdate
from hybridpar.pipe import HybridPipe
from hybridpar.pipeline.activations.kept import SavedActivations
from hybridpar.pipeline.runtime.microbatch import signature, split_batch
from hybridpar.pipeline.schedules.layout import Layout
from hybridpar.process.mesh import expert_groups
from hybridpar.topology import ParallelDims, Topology, using
from hybridpar.train.check.failure import CheckError, LayerStack, failure
from hybridpar.train.check.fake_gpu import FakeCuda, FakeFunctions, clear_cast_cache, fake_gpu
from hybridpar.train.check.memory import (
    CheckReport,
    LiveBytes,
    RankReport,
    held_bytes,
    memory_problem,
    steady_state,
)
from hybridpar.train.check.setup import (
    model_override,
    preserved_state,
    probed_once,
    quiet_stderr,
    resolve_balance,
    unread_checkpoint,
)
from hybridpar.train.check.shapes import ShapePass
from hybridpar.train.configs.config import Config

__all__ = ["DryRun"]


class DryRun:
    """The ranks of one dry run, one after another, and what the earlier ones sent."""

    def __init__(self, config: Config, *, device: str, memory_gib: float | None,
                 model: str | None) -> None:
        self.config, self.device_kind, self.memory_gib = config, device, memory_gib
        self.model = model
        par = config.parallel
        self.dims = ParallelDims(dp=par.dp or 1, pp=par.pp, tp=par.tp, ep=par.ep)
        self.notes: list[str] = []
        self.shapes = ShapePass()
        self.logs: dict[int, list[Any]] = {}
        self.batches: dict[int, list[tuple[Any, Tensor]]] = {}   # by dp: each step's
        self.cuda = FakeCuda()   # the CUDA runtime of the GPU branches (--device cuda)

    def all_ranks(self) -> CheckReport:
        from hybridpar.pipeline.schedules.replay import NCCLOrderError, replay
        from hybridpar.train.data import make_batches

        if dist.is_initialized():
            raise RuntimeError("dry_run needs a process without torch.distributed initialized "
                               "(it runs every rank on the fake backend itself)")
        for d in range(self.dims.dp):   # first batches as `hybridpar run` draws them (real)
            self.batches[d] = _dry_batches(*make_batches(
                self.config, split="train", dp_rank=d, dp=self.dims.dp).next_batch())
        cuda = self.device_kind == "cuda"
        if self.model is None:
            self.config = probed_once(self.config, self.notes)
        with preserved_state(), model_override(self.config, self.model):
            device_type = fake_gpu() if cuda else "cpu"
            with standing_in(device_type, self.cuda) if cuda else contextlib.nullcontext():
                self._shape_rounds(device_type)
                ranks = [self._rank(r, device_type, self._step)
                         for r in range(self.dims.world_size)]
        try:
            result = replay(self.logs, check_labels=True)
        except NCCLOrderError as e:
            raise CheckError(f"the P2P order NCCL cannot progress: {e}") from None
        par = self.config.parallel
        assert isinstance(par.balance, list)   # resolved by the first rank
        report = CheckReport(
            config=self.config.name, device=self.device_kind,
            dims=(self.dims.dp, self.dims.pp, self.dims.tp), balance=list(par.balance),
            chunks=par.chunks, schedule=par.schedule, checkpoint=par.checkpoint,
            precision=self.config.train.precision, ranks=ranks, memory_gib=self.memory_gib,
            notes=self.notes, p2p_groups=sum(result.groups.values()),
            microbatches=[[m.shape[0] for m in y.chunk(par.chunks)] for _, y in self.batches[0]],
            cuda_branches=dict(sorted(self.cuda.hits.items())))
        problem = None if self.memory_gib is None else memory_problem(ranks, self.memory_gib)
        if problem is not None:
            raise CheckError(problem, rank=max(ranks, key=lambda r: r.peak).rank, report=report)
        return report

    def _shape_rounds(self, device_type: str) -> None:
        """Virtual stages: the shape passes of every rank's stages, before any step. A rank
        holds stages whose inputs come from later ranks (ZBV: rank 0's last stage needs rank
        1's), so the ranks go round until every stage had its pass (at most S rounds)."""
        par = self.config.parallel
        layout = Layout.of(par.schedule, par.pp, par.virtual_stages)
        if layout.virtual == 1:
            return   # ranks in order: stage s - 1's pass comes before stage s's
        for _ in range(layout.stages):
            waiting = [r for r in range(self.dims.world_size) if not self.shapes.done(
                self.dims.coordinate(r), layout, len(self.batches[0]))]
            if not waiting:
                return
            for r in waiting:
                self._rank(r, device_type, self._shapes)
        raise AssertionError("unreachable: each round passes at least one more stage")

    def _rank(self, rank: int, device_type: str,
              body: Callable[[Topology, Any], Any]) -> Any:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed.device_mesh import init_device_mesh

        dims = self.dims
        backend = "fake" if device_type == "cpu" else f"cpu:fake,{device_type}:fake"
        importlib.import_module("torch.testing._internal.distributed.fake_pg")  # the backend
        # with a store that answers (the watchdog and abort notices read it), not its FakeStore
        dist.init_process_group(backend, store=dist.HashStore(), rank=rank,
                                world_size=dims.world_size)
        try:
            mesh = init_device_mesh(device_type, (dims.dp, dims.pp, dims.tp),
                                    mesh_dim_names=("dp", "pp", "tp"))
            device = torch.device("cpu") if device_type == "cpu" else \
                torch.device(device_type, 0)
            timeout = datetime.timedelta(seconds=self.config.parallel.timeout)
            groups = expert_groups(dims.dp, dims.ep, dims.pp, dims.tp, rank,
                                   timeout=timeout) if dims.ep > 1 else None
            topo = Topology(dims, rank, mesh, timeout=timeout, device=device,
                            expert_groups=groups)
            with using(topo), FakeTensorMode(allow_non_fake_inputs=True) as mode, \
                    FakeFunctions(mode):
                return body(topo, mode)
        finally:
            with quiet_stderr():   # the fake backend warns about hooks on every rank
                dist.destroy_process_group()

    def _build(self, topo: Topology) -> HybridPipe:
        from hybridpar.train.trainer import build_pipe

        try:
            with unread_checkpoint(self.config, self.notes):
                self.config = resolve_balance(self.config, topo, self.notes)
                return build_pipe(self.config, topo)
        except Exception as e:
            raise failure(e, _where(topo), None, "building its stage",
                          cpu=topo.device.type == "cpu") from e

    def _inputs(self, pipe: HybridPipe, topo: Topology, mode: Any) -> list[list[Any]]:
        """Each dry step's input micro-batches, fake, on the device (for the shape pass)."""
        return [split_batch(_fake(mode, x, pipe.device), pipe.chunks, "input")
                for x, _ in self.batches[topo.dp_rank]]

    def _shapes(self, topo: Topology, mode: Any) -> None:
        """A shape round's visit of a rank: the passes of the stages whose inputs are known."""
        pipe = self._build(topo)
        layers = LayerStack(pipe.partition)
        try:
            with layers.tracking():
                self.shapes.run(pipe, topo, self._inputs(pipe, topo, mode))
        except Exception as e:
            raise failure(e, _where(topo), layers, "its shape pass",
                          cpu=topo.device.type == "cpu") from e
        finally:
            pipe.close()

    def _step(self, topo: Topology, mode: Any) -> RankReport:
        pipe = self._build(topo)
        try:
            return self._steps(pipe, topo, mode)
        finally:
            pipe.close()   # its helper threads (the watchdog is on on GPUs)

    def _steps(self, pipe: HybridPipe, topo: Topology, mode: Any) -> RankReport:
        """The rank's shape pass, then its dry steps (module docstring); its numbers."""
        from hybridpar.train.build import build_optimizer

        where = _where(topo)
        cpu = topo.device.type == "cpu"
        layers = LayerStack(pipe.partition)
        inputs = self._inputs(pipe, topo, mode)
        try:
            with layers.tracking():
                self.shapes.run(pipe, topo, inputs)
        except Exception as e:
            raise failure(e, where, layers, "its shape pass", cpu=cpu) from e
        optimizer = build_optimizer(pipe, self.config)   # the trainer's AdamW
        if not cpu:   # torch picks the foreach AdamW on CUDA; on the fake GPU's FakeTensor
            for group in optimizer.param_groups:   # parameters it would not
                if group.get("foreach") is None and not group.get("fused"):
                    group["foreach"] = True
        step = _Step(pipe, optimizer, layers, mode, bf16=self.config.train.precision == "bf16",
                     expert_bias=ExpertBiasUpdate(pipe, group=topo.dp_group if topo.dp > 1
                                                  else None))
        try:
            kept = steady_state(pipe, optimizer)
        except Exception as e:
            raise failure(e, where, None, "the optimizer step", cpu=cpu) from e
        pipe.p2p_log = []
        comm.reset_comm_stats()
        saved = SavedActivations(exclude=[*pipe.parameters(), *pipe.buffers()])
        live = LiveBytes(pipe.device.type, [*pipe.parameters(), *pipe.buffers(), *kept])
        signatures = [comm.signature_hash((True, signature(i))) for i in inputs]
        batches = self.batches[topo.dp_rank]
        first: dict[str, Any] = {}
        stats: dict[str, dict[str, int]] = {}
        try:
            with comm.delivering_headers(self.shapes.headers(topo, signatures)):
                with live:
                    self._new_shapes(step, topo, batches, 0, measured=saved)
                    self._clip(pipe)
                    stats = comm.comm_stats()
                    step.update()
                first = dict(held_bytes(pipe, optimizer), comm=stats)
                if len(batches) > 1:
                    self._new_shapes(step, topo, batches, 1, measured=None)
        except CheckError:
            raise
        except Exception as e:
            raise failure(e, where, layers, step.during, cpu=cpu) from e
        finally:
            clear_cast_cache()
        self.logs[topo.rank] = pipe.p2p_log or []
        return RankReport(rank=topo.rank, dp=topo.dp_rank, stage=topo.pp_rank, tp=topo.tp_rank,
                          layers=pipe.layers, activations=saved.peak, peak=live.peak, **first)

    def _new_shapes(self, step: _Step, topo: Topology, batches: list[tuple[Tensor, Tensor]],
                    k: int, *, measured: SavedActivations | None) -> None:
        """Dry step `k` (module docstring), of new shapes: its headers travel (pp > 1)."""
        self.shapes.current, headers = k, _calls(comm.comm_stats(), "p2p_header")
        step.run(*batches[k], during="train_step" if k == 0 else
                 "train_step of a short last batch", measured=measured)
        if self.dims.pp > 1 and _calls(comm.comm_stats(), "p2p_header") == headers:
            raise CheckError(f"{_where(topo)}: step {k + 1}, of new shapes, exchanged no "
                             "shape header (hybridpar's step signature changed?)",
                             rank=topo.rank)

    def _clip(self, pipe: HybridPipe) -> None:
        """The trainer's gradient clip; a host read in it is a note (one sync per step)."""
        from torch._subclasses.fake_tensor import DataDependentOutputException

        try:
            pipe.clip_grad_norm_(self.config.train.grad_clip or float("inf"))
        except DataDependentOutputException:
            note = ("HybridPipe.clip_grad_norm_ reads the norm on the host: one GPU sync per "
                    "step, after the pipeline")
            if note not in self.notes:
                self.notes.append(note)


def _where(topo: Topology) -> str:
    return f"rank {topo.rank} (dp {topo.dp_rank}, stage {topo.pp_rank}, tp {topo.tp_rank})"


class _Step:
    """One training step of a rank as the trainer takes it: gradients to None, the batch
    pinned (the pipe copies it to the device), `train_step` under the run's autocast; then,
    when asked, the trainer's AdamW update (and the sigmoid routers' bias update). `during`
    names what runs (for a failure)."""

    def __init__(self, pipe: HybridPipe, optimizer: torch.optim.Optimizer, layers: LayerStack,
                 mode: Any, *, bf16: bool, expert_bias: ExpertBiasUpdate | None = None) -> None:
        self.pipe, self.optimizer, self.layers, self.mode = pipe, optimizer, layers, mode
        self.bf16, self.expert_bias = bf16, expert_bias
        self.during = "train_step"

    def run(self, x: Tensor | tuple[Tensor, ...], y: Tensor, *, during: str,
            measured: SavedActivations | None = None) -> None:
        self.during = during
        self.optimizer.zero_grad(set_to_none=True)
        x, y = pinned(self.pipe.device, x, y)
        tracking = measured.track() if measured is not None else contextlib.nullcontext()
        with self.layers.tracking(), tracking, torch.autocast(
                self.pipe.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            self.pipe.train_step(_fake(self.mode, x), self.mode.from_tensor(y))
        clear_cast_cache()   # autocast's cache of weight casts ends with its region

    def update(self) -> None:
        self.during = "the optimizer step"
        self.optimizer.step()
        if self.expert_bias:   # the routers' bias update after it, as the trainer runs it
            self.expert_bias.step()


def _fake(mode: Any, x: Tensor | tuple[Tensor, ...], device: Any = None) -> Any:
    """`x` (a tensor, or a tuple: packed (ids, positions)) as fake tensors, on `device`."""
    if isinstance(x, tuple):
        return tuple(_fake(mode, t, device) for t in x)
    fake = mode.from_tensor(x)
    return fake if device is None else fake.to(device)


def _dry_batches(x: Tensor | tuple[Tensor, ...], y: Tensor) -> list[tuple[Any, Tensor]]:
    """The batches of the dry steps: the first one, and the same one row short (none with a
    single row); x may be (ids, positions) (``data.pack = "documents"``)."""
    n = y.shape[0] - 1
    short = tuple(t[:n].clone() for t in x) if isinstance(x, tuple) else x[:n].clone()
    return [(x, y)] if n < 1 else [(x, y), (short, y[:n].clone())]


def _calls(stats: dict[str, dict[str, int]], kind: str) -> int:
    return stats.get(kind, {}).get("calls", 0)
