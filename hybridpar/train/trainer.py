"""The training loop of `hybridpar run`: one call of `train` per worker process.

    resume (latest complete checkpoint) | init-from (a plain export: safetensors read
    by keys and slices, or a .pt file) | fresh (the seed)
    per step:  lr_at(step) -> data -> HybridPipe.train_step -> [replica check] -> global
               grad clip -> the [optim] optimizer (a NaN / inf loss or gradient norm: stop,
               or skip the update: train.nonfinite, at most train.max_skipped in a row; the
               replica check every parallel.check_replicas steps)
    then:      metrics.jsonl and the progress bar (the rank holding the loss),
               eval loss every eval_every, a checkpoint every `every`, a text sample at the end
    a signal:  SIGTERM / SIGINT on any rank: every rank stops after the same step, with a
               checkpoint (checkpoint.on_signal)

The parts, each named for its job: `build` (topology, pipe, optimizer), `state` (what a
checkpoint holds, resume, --init-from), `step` (one step, evaluation, the sample), `report`
(progress bar, metrics, MFU).

Every rank runs the same loop in lockstep; each builds the whole model from the seed and keeps
its stage's tp shards, so every layout starts from the weights of the one-device model (with
``model.pretrained`` it builds the model on ``meta`` and reads only its stage's tp shards
from the checkpoint).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from hybridpar.comm.agreement import fail_together
from hybridpar.comm.stop_request import stop_on_signals
from hybridpar.io.run_lock import RunDirInUse, hold_run_dir
from hybridpar.optim.split import has_masters
from hybridpar.pipeline.tracing.trace_report import TraceRequest
from hybridpar.topology import Topology
from hybridpar.train.build import (
    HOST_MEMORY_BUDGET,
    build_pipe,
    cap_host_memory,
    loss_rank,
    topology_for,
)
from hybridpar.train.configs.config import Config, write_resolved
from hybridpar.train.nccl_env import nccl_env
from hybridpar.train.report import Reporter
from hybridpar.train.state import RunState, init_weights_from, resume_step
from hybridpar.train.step import (
    check_skipped,
    resolve,
    text_sample,
    train_step,
    validation_loss,
)

__all__ = ["HOST_MEMORY_BUDGET", "build_pipe", "cap_host_memory", "loss_rank", "train"]

log = logging.getLogger(__name__)


def train(config: Config, run_dir: str | os.PathLike[str], *, init_from: str | None = None,
          stop_at: int | None = None, progress: bool = True,
          trace: TraceRequest | None = None, write_config: bool = True) -> dict[str, Any]:
    """Train `config` in RUN_DIR on every rank of the (already launched) job; a summary.

    Resumes from RUN_DIR/checkpoints when a complete checkpoint is there, else starts from
    `init_from` (a plain state dict) or from the seed. `stop_at` ends this process after that
    step (and its checkpoint, if one is due), as an interruption would. `trace`: the step to
    trace (`trace_report.request_trace`). `write_config`: rank 0 holds RUN_DIR for the run
    (`io.run_lock`: another run there is `RunDirInUse` on every rank) and writes its
    config.json (False: `hybridpar run`'s agent holds it and wrote it before starting the
    workers). Returns, on every rank,
    ``{"start": first step run, "losses": [...], "eval": {step: loss}, "sample": text,
    "steps": the last step run, "stopped_by": the signal that stopped it early (or None)}``.
    With ``checkpoint.on_signal``, SIGTERM or SIGINT on any rank ends the run after the step
    in flight, with a checkpoint (`comm.stop_request`).
    """
    run_dir = Path(run_dir)
    nccl_env(run_dir, create=torch.cuda.is_available())   # before the process group exists
    topo = topology_for(config)
    with contextlib.ExitStack() as held:
        if write_config:   # not started by `hybridpar run`, whose agent holds RUN_DIR
            with fail_together(RunDirInUse):
                if topo.rank == 0:
                    held.enter_context(hold_run_dir(run_dir))
                    write_resolved(config, run_dir)
        return _train(config, run_dir, topo, init_from=init_from, stop_at=stop_at,
                      progress=progress, trace=trace)


def _train(config: Config, run_dir: Path, topo: Topology, *, init_from: str | None,
           stop_at: int | None, progress: bool, trace: TraceRequest | None) -> dict[str, Any]:
    """`train` once the run directory is held."""
    run = RunState(config, run_dir, topo)
    cfg = config.train
    resume = resume_step(run_dir / "checkpoints")
    if resume >= 0:
        run.load(run_dir / "checkpoints" / f"step-{resume}")
    elif init_from is not None:
        init_weights_from(run.pipe, config, init_from)
        if has_masters(run.optimizer):   # the masters from the loaded weights
            run.optimizer.copy_from_params()
    start = run.step
    reporter = Reporter(run, start=start, progress=progress)
    autocast = torch.autocast(run.pipe.device.type, dtype=torch.bfloat16,
                              enabled=cfg.precision == "bf16")
    # bf16 weights take autocast to meet float inputs; float32 ones evaluate in float32
    evaluating = autocast if cfg.param_dtype != "fp32" else contextlib.nullcontext()
    losses: list[float] = []
    evals: dict[int, float] = {}
    last = min(cfg.steps, stop_at) if stop_at is not None else cfg.steps
    every = config.checkpoint.every
    quiet = logging_redirect_tqdm() if run.reporter and progress else contextlib.nullcontext()
    stopped: str | None = None   # the signal a rank received: the loop stops, a checkpoint saved
    with quiet, stop_on_signals(config.checkpoint.on_signal) as stop:   # log lines go above
        pending: list[dict[str, Any]] = []   # steps whose loss the host has not read yet
        skipped = 0                          # steps skipped in a row (train.nonfinite = "skip")
        while run.step < last:
            began = time.perf_counter()
            record = train_step(run, autocast, trace)
            elapsed = time.perf_counter() - began
            pending.append(record)
            skipped = check_skipped([record], limit=cfg.max_skipped, before=skipped)
            stopped = stop.agreed() if config.checkpoint.on_signal else None
            evaluate = bool(cfg.eval_every) and run.step % cfg.eval_every == 0 and not stopped
            save = (bool(every) and (run.step % every == 0 or run.step == cfg.steps)) or \
                stopped is not None
            show = run.step % cfg.log_every == 0 or run.step == cfg.steps or evaluate or \
                "skipped" in record or stopped is not None
            if show and run.routing is not None:   # every rank: a collective over pp, dp
                record.update(run.routing.take(run.topo))
            if show or save or run.step == last:   # never a checkpoint of a non-finite step
                resolve(pending, clipped=bool(cfg.grad_clip), first=start + 1)
                losses.extend(r["loss"] for r in pending)
                pending = []
            if evaluate:
                with evaluating:
                    evals[run.step] = record["eval_loss"] = validation_loss(run)
            reporter.step(record, elapsed, log=show)
            if save:
                run.save()
            if stopped is not None:
                if run.reporter:
                    log.warning("%s: stopped after step %d with a checkpoint "
                                "(checkpoint.on_signal = true); run again to resume", stopped,
                                run.step)
                break
        reporter.close()
        with evaluating:
            sample = text_sample(run) if run.step == cfg.steps and start < run.step and \
                stopped is None else None
        if sample is not None and run.reporter:
            (run_dir / "sample.txt").write_text(sample, encoding="utf-8")
            log.info("sample:\n%s", sample)
    run.pipe.close()   # its threads stop before the process group goes
    return {"start": start, "losses": losses, "eval": evals, "sample": sample,
            "steps": run.step, "stopped_by": stopped}
