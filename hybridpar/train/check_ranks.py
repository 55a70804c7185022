"""The ranks of one dry run in this process, one after another: build, agree shapes, fake step.

Each rank joins the `fake` process-group backend, builds its HybridPipe as `hybridpar run`
does (`train.trainer.build_pipe`) on a fake GPU, and runs `train_step` and the gradient clip
under `FakeTensorMode`; its numbers become a `RankReport`, its failures one `CheckError` line
(`check_failure`). After the last rank, the P2P of all of them is replayed under NCCL's rules.

Shape agreement. In the first step of new shapes every forward-direction message carries a
header that the receiver reads on the host (`comm.Incoming.learn`); a fake receive delivers
nothing. So each rank first runs its partition on fake inputs shaped as its upstream stages
send them (ranks go in order, stage s - 1 before stage s), derives the `comm.MessageSpec` of
every FWD / SKIP message it sends, and commits what it sends and receives into its executor's
`SpecBook` under the step's signature: the step runs in its steady state, payloads only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridpar.pipe import HybridPipe
from hybridpar.pipeline.layout import Layout
from hybridpar.pipeline.microbatch import signature, split_batch
from hybridpar.topology import ParallelDims, Topology, using
from hybridpar.train.check_failure import CheckError, LayerStack, failure
from hybridpar.train.check_fake_gpu import FakeFunctions, clear_cast_cache, fake_gpu
from hybridpar.train.check_memory import (
    CheckReport,
    RankReport,
    SavedActivations,
    memory_problem,
    optimizer_bytes,
    tensor_bytes,
)
from hybridpar.train.config import Config

__all__ = ["DryRun"]

SpecKey = tuple[int, int, int]   # (channel, peer stage, micro-batch), as executor.SpecKey


class DryRun:
    """The ranks of one dry run, one after another, and what the earlier ones sent."""

    def __init__(self, config: Config, *, device: str, memory_gib: float | None,
                 model: str | None) -> None:
        self.config, self.device_kind, self.memory_gib = config, device, memory_gib
        self.model = model
        par = config.parallel
        self.dims = ParallelDims(dp=par.dp or 1, pp=par.pp, tp=par.tp)
        self.notes: list[str] = []
        self.inbox: dict[tuple[int, int, int], dict[SpecKey, Any]] = {}  # by (dp, stage, tp)
        self.books: dict[tuple[int, int, int], dict[SpecKey, Any]] = {}  # each stage's specs
        self.logs: dict[int, list[Any]] = {}
        self.batches: dict[int, tuple[Tensor, Tensor]] = {}

    def all_ranks(self) -> CheckReport:
        from hybridpar.pipeline.replay import NCCLOrderError, replay
        from hybridpar.train.data import make_batches

        if dist.is_initialized():
            raise RuntimeError("dry_run needs a process without torch.distributed initialized "
                               "(it runs every rank on the fake backend itself)")
        for d in range(self.dims.dp):   # first batches as `hybridpar run` draws them (real)
            self.batches[d] = make_batches(self.config, split="train", dp_rank=d,
                                           dp=self.dims.dp).next_batch()
        with _preserved_state(), _model_override(self.config, self.model):
            device_type = fake_gpu() if self.device_kind == "cuda" else "cpu"
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
            notes=self.notes, p2p_groups=sum(result.groups.values()))
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
            waiting = [r for r in range(self.dims.world_size)
                       if not self._agreed(self.dims.coordinate(r), layout)]
            if not waiting:
                return
            for r in waiting:
                self._rank(r, device_type, self._shapes)
        raise AssertionError("unreachable: each round passes at least one more stage")

    def _agreed(self, at: Any, layout: Layout) -> bool:
        return all((at.dp, s, at.tp) in self.books for s in layout.stages_of(at.pp))

    def _rank(self, rank: int, device_type: str,
              body: Callable[[Topology, Tensor, Tensor], Any]) -> Any:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed.device_mesh import init_device_mesh
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dims = self.dims
        backend = "fake" if device_type == "cpu" else f"cpu:fake,{device_type}:fake"
        x, y = self.batches[dims.coordinate(rank).dp]
        dist.init_process_group(backend, store=FakeStore(), rank=rank,
                                world_size=dims.world_size)
        try:
            mesh = init_device_mesh(device_type, (dims.dp, dims.pp, dims.tp),
                                    mesh_dim_names=("dp", "pp", "tp"))
            device = torch.device("cpu") if device_type == "cpu" else \
                torch.device(device_type, 0)
            timeout = datetime.timedelta(seconds=self.config.parallel.timeout)
            topo = Topology(dims, rank, mesh, timeout=timeout, device=device)
            with using(topo), FakeTensorMode(allow_non_fake_inputs=True) as mode, \
                    FakeFunctions(mode):
                # the batch on the device, as a GPU run must put it (see docs/check.md)
                return body(topo, mode.from_tensor(x).to(device), mode.from_tensor(y).to(device))
        finally:
            with _quiet_stderr():   # the fake backend warns about hooks on every rank
                dist.destroy_process_group()

    def _build(self, topo: Topology) -> HybridPipe:
        from hybridpar.train.trainer import build_pipe

        try:
            self.config = _resolve_balance(self.config, topo, self.notes)
            return build_pipe(self.config, topo)
        except Exception as e:
            raise failure(e, _where(topo), None, "building its stage",
                          cpu=topo.device.type == "cpu") from e

    def _shapes(self, topo: Topology, x: Tensor, y: Tensor) -> None:
        """A shape round's visit of a rank: the passes of the stages whose inputs are known."""
        pipe = self._build(topo)
        layers = LayerStack(pipe.partition)
        try:
            with layers.tracking():
                self._agree_shapes(pipe, topo, split_batch(x, pipe.chunks, "input"))
        except Exception as e:
            raise failure(e, _where(topo), layers, "its shape pass",
                          cpu=topo.device.type == "cpu") from e

    def _step(self, topo: Topology, x: Tensor, y: Tensor) -> RankReport:
        from hybridpar import comm

        where = _where(topo)
        cpu = topo.device.type == "cpu"
        pipe = self._build(topo)
        layers = LayerStack(pipe.partition)
        inputs = split_batch(x, pipe.chunks, "input")
        try:
            with layers.tracking():
                self._agree_shapes(pipe, topo, inputs)
        except Exception as e:
            raise failure(e, where, layers, "its shape pass", cpu=cpu) from e
        for s in pipe.stages:
            pipe.agree_specs(inputs, self.books[topo.dp_rank, s, topo.tp_rank], stage=s)
        pipe.p2p_log = []
        comm.reset_comm_stats()
        saved = SavedActivations(exclude=[*pipe.parameters(), *pipe.buffers()])
        bf16 = self.config.train.precision == "bf16"
        try:
            with layers.tracking(), saved.track(), torch.autocast(
                    pipe.device.type, dtype=torch.bfloat16, enabled=bf16):
                pipe.train_step(x, y)
            self._clip(pipe)
        except Exception as e:
            raise failure(e, where, layers, "train_step", cpu=cpu) from e
        finally:
            clear_cast_cache()
        stats = comm.comm_stats()
        if stats.get("p2p_header", {}).get("calls"):
            raise CheckError(f"{where}: the step exchanged shape headers although the dry run "
                             "agreed the shapes in advance (hybridpar's step signature changed?)",
                             rank=topo.rank)
        self.logs[topo.rank] = pipe.p2p_log or []
        params = list(pipe.parameters())
        return RankReport(rank=topo.rank, dp=topo.dp_rank, stage=topo.pp_rank, tp=topo.tp_rank,
                          layers=pipe.layers,
                          params=tensor_bytes(params), grads=tensor_bytes(p.grad for p in params),
                          optimizer=optimizer_bytes(pipe), activations=saved.peak, comm=stats)

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

    def _agree_shapes(self, pipe: HybridPipe, topo: Topology, inputs: list[Any]) -> None:
        """The shape pass of each stage of the rank not passed yet whose inputs are known:
        run it on fake inputs shaped as its upstream stages send them, put what it sends in
        the inboxes of its downstream stages; its book (sent and received) in `books`."""
        from hybridpar.pipeline.lowering import FWD, SKIP

        dp, tp = topo.dp_rank, topo.tp_rank
        for s in pipe.stages:
            skip_in, _ = pipe.skips_of(s)
            received = self.inbox.get((dp, s, tp), {})
            needs = [(FWD, s - 1)] if s > 0 else []
            needs += [(SKIP, src) for src in skip_in]
            if (dp, s, tp) in self.books or not all(
                    (channel, src, i) in received for channel, src in needs
                    for i in range(len(inputs))):
                continue
            book = dict(received)
            sends: dict[Any, dict[tuple[int, int], Any]] = {}   # input specs -> what it sends
            part = pipe.partition_of(s)
            modes = {m: m.training for m in part.modules()}
            part.eval()   # the same shapes; no batch-norm statistics, no dropout drawn
            try:
                for i, first_input in enumerate(inputs):
                    # outputs depend on input shapes only (the executor requires it): equal
                    # micro-batches need one forward
                    key = (signature([first_input]) if s == 0 else received[FWD, s - 1, i],
                           *(received[SKIP, src, i] for src in skip_in))
                    if key not in sends:
                        sends[key] = _sends(pipe, s, first_input, received, i)
                    for (channel, dst), spec in sends[key].items():
                        book[channel, dst, i] = spec
                        self.inbox.setdefault((dp, dst, tp), {})[channel, s, i] = spec
            finally:
                for m, training in modes.items():
                    m.training = training
            self.books[dp, s, tp] = book


