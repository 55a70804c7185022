"""Benchmark 6: the quick-start GPT at pp = 2 x tp = 2, tokens/s against torch's own stack.

The model, batch and layout of configs/quickstart.toml (4 blocks, 64 wide, vocabulary 256,
16 sequences of 64 tokens, 4 micro-batches, balance [3, 4]) on 4 ranks, one thread each, one
training step = the schedule (forward, loss, backward) and an AdamW step. Compared, step by
step in turn, in the same process groups:

    hybridpar  HybridPipe(gpt(tp=2), [3, 4], chunks=4, schedule=gpipe | 1f1b): ParallelLinear
               column / row layers, vocab-parallel embedding and cross-entropy, scatter-gather
               P2P, fused q/k/v input copy
    peer       the same layers as nn.Linear / nn.Embedding, parallelize_module on the tp mesh
               (q, k, v, mlp.fc: ColwiseParallel; attn.proj, mlp.proj: RowwiseParallel;
               token embedding: RowwiseParallel; head: ColwiseParallel, the loss under
               loss_parallel), staged by torch.distributed.pipelining PipelineStage +
               ScheduleGPipe / Schedule1F1B over the pp group

Neither recomputes (checkpoint="never"); both start from the same weights (equal first losses).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hybridpar
from hybridpar.models import example_batch, gpt, gpt_loss
from hybridpar.models.gpt_layers import Block, Embeddings, Head
from hybridpar.tensor_parallel.layers import ParallelEmbedding, ParallelLinear

from .comm import QUICKSTART
from .common import fmt, load, markdown_table, timed_round_robin

__all__ = ["NAME", "TITLE", "plain_layers", "run"]

NAME = "gpt"
TITLE = "6. Quick-start GPT at pp = 2 × tp = 2 (tokens/s)"

SETTINGS = {
    "full": {"model": QUICKSTART, "batch": 16, "chunks": 4, "balance": [3, 4], "warmup": 3,
             "iters": 5, "repeats": 3},
    "quick": {"model": QUICKSTART, "batch": 16, "chunks": 4, "balance": [3, 4], "warmup": 2,
              "iters": 3, "repeats": 3},
    "smoke": {"model": {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 2,
                        "n_embd": 16}, "batch": 4, "chunks": 2, "balance": [2, 3],
              "warmup": 1, "iters": 1, "repeats": 1},
}
SCHEDULES = ("gpipe", "1f1b")


def plain_layers(module: nn.Module) -> nn.Module:
    """Replace the one-device ParallelLinear / ParallelEmbedding by nn.Linear / nn.Embedding
    holding the same values (what DTensor's parallel styles accept)."""
    for name, child in module.named_children():
        if isinstance(child, ParallelLinear):
            new: nn.Module = nn.Linear(child.in_features, child.out_features,
                                       child.bias is not None)
            with torch.no_grad():
                new.weight.copy_(child.weight)
                if child.bias is not None:
                    new.bias.copy_(child.bias)
        elif isinstance(child, ParallelEmbedding):
            new = nn.Embedding(child.num_embeddings, child.embedding_dim)
            with torch.no_grad():
                new.weight.copy_(child.weight)
        else:
            new = plain_layers(child)
        setattr(module, name, new)
    return module


def _peer(cfg: dict[str, Any], topo: Any, schedule: str) -> tuple[Any, Any, nn.Module]:
    """torch.distributed.pipelining + DTensor TP on this rank's stage: (step fn, losses, stage)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    s, tp = topo.pp_rank, topo.tp
    tp_mesh = topo.mesh["tp"]
    torch.manual_seed(0)
    full = plain_layers(gpt(**cfg["model"]))
    start = sum(cfg["balance"][:s])
    module = nn.Sequential(*list(full)[start:start + cfg["balance"][s]])
    plan: dict[str, Any] = {}
    for i, layer in enumerate(module):
        if isinstance(layer, Embeddings):
            plan[f"{i}.tok"] = RowwiseParallel(input_layouts=Replicate())   # vocab parallel
        elif isinstance(layer, Block):
            for name in ("attn.q", "attn.k", "attn.v", "mlp.fc"):
                plan[f"{i}.{name}"] = ColwiseParallel()
            for name in ("attn.proj", "mlp.proj"):
                plan[f"{i}.{name}"] = RowwiseParallel()
            layer.attn.heads //= tp                                  # each rank: H / tp heads
        elif isinstance(layer, Head):
            plan[f"{i}.proj"] = ColwiseParallel()                    # local (B, T, V / tp)
    parallelize_module(module, tp_mesh, plan)

    def loss_fn(logits: Tensor, target: Tensor) -> Tensor:
        logits = DTensor.from_local(logits, tp_mesh, [Shard(2)], run_check=False)
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())   # no logit gather

    stage = PipelineStage(module, s, topo.pp, torch.device("cpu"), group=topo.pp_group)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = cls(stage, n_microbatches=cfg["chunks"], loss_fn=loss_fn)
    last = s == topo.pp - 1
    losses: list[Tensor] = []

    def step(x: Tensor, y: Tensor) -> None:
        losses.clear()
        with loss_parallel():
            if s == 0:
                sched.step(x)
            elif last:
                sched.step(target=y, losses=losses)
            else:
                sched.step()
    return step, losses, module


def _first_loss(losses: list[Tensor]) -> float:
    values = [t.full_tensor() if hasattr(t, "full_tensor") else t for t in losses]
    return float(torch.stack([v.detach().reshape(()) for v in values]).mean())


def _worker(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    topo = hybridpar.init(pp=2, tp=2, timeout=300)
    x, y = example_batch("gpt", cfg["batch"], **cfg["model"])
    steps: dict[str, Any] = {}
    first: dict[str, float] = {}
    for schedule in SCHEDULES:
        torch.manual_seed(0)
        pipe = hybridpar.HybridPipe(gpt(**cfg["model"], tp=2), cfg["balance"],
                                    chunks=cfg["chunks"], topology=topo, schedule=schedule,
                                    checkpoint="never", loss_fn=gpt_loss)
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)

        def ours(pipe: Any = pipe, opt: Any = opt) -> float:
            opt.zero_grad()
            loss = pipe.train_step(x, y)
            opt.step()
            return float(loss)

        first[f"hybridpar {schedule}"] = ours()
        steps[f"hybridpar {schedule}"] = ours
        peer_step, losses, module = _peer(cfg, topo, schedule)
        popt = torch.optim.AdamW(module.parameters(), lr=1e-3, foreach=False)

        def theirs(step: Any = peer_step, popt: Any = popt) -> None:
            popt.zero_grad()
            step(x, y)
            popt.step()

        theirs()
        if topo.pp_rank == topo.pp - 1:
            first[f"peer {schedule}"] = _first_loss(losses)
        steps[f"peer {schedule}"] = theirs
    times = timed_round_robin(steps, warmup=cfg["warmup"], iters=cfg["iters"],
                              repeats=cfg["repeats"])
    tokens = cfg["batch"] * cfg["model"]["block_size"]
    rows = []
    for schedule in SCHEDULES:
        ours_t, peer_t = times[f"hybridpar {schedule}"], times[f"peer {schedule}"]
        rows.append({"schedule": schedule, "tokens": tokens, "hybridpar_s": ours_t,
                     "peer_s": peer_t,
                     "hybridpar_tokens_per_s": tokens / ours_t["median"],
                     "peer_tokens_per_s": tokens / peer_t["median"],
                     "speedup": peer_t["median"] / ours_t["median"],
                     "first_loss": first[f"hybridpar {schedule}"],
                     "peer_first_loss": first.get(f"peer {schedule}")})
    return rows if topo.pp_rank == topo.pp - 1 and topo.tp_rank == 0 else []


def table(rows: list[dict[str, Any]]) -> str:
    body = [[r["schedule"], fmt(r["hybridpar_s"], 1e3), fmt(r["peer_s"], 1e3),
             f"{r['hybridpar_tokens_per_s']:.0f}", f"{r['peer_tokens_per_s']:.0f}",
             f"{r['speedup']:.2f}"] for r in rows]
    return markdown_table(["schedule", "hybridpar ms", "peer ms", "hybridpar tokens/s",
                           "peer tokens/s", "hybridpar speed-up"], body)


def run(mode: str = "full") -> dict[str, Any]:
    cfg = SETTINGS[mode]
    loads = [load()]
    per_rank = hybridpar.spawn(_worker, 4, args=(cfg,), timeout=900)
    loads.append(load())
    rows = next(r for r in per_rank if r)
    diff = max(abs(r["first_loss"] - r["peer_first_loss"]) for r in rows)
    model = cfg["model"]
    notes = [f"GPT {model['n_layer']} blocks, h={model['n_embd']}, V={model['vocab_size']}, "
             f"{cfg['batch']} × {model['block_size']} tokens per step, m={cfg['chunks']}, "
             f"balance {cfg['balance']}, AdamW, checkpoint 'never'; first losses equal to "
             f"{diff:.1e} (hybridpar {rows[0]['first_loss']:.4f}).",
             "peer: torch.distributed.pipelining + DTensor (parallelize_module, loss_parallel)."]
    with contextlib.suppress(ZeroDivisionError):
        worst = min(r["speedup"] for r in rows)
        notes.append(f"hybridpar is {worst:.2f}× the peer's speed or better.")
    return {"name": NAME, "title": TITLE, "config": cfg, "rows": rows, "table": table(rows),
            "notes": notes, "load_average_1m": loads,
            "columns": "ms: median training step (± half the range of the repeats)"}
