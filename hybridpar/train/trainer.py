"""The training loop of `hybridpar run`: one call of `train` per worker process.

    resume (latest complete checkpoint) | init-from (a plain export: safetensors read
    by keys and slices, or a .pt file) | fresh (the seed)
    per step:  lr_at(step) -> data -> HybridPipe.train_step -> [replica check] -> global
               grad clip -> AdamW (a NaN / inf loss or gradient norm: stop, or skip the
               update: train.nonfinite; the replica check every parallel.check_replicas steps)
    then:      metrics.jsonl and the progress bar (the rank holding the loss),
               eval loss every eval_every, a checkpoint every `every`, a text sample at the end

Every rank runs the same loop in lockstep; each builds the whole model from the seed and keeps
its stage's tp shards, so every layout starts from the weights of the one-device model (with
``model.pretrained`` it builds the model on ``meta`` and reads only its stage's tp shards
from the checkpoint).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from hybridpar.comm.agreement import fail_together
from hybridpar.data.windows import TokenWindows
from hybridpar.device import pinned
from hybridpar.models import generate
from hybridpar.models.registry import takes_tokens
from hybridpar.optim import MasterWeights, local_optimizer, owned_parameters, pipe_optimizer
from hybridpar.pipe import HybridPipe
from hybridpar.pipeline.parameters.replicas import ReplicaMismatchError
from hybridpar.pipeline.schedules.layout import Layout
from hybridpar.pipeline.tracing.trace_report import TraceRequest, traced_step
from hybridpar.precision import PARAM_DTYPES, check_dtype_runs
from hybridpar.tensor_parallel.random import (
    get_rng_state_all,
    model_parallel_manual_seed,
    set_rng_state_all,
)
from hybridpar.topology import Topology, current_topology, init
from hybridpar.trace import comm_stats, reset_comm_stats
from hybridpar.train.checkpoints.checkpoint import (
    CheckpointError,
    allocate_like,
    latest_checkpoint,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
)
from hybridpar.train.checkpoints.shards import (
    Entry,
    check_unique,
    flatten,
    model_entries,
    optimizer_entries,
    tie_entries,
    unflatten,
)
from hybridpar.train.configs.config import Config, write_resolved
from hybridpar.train.configs.model_build import build_model
from hybridpar.train.data import SyntheticBatches, TokenBatches, decode, make_batches
from hybridpar.train.export import load_exported
from hybridpar.train.lr import lr_at
from hybridpar.train.metrics import (
    MetricsLog,
    ScalarSinks,
    gather_peak_memory,
    job_peak_flops,
    model_flops,
)
from hybridpar.train.nccl_env import nccl_env

__all__ = ["HOST_MEMORY_BUDGET", "build_pipe", "cap_host_memory", "loss_rank", "train"]

log = logging.getLogger(__name__)

Batches = TokenBatches | SyntheticBatches | TokenWindows

#: checkpoint keys of what a token folder's windows are (`TokenWindows.identity`)
_DATA_ID = "data_id/"

#: the environment variable `cap_host_memory` reads: a size ("300MiB") or bytes
HOST_MEMORY_BUDGET = "HYBRIDPAR_HOST_MEMORY_BUDGET"


def _topology(config: Config) -> Topology:
    """The current topology if it matches the config's layout, else `hybridpar.init` it."""
    par = config.parallel
    if dist.is_initialized():
        with contextlib.suppress(RuntimeError):
            topo = current_topology()
            if (topo.pp, topo.tp) == (par.pp, par.tp) and par.dp in (None, topo.dp):
                return topo
    return init(pp=par.pp, tp=par.tp, dp=par.dp, timeout=par.timeout)