def _where(topo: Topology) -> str:
    return f"rank {topo.rank} (dp {topo.dp_rank}, stage {topo.pp_rank}, tp {topo.tp_rank})"


def _sends(pipe: HybridPipe, s: int, first_input: Any, received: dict[SpecKey, Any],
           i: int) -> dict[tuple[int, int], Any]:
    """{(channel, peer stage): spec} of the messages stage `s` sends for micro-batch `i`."""
    from torchgpipe.skip.tracker import use_skip_tracker

    from hybridpar import comm
    from hybridpar.pipeline.lowering import FWD, SKIP
    from hybridpar.pipeline.skip import StageSkipTracker

    skip_in, skip_out = pipe.skips_of(s)
    tp = pipe.topology.tp
    x = first_input if s == 0 else _fake_message(received[FWD, s - 1, i], pipe.device)
    incoming: dict[Any, Tensor | None] = {}
    for src, routes in skip_in.items():
        tensors = _fake_message(received[SKIP, src, i], pipe.device)
        incoming.update((r.key, t) for r, t in zip(routes, tensors))
    routes_here = [r for routes in (*skip_in.values(), *skip_out.values()) for r in routes]
    tracker = StageSkipTracker(routes_here, s, incoming)
    with torch.no_grad(), use_skip_tracker(tracker):
        out = pipe.partition_of(s)(x)
    last = s == pipe.layout.stages - 1
    sent = {} if last else {(FWD, s + 1): comm.spec_of(
        out if isinstance(out, tuple) else (out,), tp, grads=True,
        single=isinstance(out, Tensor))}
    for dst, routes in skip_out.items():
        sent[SKIP, dst] = comm.spec_of([tracker.outgoing[r.key] for r in routes], tp,
                                       grads=True, single=False)
    return sent


