"""The state of one worker's run (pipe, optimizer, data, step) as a checkpoint holds it, the
resume from one saved under this or any other layout, and the start from a plain export
(`--init-from`)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hybridpar.comm.agreement import fail_together
from hybridpar.data.windows import PaddedExamples, TokenWindows
from hybridpar.models.hf import expert_count
from hybridpar.moe.bias_update import ExpertBiasUpdate
from hybridpar.moe.observe import RoutingLog
from hybridpar.optim import local_optimizer, owned_parameters
from hybridpar.optim.split import has_masters, parts_of
from hybridpar.pipe import HybridPipe
from hybridpar.pipeline.schedules.layout import Layout
from hybridpar.tensor_parallel.random import (
    get_rng_state_all,
    model_parallel_manual_seed,
    set_rng_state_all,
)
from hybridpar.topology import Topology
from hybridpar.train.build import build_optimizer, build_pipe, loss_rank, token_mean_loss
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
from hybridpar.train.configs.config import Config
from hybridpar.train.data import SyntheticBatches, TokenBatches, make_batches
from hybridpar.train.export import load_exported

__all__ = ["Batches", "RunState", "init_weights_from", "resume_step"]

log = logging.getLogger(__name__)

Batches = TokenBatches | SyntheticBatches | TokenWindows | PaddedExamples

#: checkpoint keys of what a token folder's windows are (`TokenWindows.identity`)
_DATA_ID = "data_id/"


class RunState:
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
        if isinstance(self.batches, PaddedExamples) and self.reporter:
            b = self.batches
            log.info("data.pack = 'pad': %d documents of the train split, one per row; %d "
                     "longer than data.seq_len + 1 = %d tokens %s (data.overlong = %r)",
                     b.windows, b.truncated + b.dropped, b.seq_len + 1,
                     "cut to it" if config.data.overlong == "truncate" else "left out",
                     config.data.overlong)
        sample = None
        if isinstance(config.parallel.balance, str) and config.parallel.balance in (
                "time", "size"):
            sample = make_batches(config, split="train", dp_rank=topo.dp_rank,
                                  dp=topo.dp).next_batch()[0]
        self.pipe = build_pipe(config, topo, sample=sample)
        # a loss mask or padding: the loss is the token mean of each global batch
        self.token_mean = token_mean_loss(self.pipe.loss_fn) \
            if isinstance(self.batches, PaddedExamples) or (
                isinstance(self.batches, TokenWindows) and self.batches.folder.masked) else None
        if self.token_mean is not None:
            self.pipe.loss_fn = self.token_mean
        self.optimizer = build_optimizer(self.pipe, config)
        self.step = 0
        self.layers = self.pipe.layers
        experts = expert_count(config.model.name, config.model.args)
        #: each step's expert load and aux loss, for the metrics (a model with experts)
        self.routing = RoutingLog(self.pipe, layers=sum(self.pipe.balance),
                                  n_experts=experts) if experts else None
        #: DeepSeek-V3's aux-loss-free balancing (gpt's `bias_update_rate`), after each step
        bias = ExpertBiasUpdate(self.pipe, group=topo.dp_group if topo.dp > 1 else None)
        self.expert_bias = bias if bias else None

    def counting(self, targets: Tensor) -> contextlib.AbstractContextManager[Any]:
        """The block of a step on `targets`: with a loss mask, its micro-batch losses add up
        to the token mean of the global batch (`TokenMean.over`: the dp group's counts summed
        on the ranks that compute the loss); else nothing."""
        if self.token_mean is None:
            return contextlib.nullcontext()
        group = self.topo.dp_group if self.reads["targets"] and self.topo.dp > 1 else None
        return self.token_mean.over(targets, group=group, device=self.pipe.device)

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
        if has_masters(self.optimizer):   # the update's broadcast: all arrived
            self.optimizer.wait_params()
        masters = getattr(self.optimizer, "masters", None)   # bf16 weights: float32 values
        experts = (self.topo.ep, self.topo.ep_rank)
        state: dict[str, Entry] = model_entries(self.pipe, group, aliases=tied,
                                                masters=masters, experts=experts)
        for part in parts_of(self.optimizer):   # (with ep and ZeRO: dense, experts)
            state.update(optimizer_entries(self.pipe, local_optimizer(part), group,
                                           aliases=tied, owned=owned_parameters(part),
                                           masters=masters, experts=experts))
        state.update(tie_entries(tied))   # lets an export give every tied name its tensor
        state["train/step"] = torch.tensor(self.step, dtype=torch.int64)
        state.update(flatten("data", {k: torch.tensor(v, dtype=torch.int64)
                                      for k, v in self.batches.state_dict().items()}))
        state.update({_DATA_ID + k: _encode_id(v) for k, v in self.data_identity().items()})
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
        saved_id = [k for k in metadata.state_dict_metadata if k.startswith(_DATA_ID)]
        state.update(allocate_like(metadata, ["layout", *saved_rng, *saved_id]))
        load_checkpoint(path, state)
        if has_masters(self.optimizer):   # the masters read: the weights follow
            self.optimizer.copy_to_params()
        step = state["train/step"]
        assert isinstance(step, Tensor)
        self.step = int(step)
        position = {k.removeprefix("data/"): int(v) for k, v in state.items()
                    if k.startswith("data/") and isinstance(v, Tensor)}
        if not self._data_changed(path, {
                k.removeprefix(_DATA_ID): _decode_id(v) for k, v in state.items()
                if k.startswith(_DATA_ID) and isinstance(v, Tensor)}):
            self.batches.load_state_dict(position)   # (changed: the new data from its start)
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

    def data_identity(self) -> dict[str, Any]:
        """What the run's batches are, as a checkpoint records it: ``data.source``, and of a
        token folder its windows' identity (tokens, tokenizer, seq_len, seed)."""
        identity: dict[str, Any] = {"source": self.config.data.source}
        if isinstance(self.batches, (TokenWindows, PaddedExamples)):
            identity.update(self.batches.identity())
        return identity

    def _data_changed(self, path: Path, saved: dict[str, Any]) -> bool:
        """Whether the batches differ from those checkpoint `path` was trained on, whatever the
        source of either: a `CheckpointError` naming what changed, or True (start the data
        order over) with ``data.restart``; False when they are the same.

            checkpoint's data        the run's data           what is compared
            tokens (folder)          tokens (folder)          tokens, tokenizer, seq_len, seed
            any source               another source           data.source: a change
            before sources were saved (tokens: its folder keys; else nothing to compare)
        """
        now = self.data_identity()
        source = saved.get("source") or ("tokenizer" in saved and "tokens") or None
        what = {"tokenizer": "the tokenizer (meta.json tokenizer.sha256)",
                "fingerprint": "the corpus (meta.json fingerprint: its tokens)",
                "seq_len": "data.seq_len", "seed": "data.seed"}
        if source is None and now["source"] != "tokens":
            return False   # a checkpoint of text, corpus or synthetic data from before 2026-11-28
        if source is None:
            changed = ["the data: the checkpoint was not trained on a token folder"]
        elif source != now["source"]:
            changed = [f"data.source: {source!r} -> {now['source']!r}" + (
                f" (it was trained on a token folder, tokenizer sha256 "
                f"{str(saved.get('tokenizer'))[:12]}...)" if source == "tokens" else "")]
        elif source != "tokens":
            changed = []
        elif saved.get("tokenizer") != now["tokenizer"]:
            changed = [what["tokenizer"]]   # (a new tokenizer changes the tokens too)
        else:
            changed = [f"{what[k]}: {saved.get(k)!r} -> {now[k]!r}" if k in ("seq_len", "seed")
                       else what[k] for k in ("fingerprint", "seq_len", "seed")
                       if saved.get(k) != now[k]]
        if not changed:
            return False
        gives = f"data.path {self.config.data.path!r}" if now["source"] == "tokens" else \
            f"data.source {now['source']!r}"
        message = (f"checkpoint {path} was trained on other data windows than {gives} gives; "
                   f"changed: {'; '.join(changed)}")
        if not self.config.data.restart:
            raise CheckpointError(f"{message}. Resume with the data it was trained on, or set "
                                  "data.restart = true (--set data.restart=true) to keep the "
                                  "weights and start the new data's order from its beginning")
        if self.reporter:
            log.warning("%s; data.restart = true: the data order starts over", message)
        return True


