"""Dry run: one training step of every rank on fake GPUs, checked and measured without a GPU.

`hybridpar check CONFIG` builds each rank's HybridPipe as `hybridpar run` does
(`train.trainer.build_pipe`) and runs its `train_step` and gradient clip under
`FakeTensorMode` on the `fake` process-group backend, one rank after another in one process:

    per rank of dp x pp x tp            fails the check (CheckError, one line)
    1. init_process_group("fake")       -
    2. build_pipe on a fake GPU         an error building the stage
    3. shape pass of the stage          an error in it
    4. train_step, gradient clip        a tensor on the wrong device; a host sync (.item(),
                                        .tolist(), bool(t)); any other error of the step
    then: NCCL replay of every P2P op   an order NCCL cannot progress (replay.NCCLOrderError)
          --memory GiB                  a rank whose peak does not fit

Shape agreement. In the first step of new shapes every forward-direction message carries a
header that the receiver reads on the host (`comm.Incoming.learn`); a fake receive delivers
nothing. So each rank first runs its partition on fake inputs shaped as its upstream stages
send them (ranks go in order, stage s - 1 before stage s), derives the `comm.MessageSpec` of
every FWD / SKIP message it sends, and commits what it sends and receives into its executor's
`SpecBook` under the step's signature: the step runs in its steady state, payloads only.

The fake GPU is `check_fake_gpu`'s, the numbers measured are `check_memory`'s. `dry_run`
runs the ranks in a child process by default: the fake GPU's registration lasts for the
process.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hybridpar.pipe import HybridPipe
from hybridpar.pipeline.microbatch import signature, split_batch
from hybridpar.topology import ParallelDims, Topology, using
from hybridpar.train.check_fake_gpu import STANDIN, FakeFunctions, clear_cast_cache, fake_gpu
from hybridpar.train.check_memory import (
    CheckReport,
    RankReport,
    SavedActivations,
    memory_problem,
    optimizer_bytes,
    tensor_bytes,
)
from hybridpar.train.config import Config

__all__ = ["CheckError", "CheckReport", "RankReport", "add_parser", "dry_run", "main"]

SpecKey = tuple[int, int, int]   # (channel, peer stage, micro-batch), as executor.SpecKey
CHILD_TIMEOUT = 600              # seconds the isolated dry-run process may take


class CheckError(RuntimeError):
    """A dry run that failed: `rank` (None: not one rank's), `report` when numbers exist."""

    def __init__(self, message: str, *, rank: int | None = None,
                 report: CheckReport | None = None) -> None:
        super().__init__(message)
        self.rank, self.report = rank, report


# entry points ------------------------------------------------------------------------------
def dry_run(config: Config | str | os.PathLike[str], *, device: str = "cuda",
            memory_gib: float | None = None,
            overrides: Sequence[str] = (), model: str | None = None,
            isolate: bool = True) -> CheckReport:
    """Check one training step of every rank of `config` (a `Config` or a TOML path).

    `device`: "cuda" (fake GPUs) or "cpu" (fake CPU ranks, as gloo runs them). `memory_gib`:
    the memory of one device; a rank whose peak exceeds it fails. `overrides`: ``--set``
    strings. `model`: ``"module:function"`` or ``"file.py:function"`` building the
    nn.Sequential instead of the config's model (same options, data and loss). `isolate`:
    run in a child process (the fake GPU's registration stays in the process that runs).
    Raises `CheckError` naming the rank, layer and tensor of a failure.
    """
    from hybridpar.train.config import load_config

    cfg = config if isinstance(config, Config) else load_config(config, overrides)
    if device not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if cfg.model.name.startswith("hf:"):
        raise CheckError(f"hybridpar check cannot dry-run model {cfg.model.name!r}: "
                         "transformers' modules read the data pointers of tensors, which fake "
                         "tensors do not have (torch crashes); check the layout with a short "
                         "real run instead: hybridpar run CONFIG --set train.steps=2")
    if not isolate:
        return _Run(cfg, device=device, memory_gib=memory_gib, model=model).all_ranks()
    job = {"config": cfg.to_dict(), "device": device, "memory_gib": memory_gib, "model": model}
    with tempfile.TemporaryDirectory(prefix="hybridpar-check-") as tmp:
        out = Path(tmp) / "result.json"
        try:
            proc = subprocess.run([sys.executable, "-m", "hybridpar.train.check", str(out)],
                                  input=json.dumps(job), capture_output=True, text=True,
                                  timeout=CHILD_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"the dry run did not finish in {CHILD_TIMEOUT} s; a fake step "
                               "takes seconds, so this is a hang: please report it") from None
        if not out.is_file():
            raise RuntimeError(f"the dry-run process ended with exit code {proc.returncode} "
                               f"and no result:\n{proc.stderr[-3000:]}")
        result = json.loads(out.read_text(encoding="utf-8"))
    report = CheckReport.from_dict(result["report"]) if result.get("report") else None
    if result.get("error"):
        raise CheckError(result["error"], rank=result.get("rank"), report=report)
    assert report is not None
    return report


def _child(out: str) -> int:
    """``python -m hybridpar.train.check RESULT.json``, the job on stdin: one isolated dry run."""
    job = json.loads(sys.stdin.read())
    cfg = Config.from_dict(job["config"], source=str(job["config"].get("name")))
    result: dict[str, Any] = {}
    try:
        report = dry_run(cfg, device=job["device"], memory_gib=job["memory_gib"],
                         model=job["model"], isolate=False)
        result["report"] = report.to_dict()
    except CheckError as e:
        result.update(error=str(e), rank=e.rank,
                      report=e.report.to_dict() if e.report is not None else None)
    Path(out).write_text(json.dumps(result), encoding="utf-8")
    return 0


def add_parser(commands: Any) -> None:
    """The `hybridpar check` subcommand and its options."""
    p = commands.add_parser("check", help="dry-run one step of every rank on fake GPUs",
                            description="Dry-run one training step of every rank of a config "
                            "on fake GPUs (no GPU needed): device placement, host syncs, the "
                            "NCCL order of the P2P, and memory and traffic per rank.")
    p.add_argument("config", help="a TOML config (see configs/)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="fake GPUs (default) or fake CPU ranks as gloo runs them")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   dest="overrides", help="override a config value (repeatable)")
    p.add_argument("--memory", type=float, metavar="GiB",
                   help="memory of one device: fail if a rank's peak is larger")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    p.add_argument("--model", metavar="MODULE:FUNCTION",
                   help="build the nn.Sequential with this function (of a module or a .py "
                   "file) instead of the config's model, with the same options, data, loss")


def main(args: argparse.Namespace) -> int:
    """Run `hybridpar check`: the table on stdout and 0, or a failure on stderr and 1."""
    try:
        report = dry_run(args.config, device=args.device, memory_gib=args.memory,
                         overrides=args.overrides, model=args.model, isolate=False)
    except CheckError as e:
        if e.report is not None:
            print(e.report.format())
            if args.json:
                e.report.write_json(args.json)
        print(f"hybridpar check: {e}", file=sys.stderr)
        return 1
    print(report.format())
    if args.json:
        report.write_json(args.json)
    return 0


# one dry run, in this process --------------------------------------------------------------
class _Run:
    """The ranks of one dry run, one after another, and what the earlier ones sent."""

    def __init__(self, config: Config, *, device: str, memory_gib: float | None,
                 model: str | None) -> None:
        self.config, self.device_kind, self.memory_gib = config, device, memory_gib
        self.model = model
        par = config.parallel
        self.dims = ParallelDims(dp=par.dp or 1, pp=par.pp, tp=par.tp)
        self.notes: list[str] = []
        self.inbox: dict[tuple[int, int, int], dict[SpecKey, Any]] = {}  # by (dp, stage, tp)
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
            ranks = [self._rank(r, device_type) for r in range(self.dims.world_size)]
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

    def _rank(self, rank: int, device_type: str) -> RankReport:
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
                return self._step(topo, mode.from_tensor(x).to(device),
                                  mode.from_tensor(y).to(device))
        finally:
            with _quiet_stderr():   # the fake backend warns about hooks on every rank
                dist.destroy_process_group()

    def _step(self, topo: Topology, x: Tensor, y: Tensor) -> RankReport:
        from hybridpar import comm
        from hybridpar.train.trainer import build_pipe

        where = f"rank {topo.rank} (dp {topo.dp_rank}, stage {topo.pp_rank}, tp {topo.tp_rank})"
        cpu = topo.device.type == "cpu"
        try:
            self.config = _resolve_balance(self.config, topo, self.notes)
            pipe = build_pipe(self.config, topo)
        except Exception as e:
            raise _failure(e, where, None, "building its stage", cpu=cpu) from e
        layers = _LayerStack(pipe.partition)
        inputs = split_batch(x, pipe.chunks, "input")
        try:
            with layers.tracking():
                book = self._agree_shapes(pipe, topo, inputs)
        except Exception as e:
            raise _failure(e, where, layers, "its shape pass", cpu=cpu) from e
        pipe._executor.book.commit((True, signature(inputs)), book)
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
            raise _failure(e, where, layers, "train_step", cpu=cpu) from e
        finally:
            clear_cast_cache()
        stats = comm.comm_stats()
        if stats.get("p2p_header", {}).get("calls"):
            raise CheckError(f"{where}: the step exchanged shape headers although the dry run "
                             "agreed the shapes in advance (hybridpar's step signature changed?)",
                             rank=topo.rank)
        self.logs[topo.rank] = pipe.p2p_log or []
        start = sum(pipe.balance[:topo.pp_rank])
        params = list(pipe.parameters())
        return RankReport(rank=topo.rank, dp=topo.dp_rank, stage=topo.pp_rank, tp=topo.tp_rank,
                          layers=(start, start + pipe.balance[topo.pp_rank]),
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

    def _agree_shapes(self, pipe: HybridPipe, topo: Topology, inputs: list[Any]
                      ) -> dict[SpecKey, Any]:
        """Run the stage on fake inputs shaped as its upstream stages send them, put what it
        sends in the inboxes of its downstream stages; its book (sent and received)."""
        from hybridpar.pipeline.lowering import FWD, SKIP

        ex, s, dp, tp = pipe._executor, topo.pp_rank, topo.dp_rank, topo.tp_rank
        received = self.inbox.pop((dp, s, tp), {})
        book = dict(received)
        sends: dict[Any, dict[tuple[int, int], Any]] = {}   # input specs -> what it sends
        modes = {m: m.training for m in pipe.partition.modules()}
        pipe.partition.eval()   # the same shapes; no batch-norm statistics, no dropout drawn
        try:
            for i, first_input in enumerate(inputs):
                # outputs depend on input shapes only (the executor requires it): equal
                # micro-batches need one forward
                key = (signature([first_input]) if s == 0 else received[FWD, s - 1, i],
                       *(received[SKIP, src, i] for src in ex.skip_in))
                if key not in sends:
                    sends[key] = _sends(pipe, s, first_input, received, i)
                for (channel, dst), spec in sends[key].items():
                    book[channel, dst, i] = spec
                    self.inbox.setdefault((dp, dst, tp), {})[channel, s, i] = spec
        finally:
            for m, training in modes.items():
                m.training = training
        return book


def _sends(pipe: HybridPipe, s: int, first_input: Any, received: dict[SpecKey, Any],
           i: int) -> dict[tuple[int, int], Any]:
    """{(channel, peer stage): spec} of the messages stage `s` sends for micro-batch `i`."""
    from torchgpipe.skip.tracker import use_skip_tracker

    from hybridpar import comm
    from hybridpar.pipeline.lowering import FWD, SKIP
    from hybridpar.pipeline.skip import StageSkipTracker

    ex = pipe._executor
    x = first_input if s == 0 else _fake_message(received[FWD, s - 1, i], pipe.device)
    incoming: dict[Any, Tensor | None] = {}
    for src, routes in ex.skip_in.items():
        tensors = _fake_message(received[SKIP, src, i], pipe.device)
        incoming.update((r.key, t) for r, t in zip(routes, tensors))
    tracker = StageSkipTracker(ex.spec.routes, s, incoming)
    with torch.no_grad(), use_skip_tracker(tracker):
        out = pipe.partition(x)
    sent = {} if ex.last else {(FWD, s + 1): comm.spec_of(
        out if isinstance(out, tuple) else (out,), ex.tp, grads=True,
        single=isinstance(out, Tensor))}
    for dst, routes in ex.skip_out.items():
        sent[SKIP, dst] = comm.spec_of([tracker.outgoing[r.key] for r in routes], ex.tp,
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
    if par.tp_plan is not None:
        from hybridpar.tensor_parallel.plan import apply_tp_plan

        module = apply_tp_plan(module, par.tp_plan, group=topo.tp_group)
    balance = [int(b) for b in balance_by(name, par.pp, module)]
    if name != par.balance:
        notes.append(f"balance={par.balance!r} profiles real kernels; the dry run split by "
                     f"'params': {balance} (pin a split with --set parallel.balance="
                     f"{balance.__repr__().replace(' ', '')})")
    return dataclasses.replace(config, parallel=dataclasses.replace(par, balance=balance))


# failures ----------------------------------------------------------------------------------
class _LayerStack:
    """Which module of the partition runs (forward pre-hooks push, forward hooks pop); after
    an exception the stack still names the innermost one."""

    def __init__(self, partition: nn.Module) -> None:
        self.partition = partition
        self.stack: list[tuple[str, nn.Module]] = []

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        self.stack = []
        handles = []
        for name, module in self.partition.named_modules():
            if module is not self.partition:
                handles.append(module.register_forward_pre_hook(
                    lambda m, a, name=name: self.stack.append((name, m))))
                handles.append(module.register_forward_hook(lambda m, a, o: self._pop(m)))
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _pop(self, module: nn.Module) -> None:
        if self.stack and self.stack[-1][1] is module:
            self.stack.pop()

    def describe(self) -> str | None:
        if not self.stack:
            return None
        (top, outer), (name, inner) = self.stack[0], self.stack[-1]
        text = f"layer {name} ({type(inner).__name__})"
        return text if top == name else f"{text} inside layer {top} ({type(outer).__name__})"


def _failure(error: BaseException, where: str, layers: _LayerStack | None, during: str, *,
             cpu: bool = False) -> CheckError:
    """The one-line CheckError of an exception of a rank's step (`cpu`: on fake CPU ranks,
    where a value read on the host is no fault, but a fake run cannot follow it)."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        FakeTensorDeviceMismatchError,
    )

    rank = int(where.split()[1])
    chain: list[BaseException] = []
    cause: BaseException | None = error
    while cause is not None and cause not in chain:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    layer = layers.describe() if layers is not None else None
    place = f"in {layer}" if layer else f"in {during} (outside the stage's layers)"
    for e in reversed(chain):   # the root cause first
        if isinstance(e, FakeTensorDeviceMismatchError) or "found two different devices" \
                in str(e):
            return CheckError(f"{where}: tensors on the GPU and the CPU meet {place}{_site(e)}"
                              "; create tensors on the input's device (torch.zeros(..., "
                              "device=x.device)) or register them as buffers", rank=rank)
        if isinstance(e, (DataDependentOutputException, DynamicOutputShapeException)) or \
                type(e).__name__ == "GuardOnDataDependentSymNode":
            if cpu:
                return CheckError(f"{where}: a value is read on the host {place}{_site(e)}; "
                                  "fine on CPU ranks, but a fake run cannot follow it: check "
                                  "this config with --device cuda", rank=rank)
            return CheckError(f"{where}: host synchronisation {place}{_site(e)}: .item(), "
                              ".tolist(), bool(t), float(t) or a value-dependent shape of a "
                              "device tensor waits for the GPU; keep values on the device "
                              "(torch.where, masks) or read them once per step", rank=rank)
    root = chain[-1]
    text = str(root).replace(f"{STANDIN}:0", "cuda:0").replace(STANDIN, "cuda")
    return CheckError(f"{where}: {during} failed {place}{_site(root)}: "
                      f"{type(root).__name__}: {(text.splitlines() or [''])[0]}", rank=rank)


def _site(error: BaseException) -> str:
    """The deepest frame of `error` outside torch and this dry run: `` at file:line `code` ``."""
    skip = (str(Path(torch.__file__).parent), "torchgpipe", __file__,
            *(str(Path(__file__).with_name(n)) for n in ("check_memory.py", "check_fake_gpu.py")))
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not any(f.filename.startswith(s) or s in f.filename for s in skip)]
    if not frames:
        return ""
    f = frames[-1]
    path = os.path.relpath(f.filename)
    code = (f.line or "").split("  #")[0].strip()   # without an inline comment
    return f" at {f.filename if path.startswith('..') else path}:{f.lineno} `{code}`"


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


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m hybridpar.train.check RESULT.json < JOB.json (dry_run's child; "
                 "use `hybridpar check CONFIG`)")
    sys.exit(_child(sys.argv[1]))