def _fake_message(spec: Any, device: torch.device) -> Any:
    """The tensors `comm.Incoming.finish` delivers for a message of `spec`."""
    from hybridpar.tensor_parallel.attrs import register_parallel_dim

    out: list[Tensor | None] = []
    for s in spec.tensors:
        if s.absent:
            out.append(None)
            continue
        t = torch.empty(s.shape, dtype=s.dtype, device=device)
        if s.tag is not None:
            register_parallel_dim(t, s.tag)
        out.append(t.requires_grad_(s.requires_grad))
    return out[0] if spec.single else tuple(out)


def _resolve_balance(config: Config, topo: Topology, notes: list[str]) -> Config:
    """`config` with a list balance, chosen as rank 0 chooses it (HybridPipe broadcasts the
    choice and reads it on the host: no data in a fake run). "time" and "size" profile real
    kernels, so the dry run splits by "params" and says so."""
    from hybridpar.balance import balance_by
    from hybridpar.models.registry import build

    par = config.parallel
    if not isinstance(par.balance, str):
        return config
    name = par.balance if par.balance in ("params", "uniform") else "params"
    args = dict(config.model.args)
    if par.tp > 1 and par.tp_plan is None:   # as train.trainer.build_pipe
        args.update(tp=par.tp, group=topo.tp_group)
    module, _ = build(config.model.name, **args)
    if par.tp_plan is not None:   # as HybridPipe applies it ("hf" included)
        from hybridpar.pipeline.build import apply_plan

        module, _ = apply_plan(module, par.tp_plan, group=topo.tp_group)
    stages = Layout.of(par.schedule, par.pp, par.virtual_stages).stages
    balance = [int(b) for b in balance_by(name, stages, module)]
    if name != par.balance:
        notes.append(f"balance={par.balance!r} profiles real kernels; the dry run split by "
                     f"'params': {balance} (pin a split with --set parallel.balance="
                     f"{balance.__repr__().replace(' ', '')})")
    return dataclasses.replace(config, parallel=dataclasses.replace(par, balance=balance))


# the process around the ranks -------------------------------------------------------------
@contextlib.contextmanager
def _preserved_state() -> Iterator[None]:
    """Give back the RNG streams and the warning filters afterwards."""
    from hybridpar.tensor_parallel.random import get_rng_tracker

    tracker = get_rng_tracker()
    streams = tracker.get_states()
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            tracker.set_states(streams)


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence what C++ writes to stderr (file descriptor 2) during the block."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def _model_override(config: Config, spec: str | None) -> Iterator[None]:
    """`spec` (module:function or file.py:function) builds the config's model meanwhile."""
    from hybridpar.models import MODELS

    if spec is None:
        yield
        return
    where, _, attr = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            found = importlib.util.spec_from_file_location(Path(where).stem, where)
            assert found is not None and found.loader is not None
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        build: Callable[..., nn.Sequential] = getattr(module, attr)
    except (ImportError, OSError, AttributeError, AssertionError, ValueError) as e:
        raise ValueError(f"--model {spec!r} names no function (MODULE:FUNCTION or "
                         f"FILE.py:FUNCTION): {e}") from None
    name = config.model.name
    before, MODELS[name] = MODELS[name], build
    try:
        yield
    finally:
        MODELS[name] = before