def cap_host_memory() -> int | None:
    """With ``HYBRIDPAR_HOST_MEMORY_BUDGET=SIZE`` set (``"300MiB"``, bytes), cap this process's
    address space at its size now + SIZE (``setrlimit(RLIMIT_AS)``); the cap in bytes, or None.

    `build_pipe` calls it once the model is built on ``meta`` (its libraries imported, no
    weights yet; a model its builder makes whole is counted in "now"): the rank's shard,
    what it reads of a checkpoint, gradients, optimizer state, activations and checkpoint
    saves must then fit in SIZE, or the rank fails at the allocation that went past it
    (torch: "DefaultCPUAllocator: can't allocate memory"; Python: `MemoryError`), and the
    run with it, instead of the kernel's OOM killer ending some process of the machine.
    It caps address space, not resident memory, so it is for CPU ranks: CUDA maps far more
    than it uses, glibc reserves 64 MiB per malloc arena (set ``MALLOC_ARENA_MAX=2`` with
    it), and a safetensors file being read is mapped whole (keep checkpoint files smaller
    than SIZE). Linux only (tests/test_run_memory_limit.py trains a model larger than SIZE).
    """
    from hybridpar.io.weight_files import parse_size

    text = os.environ.get(HOST_MEMORY_BUDGET, "").strip()
    if not text:
        return None
    try:
        budget = parse_size(text)
    except ValueError:
        raise ValueError(f"{HOST_MEMORY_BUDGET}={text!r} is not a size: give bytes or a size "
                         "such as '300MiB'") from None
    import resource

    status = Path("/proc/self/status").read_text().splitlines()
    size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = size + budget if hard == resource.RLIM_INFINITY else min(size + budget, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    log.info("%s=%s: address space capped at %.0f MiB (%.0f MiB now)", HOST_MEMORY_BUDGET,
             text, cap / 2**20, size / 2**20)
    return cap


def loss_rank(topo: Topology) -> int:
    """The rank that reports: last stage, tp rank 0, dp rank 0 (not necessarily rank 0)."""
    return topo.global_rank(0, topo.pp - 1, 0)


def build_pipe(config: Config, topo: Topology, *, sample: Any = None) -> HybridPipe:
    """The config's model built from its seed on every rank, as this rank's HybridPipe stage.

    The zoo's models and ``hf:`` families are built on ``meta``: the pipe gives storage to
    this rank's stages and tp slices only, drawn module by module under seeds keyed by
    ``train.seed`` and their names (`hybridpar.keyed.KeyedInit`; the same values as the
    one-device model and every other layout). With ``model.pretrained`` they are zeros and
    the rotary buffers (`hybridpar.hf.init_for_loading`), and the rank reads just its tensors
    from the checkpoint (`hybridpar.hf.load_hf_shards`). A user's builder is built on
    ``meta`` too once `train.configs.builder_check` accepts it; ``model.init = "full"`` builds any
    model whole. Then the random streams are seeded again, so what the build drew
    (balance profiling) does not move dropout.
    """
    par, name = config.parallel, config.model.name
    if config.train.precision == "bf16":   # before the model is built, on every rank
        check_dtype_runs(torch.bfloat16, topo.device, what="train.precision = 'bf16'")
    extra: dict[str, Any] = dict(tp=par.tp, group=topo.tp_group) \
        if par.tp > 1 and par.tp_plan is None else {}
    if par.sequence_parallel and not name.startswith("hf:"):   # hf: HybridPipe applies it
        extra["sequence_parallel"] = True
    pretrained = config.model.args.get("pretrained") if name.startswith("hf:") else None
    torch.manual_seed(config.train.seed)
    model_parallel_manual_seed(config.train.seed, group=topo.tp_group)
    model, loss, init = build_model(config, **extra)   # `train.configs.model_build`: meta, keyed
    cap_host_memory()   # HYBRIDPAR_HOST_MEMORY_BUDGET: what the shard and the steps may add
    # balance = "time" profiles under the precision the run trains in
    bf16 = config.train.precision == "bf16"
    with torch.autocast(topo.device.type, dtype=torch.bfloat16, enabled=bf16):
        pipe = HybridPipe(model, par.balance, chunks=par.chunks, topology=topo,
                          schedule=par.schedule, virtual_stages=par.virtual_stages,
                          checkpoint=par.checkpoint, loss_fn=loss, tp_plan=par.tp_plan,
                          deferred_batch_norm=par.deferred_batch_norm, balance_sample=sample,
                          init_fn=init, param_dtype=PARAM_DTYPES[config.train.param_dtype],
                          compile=config.train.compile,
                          sequence_parallel=par.sequence_parallel and name.startswith("hf:"))
    if pretrained is not None:
        from hybridpar.hf import load_hf_shards

        loaded = load_hf_shards(pipe, pretrained)
        log.info("model.pretrained %s: read %d tensors (%.1f MiB) on this rank", pretrained,
                 loaded.tensors, loaded.bytes_read / 2**20)
    torch.manual_seed(config.train.seed)
    model_parallel_manual_seed(config.train.seed, group=topo.tp_group)
    return pipe


def _optimizer(pipe: HybridPipe, config: Config) -> Any:
    """AdamW over this rank's shards: weight decay on matrices, none on biases and norms;
    with ``parallel.zero`` >= 1 and dp > 1 its state (and at 2 the gradients) sharded over
    dp, over float32 master weights of bf16 ones (`hybridpar.optim.pipe_optimizer`)."""
    params = [p for p in pipe.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [g for g in ({"params": decay, "weight_decay": config.train.weight_decay},
                          {"params": rest, "weight_decay": 0.0}) if g["params"]]
    zero = config.parallel.zero
    if zero and pipe.topology.dp == 1:
        if pipe.topology.rank == 0:
            log.warning("parallel.zero = %d at dp = 1: nothing to shard, the optimizer state "
                        "is whole on every rank", zero)
        zero = 0
    return pipe_optimizer(pipe, torch.optim.AdamW, groups, zero=zero, lr=config.train.lr)


class _Run:
    """The state of one worker's run: pipe, optimizer, data, step; saved and loaded whole."""

    def __init__(self, config: Config, run_dir: Path, topo: Topology) -> None:
        self.config, self.run_dir, self.topo = config, run_dir, topo
        self.reporter = topo.rank == loss_rank(topo)
        # token windows are read by the first stage's ranks (x) and the last stage's (y) only
        par = config.parallel
        stages = Layout.of(par.schedule, par.pp, par.virtual_stages)
        held = stages.stages_of(topo.pp_rank)
        self.reads = {"inputs": 0 in held, "targets": stages.stages - 1 in held}
        self.batches = make_batches(config, split="train", dp_rank=topo.dp_rank, dp=topo.dp,
                                    **self.reads)
        sample = None
        if isinstance(config.parallel.balance, str) and config.parallel.balance in (
                "time", "size"):
            sample = make_batches(config, split="train", dp_rank=topo.dp_rank,
                                  dp=topo.dp).next_batch()[0]
        self.pipe = build_pipe(config, topo, sample=sample)
        self.optimizer = _optimizer(self.pipe, config)
        self.step = 0
        self.layers = self.pipe.layers

    # checkpoint state ---------------------------------------------------------------------
    def _tp_group(self) -> Any:
        return self.topo.tp_group if self.topo.tp > 1 else None

    def _coordinate(self) -> str:
        return f"rng/{self.topo.dp_rank}.{self.topo.pp_rank}.{self.topo.tp_rank}"

    def _layout(self) -> Tensor:
        t = self.topo
        return torch.tensor([t.dp, t.pp, t.tp, *self.pipe.balance], dtype=torch.int64)

    def state(self) -> dict[str, Entry]:
        """Everything a resume needs, under layout-free keys (see `shards`)."""
        group = self._tp_group()
        tied = self.pipe.tied_aliases
        if isinstance(self.optimizer, MasterWeights):   # the update's broadcast: all arrived
            self.optimizer.wait_params()
        masters = getattr(self.optimizer, "masters", None)   # bf16 weights: float32 values
        state: dict[str, Entry] = {
            **model_entries(self.pipe, group, aliases=tied, masters=masters),
            **optimizer_entries(self.pipe, local_optimizer(self.optimizer), group,
                                aliases=tied, owned=owned_parameters(self.optimizer),
                                masters=masters)}
        state.update(tie_entries(tied))   # lets an export give every tied name its tensor
        state["train/step"] = torch.tensor(self.step, dtype=torch.int64)
        state.update(flatten("data", {k: torch.tensor(v, dtype=torch.int64)
                                      for k, v in self.batches.state_dict().items()}))
        if isinstance(self.batches, TokenWindows):
            state.update({_DATA_ID + k: _encode_id(v)
                          for k, v in self.batches.identity().items()})
        state["layout"] = self._layout()
        state.update(flatten(self._coordinate(), get_rng_state_all()))
        return state

    def save(self) -> Path:
        state = self.state()
        check_unique(state, self.layers, tied=set(self.pipe.tied_aliases.values()))
        path = save_checkpoint(self.run_dir / "checkpoints", self.step, state,
                               keep=self.config.checkpoint.keep)
        log.info("saved checkpoint %s", path)
        return path

    def load(self, path: Path) -> None:
        """Continue from checkpoint `path` (saved under this or any other layout)."""
        metadata = read_metadata(path)
        state = self.state()
        rng_keys = [k for k in state if k.startswith("rng/")]
        for key in [*rng_keys, *(k for k in state if k.startswith(_DATA_ID))]:
            del state[key]
        saved_rng = [k for k in rng_keys if k in metadata.state_dict_metadata]
        saved_id = [k for k in metadata.state_dict_metadata if k.startswith(_DATA_ID)] \
            if isinstance(self.batches, TokenWindows) else []
        state.update(allocate_like(metadata, ["layout", *saved_rng, *saved_id]))
        load_checkpoint(path, state)
        if isinstance(self.optimizer, MasterWeights):   # the masters read: the weights follow
            self.optimizer.copy_to_params()
        step = state["train/step"]
        assert isinstance(step, Tensor)
        self.step = int(step)
        position = {k.removeprefix("data/"): int(v) for k, v in state.items()
                    if k.startswith("data/") and isinstance(v, Tensor)}
        if isinstance(self.batches, TokenWindows) and self._data_changed(path, {
                k.removeprefix(_DATA_ID): _decode_id(v) for k, v in state.items()
                if k.startswith(_DATA_ID) and isinstance(v, Tensor)}):
            position = {"epoch": 0, "index": 0}
        self.batches.load_state_dict(position)
        same_layout = torch.equal(state["layout"], self._layout()) \
            if isinstance(state["layout"], Tensor) else False
        if same_layout and len(saved_rng) == len(rng_keys):
            flat = {k: v for k, v in state.items() if k in saved_rng and isinstance(v, Tensor)}
            set_rng_state_all(unflatten(self._coordinate(), flat, get_rng_state_all()))
        else:
            seed = self.config.train.seed + self.step
            torch.manual_seed(seed)
            model_parallel_manual_seed(seed, group=self.topo.tp_group)
            log.info("checkpoint layout differs (dp, pp, tp, balance): random streams re-seeded "
                     "from train.seed + step; dropout masks differ from an unchanged run")
        log.info("resumed from %s at step %d", path, self.step)

    def _data_changed(self, path: Path, saved: dict[str, Any]) -> bool:
        """Whether the token windows differ from those checkpoint `path` was trained on: a
        `CheckpointError` naming what changed, or True (start the data order over) with
        ``data.restart``; False when they are the same."""
        assert isinstance(self.batches, TokenWindows)
        now = self.batches.identity()
        what = {"tokenizer": "the tokenizer (meta.json tokenizer.sha256)",
                "fingerprint": "the corpus (meta.json fingerprint: its tokens)",
                "seq_len": "data.seq_len", "seed": "data.seed"}
        if not saved:
            changed = ["the data: the checkpoint was not trained on a token folder"]
        elif saved.get("tokenizer") != now["tokenizer"]:
            changed = [what["tokenizer"]]   # (a new tokenizer changes the tokens too)
        else:
            changed = [f"{what[k]}: {saved.get(k)!r} -> {now[k]!r}" if k in ("seq_len", "seed")
                       else what[k] for k in ("fingerprint", "seq_len", "seed")
                       if saved.get(k) != now[k]]
        if not changed:
            return False
        message = (f"checkpoint {path} was trained on other data windows than "
                   f"data.path {self.config.data.path!r} gives; changed: {'; '.join(changed)}")
        if not self.config.data.restart:
            raise CheckpointError(f"{message}. Resume with the data it was trained on, or set "
                                  "data.restart = true (--set data.restart=true) to keep the "
                                  "weights and start the new data's order from its beginning")
        if self.reporter:
            log.warning("%s; data.restart = true: the data order starts over", message)
        return True

    def init_from(self, path: str) -> None:
        """Start from a plain single-device state dict (`hybridpar export`'s output).

        Safetensors (the export folder, its index, a ``.safetensors`` file): each rank reads
        its stages' keys and, of a tp-sharded tensor, its slice, straight into the
        parameters (`hybridpar.hf.shard_load.load_plain_shards`). A ``.pt`` file: read whole
        on every rank, then each stage keeps its part.
        """
        from hybridpar.train.configs.options import init_from_format

        with fail_together(CheckpointError):   # (the same answer on every rank, unless a
            try:                               # file system differs between hosts)
                kind = init_from_format(path)
            except ValueError as e:
                raise CheckpointError(str(e)) from None
        if kind == "safetensors":
            self._init_from_safetensors(path)
            return
        try:
            full = load_exported(path)
        except Exception as e:
            raise CheckpointError(
                f"--init-from {path} cannot be read as a state dict of tensors with "
                f"torch.load(weights_only=True) ({type(e).__name__}); give a .pt file written "
                "by `hybridpar export`") from None
        with fail_together(CheckpointError):   # each stage checks its own keys: agree
            try:
                self.pipe.load_consolidated_state_dict(full)
            except (KeyError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"--init-from {path} does not fit model "
                                      f"{self.config.model.name!r}: {e}") from None
        log.info("initialized the weights from %s", path)

    def _init_from_safetensors(self, path: str) -> None:
        from hybridpar.hf.shard_load import load_plain_shards

        try:   # (load_plain_shards raises on every rank alike)
            loaded = load_plain_shards(self.pipe, path,
                                       model=f"model {self.config.model.name!r}")
        except (FileNotFoundError, ValueError, OSError, RuntimeError) as e:
            raise CheckpointError(f"--init-from {path}: {e}") from None
        log.info("initialized the weights from %s: read %d tensors (%.1f MiB) on this rank",
                 path, loaded.tensors, loaded.bytes_read / 2**20)


def _encode_id(value: str | int) -> Tensor:
    """A data identity value as a checkpoint tensor: an int as int64, a str as its bytes."""
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    return torch.tensor(list(value.encode()), dtype=torch.uint8)


def _decode_id(t: Tensor) -> str | int:
    return bytes(t.tolist()).decode() if t.dtype == torch.uint8 else int(t)


def _resume_step(root: Path) -> int:
    """The latest complete checkpoint's step as global rank 0 sees it (-1: none), on all."""
    found = latest_checkpoint(root) if dist.get_rank() == 0 else None
    step = torch.tensor(int(found.name.removeprefix("step-")) if found else -1)
    dist.broadcast(step, 0)
    return int(step)


def _tokens_per_sample(config: Config) -> int:
    return int(config.data.seq_len or 1) if takes_tokens(config.model.name) else 1


def _evaluate(run: _Run) -> float:
    """Mean loss over the first `eval_batches` validation batches (the same ones every time)."""
    cfg, topo = run.config, run.topo
    batches = make_batches(cfg, split="val", dp_rank=topo.dp_rank, dp=topo.dp, **run.reads)
    run.pipe.eval()
    total = 0.0
    for _ in range(cfg.train.eval_batches):
        x, y = batches.next_batch()
        total += float(run.pipe.eval_step(x, y))
    run.pipe.train()
    return total / cfg.train.eval_batches


def _sample(run: _Run) -> str | None:
    """A text sample through the pipeline, from the start of the validation text."""
    cfg = run.config
    if not takes_tokens(cfg.model.name) or cfg.train.sample_tokens == 0 \
            or cfg.data.source == "synthetic":
        return None
    val = make_batches(cfg, split="val", **run.reads)
    if isinstance(val, TokenWindows):   # the prompt matters on the first stage only
        prompt = torch.from_numpy(val.window(0)[:8].astype("int64")).view(1, -1) \
            if val.reads else torch.zeros(1, 8, dtype=torch.int64)        # (1, 8)
    else:
        assert isinstance(val, TokenBatches)
        prompt = val.tokens[:8].view(1, -1)                                # (1, 8)
    run.pipe.eval()
    with torch.no_grad():
        out = generate(run.pipe, prompt, cfg.train.sample_tokens, temperature=0.8, top_k=32,
                       generator=torch.Generator().manual_seed(cfg.train.seed),
                       block_size=cfg.data.seq_len)                       # (1, 8 + n)
    run.pipe.train()
    if isinstance(val, TokenWindows):   # the folder's own tokenizer (bytes: UTF-8 bytes)
        return val.folder.decode(out[0].numpy()) if val.reads else None
    return decode(out[0])


class _Reporter:
    """Progress bar, metrics.jsonl and throughput over the log window (rank `loss_rank` only);
    MFU and every rank's peak memory (`train.metrics`: the gather runs on every rank, at log
    steps only); TensorBoard / W&B copies as [logging] asks."""

    def __init__(self, run: _Run, *, start: int, progress: bool) -> None:
        cfg = run.config
        self.active = run.reporter
        self.metrics = MetricsLog(run.run_dir / "metrics.jsonl", after=start) \
            if self.active else None
        self.bar = tqdm(total=cfg.train.steps, initial=start, desc=cfg.name, unit="step",
                        disable=not (self.active and progress), file=sys.stderr,
                        dynamic_ncols=True, mininterval=0.5)
        self.items = cfg.train.batch_size * _tokens_per_sample(cfg)    # per step, global
        self.unit = "tokens_per_s" if takes_tokens(cfg.model.name) else "samples_per_s"
        self.window_time, self.window_steps = 0.0, 0
        self.device, self.dst = run.pipe.device, loss_rank(run.topo)
        self.peak, source = job_peak_flops(self.device, run.topo.world_size)   # every rank
        self.flops, how = model_flops(cfg) if self.active else (None, "")
        if self.active:
            log.info("MFU: %s model FLOPs per %s over a peak of %s FLOP/s (%s)",
                     "unknown" if self.flops is None else f"{self.flops:.4g} ({how})",
                     self.unit.split("_")[0][:-1], "unknown" if self.peak is None
                     else f"{self.peak:.4g}", source)
        self.sinks = ScalarSinks(cfg, run.run_dir) if self.active else None

    def step(self, record: dict[str, Any], elapsed: float, *, log: bool) -> None:
        """Count a step; when `log`, write its record with the window's throughput."""
        self.window_time, self.window_steps = self.window_time + elapsed, self.window_steps + 1
        if log:
            step_time = self.window_time / self.window_steps
            rate = self.items / step_time
            mfu = None if self.flops is None or not self.peak else self.flops * rate / self.peak
            memory = gather_peak_memory(self.device, self.dst)   # a collective: every rank
            record = {**record, self.unit: rate, "step_time": step_time, "mfu": mfu,
                      **(memory or {})}
            if self.metrics is not None:
                self.metrics.write(record)
            if self.sinks is not None:
                self.sinks.write(record)
            self.bar.set_postfix({"loss": f"{record['loss']:.4f}",
                                  self.unit.split("_")[0] + "/s": f"{rate:,.0f}"})
            self.window_time, self.window_steps = 0.0, 0
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        if self.metrics is not None:
            self.metrics.close()
        if self.sinks is not None:
            self.sinks.close()


def _check_replicas(run: _Run, step: int) -> float:
    """`HybridPipe.check_replicas` after step `step`'s backward (every rank, the same step):
    the largest difference between copies, or `ReplicaMismatchError` on every rank, naming
    the step."""
    par = run.config.parallel
    try:
        return run.pipe.check_replicas(atol=par.replica_atol)
    except ReplicaMismatchError as e:
        hint = ("; differences of rounding size on a GPU can come from its non-deterministic "
                "kernels: allow them with parallel.replica_atol"
                if run.pipe.device.type == "cuda" else "")
        raise ReplicaMismatchError(
            f"step {step} (parallel.check_replicas = {par.check_replicas}, replica_atol = "
            f"{par.replica_atol:g}): {e}{hint}") from None


def _train_step(run: _Run, autocast: Any, trace: TraceRequest | None) -> dict[str, Any]:
    """One optimizer step: lr, batch, forward and backward, clip, update; its record.

    The record's ``"loss"`` and ``"grad_norm"`` stay device tensors: the host reads them in
    `_resolve`, every ``train.log_every`` steps, so a step does not wait for its GPU work
    (the pipe, the clip and the update read nothing on the host either). With
    ``train.nonfinite = "skip"`` the step reads them once itself: a non-finite loss or
    gradient norm drops its update (``"skipped": true``). Every
    ``parallel.check_replicas``-th step the replicated parameters' copies are compared before
    the update (`_check_replicas`).
    """
    cfg = run.config.train
    step = run.step + 1
    lr = lr_at(run.step, lr=cfg.lr, steps=cfg.steps, warmup_steps=cfg.warmup_steps,
               min_lr=cfg.min_lr)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    x, y = run.batches.next_batch()
    x, y = pinned(run.pipe.device, x, y)   # on a GPU: the pipe's copies overlap compute
    run.optimizer.zero_grad(set_to_none=True)
    reset_comm_stats()
    with traced_step(run.pipe, trace, step=step, last=cfg.steps), autocast:
        loss = run.pipe.train_step(x, y).detach()
    record: dict[str, Any] = {"step": step, "loss": loss, "lr": lr}
    every = run.config.parallel.check_replicas
    if every and step % every == 0:
        record["replica_diff"] = _check_replicas(run, step)
    # the norm is taken even without clipping: a NaN gradient is found, and never applied
    # under "skip"
    record["grad_norm"] = run.pipe.clip_grad_norm_(cfg.grad_clip or math.inf)
    problem = _nonfinite(*torch.stack([loss.float(), record["grad_norm"].float()]).tolist()) \
        if cfg.nonfinite == "skip" else None   # "skip" decides now: one host read a step
    if problem is None:
        run.optimizer.step()
    else:
        run.optimizer.zero_grad(set_to_none=True)
        record["skipped"] = True
        if run.reporter:
            log.warning("skipped step %d: %s (train.nonfinite = 'skip': no update, gradients "
                        "dropped)", step, problem)
    record["comm"] = comm_stats()   # this step's bytes and calls per kind, on this rank
    run.step += 1
    return record


def _nonfinite(loss: float, norm: float) -> str | None:
    """What is not finite of a step's loss and gradient norm, or None."""
    if not math.isfinite(loss):
        return f"the loss is {loss}"
    if not math.isfinite(norm):
        return f"the gradient norm is {norm} (loss {loss:.6g})"
    return None


def _resolve(records: list[dict[str, Any]], *, clipped: bool) -> None:
    """Read the steps' losses and gradient norms in one host read (what waits for the GPU),
    as floats in place; a non-finite one stops the run (``train.nonfinite = "stop"``) with
    `FloatingPointError` naming its step. Without clipping the norm leaves the record."""
    if not records:
        return
    values = torch.stack([torch.stack([r["loss"].float(), r["grad_norm"].float()])
                          for r in records]).tolist()   # (steps, 2): the one host read
    for r, (loss, norm) in zip(records, values):
        r["loss"] = loss
        if clipped:
            r["grad_norm"] = norm
        else:
            del r["grad_norm"]
        problem = None if r.get("skipped") else _nonfinite(loss, norm)
        if problem is not None:
            raise FloatingPointError(
                f"{problem} at step {r['step']}; lower train.lr, set train.grad_clip, or use "
                "precision = 'fp32' (or set train.nonfinite = 'skip' to drop such steps' "
                "updates and go on). The losses are read every train.log_every steps: the "
                "updates after that step ran, but no checkpoint holds them")


def train(config: Config, run_dir: str | os.PathLike[str], *, init_from: str | None = None,
          stop_at: int | None = None, progress: bool = True,
          trace: TraceRequest | None = None, write_config: bool = True) -> dict[str, Any]:
    """Train `config` in RUN_DIR on every rank of the (already launched) job; a summary.

    Resumes from RUN_DIR/checkpoints when a complete checkpoint is there, else starts from
    `init_from` (a plain state dict) or from the seed. `stop_at` ends this process after that
    step (and its checkpoint, if one is due), as an interruption would. `trace`: the step to
    trace (`trace_report.request_trace`). `write_config`: rank 0 writes RUN_DIR/config.json
    (False: `hybridpar run` wrote it before starting the workers). Returns, on every rank,
    ``{"start": first step run, "losses": [...], "eval": {step: loss}, "sample": text}``.
    """
    run_dir = Path(run_dir)
    nccl_env(run_dir, create=torch.cuda.is_available())   # before the process group exists
    topo = _topology(config)
    if topo.rank == 0 and write_config:
        write_resolved(config, run_dir)
    run = _Run(config, run_dir, topo)
    cfg = config.train
    resume = _resume_step(run_dir / "checkpoints")
    if resume >= 0:
        run.load(run_dir / "checkpoints" / f"step-{resume}")
    elif init_from is not None:
        run.init_from(init_from)
        if isinstance(run.optimizer, MasterWeights):   # the masters from the loaded weights
            run.optimizer.copy_from_params()
    start = run.step
    reporter = _Reporter(run, start=start, progress=progress)
    autocast = torch.autocast(run.pipe.device.type, dtype=torch.bfloat16,
                              enabled=cfg.precision == "bf16")
    # bf16 weights take autocast to meet float inputs; float32 ones evaluate in float32
    evaluating = autocast if cfg.param_dtype != "fp32" else contextlib.nullcontext()
    losses: list[float] = []
    evals: dict[int, float] = {}
    last = min(cfg.steps, stop_at) if stop_at is not None else cfg.steps
    every = config.checkpoint.every
    quiet = logging_redirect_tqdm() if run.reporter and progress else contextlib.nullcontext()
    with quiet:  # log lines go above the bar, not through it
        pending: list[dict[str, Any]] = []   # steps whose loss the host has not read yet
        while run.step < last:
            began = time.perf_counter()
            record = _train_step(run, autocast, trace)
            elapsed = time.perf_counter() - began
            pending.append(record)
            evaluate = bool(cfg.eval_every) and run.step % cfg.eval_every == 0
            save = bool(every) and (run.step % every == 0 or run.step == cfg.steps)
            show = run.step % cfg.log_every == 0 or run.step == cfg.steps or evaluate or \
                "skipped" in record
            if show or save or run.step == last:   # never a checkpoint of a non-finite step
                _resolve(pending, clipped=bool(cfg.grad_clip))
                losses.extend(r["loss"] for r in pending)
                pending = []
            if evaluate:
                with evaluating:
                    evals[run.step] = record["eval_loss"] = _evaluate(run)
            reporter.step(record, elapsed, log=show)
            if save:
                run.save()
        reporter.close()
        with evaluating:
            sample = _sample(run) if run.step == cfg.steps and start < run.step else None
        if sample is not None and run.reporter:
            (run_dir / "sample.txt").write_text(sample, encoding="utf-8")
            log.info("sample:\n%s", sample)
    run.pipe.close()   # its threads stop before the process group goes
    return {"start": start, "losses": losses, "eval": evals, "sample": sample,
            "steps": run.step}
