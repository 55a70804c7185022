"""The steps of a run: one optimizer step (lr, batch, forward and backward, clip, update) and
the host reads of its loss and gradient norm; the validation loss; the end-of-run text
sample."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

from hybridpar.data.shards import open_tokens
from hybridpar.data.windows import PaddedExamples, TokenWindows
from hybridpar.device import pinned
from hybridpar.models import generate
from hybridpar.models.registry import takes_tokens
from hybridpar.pipeline.parameters.replicas import ReplicaMismatchError
from hybridpar.pipeline.tracing.trace_report import TraceRequest, traced_step
from hybridpar.trace import comm_stats, reset_comm_stats
from hybridpar.train.data import TokenBatches, decode, make_batches, validation_problem
from hybridpar.train.lr import lr_at
from hybridpar.train.state import RunState

__all__ = ["chat_prompt", "check_skipped", "resolve", "text_sample", "train_step",
           "validation_loss"]

log = logging.getLogger(__name__)


def _check_replicas(run: RunState, step: int) -> float:
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


def train_step(run: RunState, autocast: Any, trace: TraceRequest | None) -> dict[str, Any]:
    """One optimizer step: lr, batch, forward and backward, clip, update; its record.

    The record's ``"loss"`` and ``"grad_norm"`` stay device tensors: the host reads them in
    `resolve`, every ``train.log_every`` steps, so a step does not wait for its GPU work
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
    if run.routing is not None:
        run.routing.reset()
    run.optimizer.zero_grad(set_to_none=True)
    reset_comm_stats()
    with traced_step(run.pipe, trace, step=step, last=cfg.steps), autocast, run.counting(y):
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
    if run.expert_bias is not None:   # the step's loads: its update, or dropped with it
        run.expert_bias.step(apply=problem is None)
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


def resolve(records: list[dict[str, Any]], *, clipped: bool, first: int) -> None:
    """Read the steps' losses and gradient norms in one host read (what waits for the GPU),
    as floats in place; a non-finite one stops the run (``train.nonfinite = "stop"``) with
    `FloatingPointError` naming its step. Without clipping the norm leaves the record.
    `first`: the first step this process ran (before it, no update of its own had run)."""
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
        if problem is not None and r["step"] == first:
            raise FloatingPointError(
                f"{problem} at step {r['step']}, the first step of this run, before any update: "
                "the learning rate is not the cause. The weights it started from or the batch "
                "hold a NaN / inf (check the checkpoint or --init-from file, and the data), or "
                "the model's forward overflows (use precision = 'fp32')")
        if problem is not None:
            raise FloatingPointError(
                f"{problem} at step {r['step']}; lower train.lr, set train.grad_clip, or use "
                "precision = 'fp32' (or set train.nonfinite = 'skip' to drop such steps' "
                "updates and go on). The losses are read every train.log_every steps: the "
                "updates after that step ran, but no checkpoint holds them")


def check_skipped(records: list[dict[str, Any]], *, limit: int, before: int) -> int:
    """The skipped steps in a row at the end of `records` (`before`: the run of them the
    previous call ended with); `FloatingPointError` once `limit` (``train.max_skipped``,
    0: none) are skipped in a row: a run whose every step is skipped learns nothing."""
    run = before
    for r in records:
        run = run + 1 if r.get("skipped") else 0
        if limit and run >= limit:
            raise FloatingPointError(
                f"{run} steps in a row were skipped (train.nonfinite = 'skip', steps "
                f"{r['step'] - run + 1}-{r['step']}; train.max_skipped = {limit}): the loss or "
                "the gradients are not finite at every step, so the run stopped. Check the "
                "weights it started from and the data, lower train.lr, or raise "
                "train.max_skipped (0: no limit)")
    return run


def validation_loss(run: RunState) -> float:
    """Mean loss over the first `eval_batches` validation batches (the same ones every time);
    with a loss mask, the mean of each batch's token mean."""
    cfg, topo = run.config, run.topo
    batches = make_batches(cfg, split="val", dp_rank=topo.dp_rank, dp=topo.dp, **run.reads)
    run.pipe.eval()
    total = 0.0
    for _ in range(cfg.train.eval_batches):
        x, y = batches.next_batch()
        with run.counting(y):
            total += float(run.pipe.eval_step(x, y))
    run.pipe.train()
    return total / cfg.train.eval_batches


def chat_prompt(val: TokenWindows | PaddedExamples) -> tuple[Any, tuple[int, ...]]:
    """(ids, stop ids) of the sample of a folder of conversations: the first validation
    conversation up to its first counted token (the template's generation prompt), and the
    EOS and the template's end-of-turn token. The same on every rank: meta.json and one
    document's ids (every rank reads them: the prompt feeds the first stage, the stop ids
    every rank's loop)."""
    folder = open_tokens(val.folder.path)
    shard = folder.splits["val"][0] if folder.splits["val"] else folder.splits["train"][0]
    assert shard.mask is not None
    end = int(shard.ends[0])
    counted = shard.mask[:end].nonzero()[0]
    ids = shard.tokens[:int(counted[0]) if len(counted) else end].astype("int64")
    stop = {folder.eos_id}
    eot = folder.meta["chat"].get("special", {}).get("eos_token")   # the template's
    eot_id = folder.encoder.token_id(eot) if isinstance(eot, str) else None
    if eot_id is not None:
        stop.add(eot_id)
    return ids, tuple(sorted(stop))


def text_sample(run: RunState) -> str | None:
    """A text sample through the pipeline, from the start of the validation text (for a
    folder of conversations: the first one's prompt, up to an end of turn, `chat_prompt`);
    None (with a warning) when there is no validation text to start from."""
    cfg = run.config
    if not takes_tokens(cfg.model.name) or cfg.train.sample_tokens == 0 \
            or cfg.data.source == "synthetic":
        return None
    problem = validation_problem(cfg)   # (the same answer on every rank: the config's data)
    if problem is not None:
        if run.reporter:
            log.warning("no sample at the end of the run: %s (or set train.sample_tokens = 0)",
                        problem)
        return None
    val = make_batches(cfg, split="val", **run.reads)
    stop: tuple[int, ...] = ()
    if isinstance(val, (TokenWindows, PaddedExamples)) and val.folder.masked:
        ids, stop = chat_prompt(val)                                      # a conversation's
        prompt = torch.from_numpy(ids).view(1, -1)                        # (1, t)
    elif isinstance(val, PaddedExamples):   # a document's start, up to its end
        prompt = torch.from_numpy(val.document(0)[0][:8]).view(1, -1)     # (1, <= 8)
        stop = (val.folder.eos_id,)
    elif isinstance(val, TokenWindows):   # the prompt matters on the first stage only
        prompt = torch.from_numpy(val.window(0)[:8].astype("int64")).view(1, -1) \
            if val.reads else torch.zeros(1, 8, dtype=torch.int64)        # (1, 8)
    else:
        assert isinstance(val, TokenBatches)
        prompt = val.tokens[:8].view(1, -1)                                # (1, 8)
    run.pipe.eval()
    with torch.no_grad():
        out = generate(run.pipe, prompt, cfg.train.sample_tokens, temperature=0.8, top_k=32,
                       generator=torch.Generator().manual_seed(cfg.train.seed),
                       block_size=cfg.data.seq_len, stop=stop)            # (1, t + n)
    run.pipe.train()
    if isinstance(val, (TokenWindows, PaddedExamples)):   # the folder's own tokenizer
        return val.folder.decode(out[0].numpy()) if val.reads else None
    return decode(out[0])