def _encode_id(value: str | int) -> Tensor:
    """A data identity value as a checkpoint tensor: an int as int64, a str as its bytes."""
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    return torch.tensor(list(value.encode()), dtype=torch.uint8)


def _decode_id(t: Tensor) -> str | int:
    return bytes(t.tolist()).decode() if t.dtype == torch.uint8 else int(t)




def resume_step(root: Path) -> int:
    """The latest complete checkpoint's step as global rank 0 sees it (-1: none), on all."""
    found = latest_checkpoint(root) if dist.get_rank() == 0 else None
    step = torch.tensor(int(found.name.removeprefix("step-")) if found else -1)
    dist.broadcast(step, 0)
    return int(step)


def init_weights_from(pipe: HybridPipe, config: Config, path: str) -> None:
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
        _init_from_safetensors(pipe, config, path)
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
            pipe.load_consolidated_state_dict(full, source=path)
        except ValueError as e:   # a tensor that cannot be a weight (its kind, NaN / inf)
            raise CheckpointError(f"--init-from {path}: {e}") from None
        except (KeyError, RuntimeError) as e:
            raise CheckpointError(f"--init-from {path} does not fit model "
                                  f"{config.model.name!r}: {e}") from None
    log.info("initialized the weights from %s", path)

def _init_from_safetensors(pipe: HybridPipe, config: Config, path: str) -> None:
    from hybridpar.hf.shard_load import load_plain_shards

    try:   # (load_plain_shards raises on every rank alike)
        loaded = load_plain_shards(pipe, path,
                                   model=f"model {config.model.name!r}")
    except (FileNotFoundError, ValueError, OSError, RuntimeError) as e:
        raise CheckpointError(f"--init-from {path}: {e}") from None
    log.info("initialized the weights from %s: read %d tensors (%.1f MiB) on this rank",
             path, loaded.tensors, loaded.bytes_read / 2**20)
