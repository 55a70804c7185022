"""parallel.zero = 1 and 2: optimizer state (and gradients) sharded over dp train as zero = 0
and reshard.

A tiny GPT (4 blocks, n_embd 32) on the embedded corpus, AdamW with weight decay on matrices
(two parameter groups) and clipping, on gloo ranks: every layout's zero = 1 and 2 runs have
the losses of its zero = 0 run and each rank holds about 1 / dp of the optimizer state; a
checkpoint of zero = 1 at dp = 2 resumes at dp = 1, dp = 4 (zero 2), zero = 0 and under
another pp x tp with the losses of the uninterrupted run, and one of zero = 2 at dp = 1.
"""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
import torch
from spawn_cases import selected_ids, spawn_by_world, spawn_cases

import hybridpar
from hybridpar.optim import (
    contiguous_owners,
    optimizer_state_tensors,
    owned_parameters,
    zero_optimizer,
)
from hybridpar.train import Config, ConfigError, load_config
from hybridpar.train.build import build_optimizer
from hybridpar.train.trainer import build_pipe, train

QUICKSTART = Path(__file__).resolve().parent.parent / "configs" / "quickstart.toml"
TIMEOUT = 120
BASE = [
    "model.block_size=16", "model.n_embd=32", "model.n_layer=4", "model.n_head=4",
    "model.dropout=0.0", "data.source=corpus", "parallel.chunks=2", "parallel.timeout=60",
    "train.steps=4", "train.batch_size=8", "train.log_every=1", "train.eval_every=0",
    "train.sample_tokens=0", "train.weight_decay=0.1", "train.grad_clip=0.5",
    "train.lr=3e-3", "checkpoint.every=2", "checkpoint.keep=2",
]


def config(*overrides: str) -> Config:
    return load_config(QUICKSTART, [*BASE, *overrides])


def gpt2(pp: int, dp: int, zero: int, *, every: int = 2, **train: str) -> Config:
    """A tiny Hugging Face GPT-2, whose embedding and head are one tied parameter, over pp
    stages; the rest as BASE (`every`: checkpoint.every, `train`: more [train] options)."""
    return Config.from_dict({
        "name": "gpt2_zero",
        "model": {"name": "hf:gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 4,
                  "n_head": 4, "n_positions": 16},
        "data": {"source": "corpus", "seq_len": 16},
        "parallel": {"pp": pp, "dp": dp, "zero": zero, "chunks": 2, "schedule": "1f1b",
                     "timeout": 60.0},
        "train": {"steps": 4, "batch_size": 8, "log_every": 1, "eval_every": 0,
                  "sample_tokens": 0, "weight_decay": 0.1, "grad_clip": 0.5, "lr": 3e-3,
                  **train},
        "checkpoint": {"every": every, "keep": 2}})


def _layout(pp: int, tp: int, dp: int, zero: int, schedule: str = "1f1b") -> list[str]:
    return [f"parallel.pp={pp}", f"parallel.tp={tp}", f"parallel.dp={dp}",
            f"parallel.zero={zero}", f"parallel.schedule={schedule}"]


def _train(cfg, run_dir):
    summary = train(cfg, run_dir, progress=False)
    return summary["losses"], summary["start"]


def _state_bytes(overrides):
    """One step of the trainer's optimizer; this rank's optimizer state and trainable bytes."""
    cfg = config(*overrides)
    par = cfg.parallel
    topo = hybridpar.init(pp=par.pp, tp=par.tp, dp=par.dp, timeout=60)
    torch.manual_seed(0)
    pipe = build_pipe(cfg, topo)
    optimizer = build_optimizer(pipe, cfg)
    for p in pipe.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    state = sum(t.numel() * t.element_size() for t in optimizer_state_tensors(optimizer)
                if t.dim() > 0)
    params = sum(p.numel() * p.element_size() for p in pipe.parameters())
    owned = sum(p.numel() * p.element_size() for p in pipe.parameters()
                if id(p) in owned_parameters(optimizer))
    pipe.close()
    return {"state": state, "params": params, "owned": owned}


UNSAVED = "checkpoint.every=0"   # runs whose losses alone are checked: no checkpoints
LAYOUTS = {   # name -> (pp, tp, dp)
    "pp2 x dp2": (2, 1, 2),
    "tp2 x dp2": (1, 2, 2),
}


# (layout, zero) compared with zero 0: zero 2 on tp2 here (test_zero_parity: float64)
LOSS_CASES = [(name, 1) for name in (*LAYOUTS, "zbv pp2 x dp2")] + [
    ("tp2 x dp2", 2), ("tied gpt2 pp2 x dp2", 1), ("tied gpt2 pp2 x dp2", 2)]


def _loss_config(name: str, zero: int) -> Config:
    """The config of a LOSS_CASES run (checkpoints off)."""
    if name == "tied gpt2 pp2 x dp2":
        return gpt2(2, 2, zero, every=0)
    if name == "zbv pp2 x dp2":
        return config(*_layout(2, 1, 2, zero, "zbv"), UNSAVED)
    return config(*_layout(*LAYOUTS[name], zero), UNSAVED)


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The selected LOSS_CASES and their zero-0 runs on one set of 4 ranks (tests/tiers.py
    holds some for the campaign); their losses only: no checkpoints."""
    wanted = selected_ids(request, "test_zero_1_and_2_train_with_the_losses_of_zero_0")
    cases = {}
    for name, zero in LOSS_CASES:
        if f"{name}-{zero}" in wanted:
            for z in (0, zero):
                folder = tmp_path_factory.mktemp(f"{name.replace(' ', '')}-zero{z}")
                cases[(name, z)] = (_loss_config(name, z), str(folder))
    return spawn_cases(_train, 4, cases, timeout=TIMEOUT * 3)


@pytest.mark.parametrize("name,zero", LOSS_CASES)
def test_zero_1_and_2_train_with_the_losses_of_zero_0(runs, name, zero):
    plain, sharded = runs[(name, 0)], runs[(name, zero)]
    losses = [r[0] for r in sharded]
    assert all(loss == losses[0] for loss in losses)
    assert len(losses[0]) == 4
    assert losses[0] == pytest.approx(plain[0][0], abs=1e-6, rel=0)


def test_each_dp_rank_holds_its_part_of_the_optimizer_state():
    cases = {"zero0": (_layout(1, 1, 2, 0),), "zero1": (_layout(1, 1, 2, 1),)}
    out = spawn_cases(_state_bytes, 2, cases, timeout=TIMEOUT)
    for rank in range(2):
        whole, part = out["zero0"][rank], out["zero1"][rank]
        assert whole["state"] == 2 * whole["params"]          # AdamW: two moments of each
        assert part["state"] == 2 * part["owned"]             # ... of the parameters it owns
    owned = [r["owned"] for r in out["zero1"]]
    assert sum(owned) == out["zero0"][0]["params"]            # every parameter once
    assert max(owned) < 0.6 * sum(owned)                      # about half each


def test_a_zero_1_checkpoint_resumes_at_another_dp_zero_and_pp_x_tp(tmp_path):
    ref = tmp_path / "ref"
    (ref_losses, _), _ = spawn_cases(_train, 2, {"ref": (config(*_layout(1, 1, 2, 1)),
                                                         str(ref))}, timeout=TIMEOUT)["ref"]
    step2 = str(ref / "checkpoints" / "step-2")
    cases = {"dp1 zero0": (1, _layout(1, 1, 1, 0)), "dp4 zero2": (4, _layout(1, 1, 4, 2)),
             "pp2 x tp2": (4, _layout(2, 2, 1, 0))}
    runs = {}
    for name, (ranks, overrides) in cases.items():
        folder = tmp_path / name.replace(" ", "-")
        shutil.copytree(step2, folder / "checkpoints" / "step-2")
        runs[name] = (ranks, (config(*overrides), str(folder)))
    for name, results in spawn_by_world(_train, runs, timeout=TIMEOUT).items():   # 1, then 4
        losses, start = results[0]
        assert start == 2, name      # the steps done before this run
        assert losses == pytest.approx(ref_losses[2:], abs=1e-5, rel=0), name


def test_a_zero_2_checkpoint_resumes_at_dp_1_and_zero_0(tmp_path):
    ref = tmp_path / "ref"
    (ref_losses, _), _ = spawn_cases(_train, 2, {"ref": (config(*_layout(1, 1, 2, 2)),
                                                         str(ref))}, timeout=TIMEOUT)["ref"]
    folder = tmp_path / "dp1"
    shutil.copytree(ref / "checkpoints" / "step-2", folder / "checkpoints" / "step-2")
    losses, start = hybridpar.spawn(_train, 1, args=(config(*_layout(1, 1, 1, 0)), str(folder)),
                                    timeout=TIMEOUT)[0]
    assert start == 2
    assert losses == pytest.approx(ref_losses[2:], abs=1e-5, rel=0)


def test_zero_levels_and_unshardable_optimizers_are_refused():
    with pytest.raises(ConfigError, match=r"parallel.zero must be one of 0, 1, 2 .* got 3"):
        config("parallel.zero=3")
    with pytest.raises(ConfigError, match=r"parallel\.zero must be >= 0"):
        config("parallel.zero=-1")
    with pytest.raises(ValueError, match="LBFGS cannot be sharded over data parallelism"):
        zero_optimizer([torch.zeros(2, requires_grad=True)], torch.optim.LBFGS, group=None)
    with pytest.raises(TypeError, match=r"optimizer_class must be a torch\.optim\.Optimizer"):
        zero_optimizer([torch.zeros(2, requires_grad=True)], "adamw", group=None)


def _one_replica(overrides):
    import logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("hybridpar.train").addHandler(Keep())
    cfg = config(*overrides)
    topo = hybridpar.init(timeout=60)
    pipe = build_pipe(cfg, topo)
    optimizer = build_optimizer(pipe, cfg)
    pipe.close()
    return type(optimizer).__name__, records


def test_zero_at_dp_1_is_a_warning_and_the_plain_optimizer():
    name, records = hybridpar.spawn(_one_replica, 1, args=(_layout(1, 1, 1, 1),),
                                    timeout=TIMEOUT)[0]
    assert name == "AdamW"
    assert any("parallel.zero = 1 at dp = 1: nothing to shard" in r for r in records)


def _dry_run_ranks(overrides):
    """In a rank (a process of its own, forked ready-imported): `hybridpar check`'s dry run of
    the quick start with `overrides`, each rank's row of its report (its --json)."""
    from hybridpar.train.check import dry_run

    return dry_run(QUICKSTART, overrides=overrides, isolate=False).to_dict()["ranks"]


def test_hybridpar_check_counts_each_ranks_part_of_the_optimizer_state():
    # 2 of the quick start's 4 blocks in 2 micro-batches: a fake step's time goes with its ops
    overrides = ["parallel.dp=2", "parallel.zero=1", "parallel.pp=1", "parallel.tp=1",
                 "model.n_layer=2", "parallel.chunks=2"]
    (ranks,) = hybridpar.spawn(_dry_run_ranks, 1, args=(overrides,), timeout=180)
    by_place: dict[tuple[int, int], list[dict]] = {}
    for r in ranks:
        by_place.setdefault((r["stage"], r["tp"]), []).append(r)
    assert len(ranks) == 2
    for (stage, tp), replicas in by_place.items():
        assert len(replicas) == 2
        params = replicas[0]["params"]
        # AdamW's two moments, each parameter's on one replica: together 2 x the parameters
        assert sum(r["optimizer"] for r in replicas) == 2 * params, (stage, tp)
        assert all(0 < r["optimizer"] < 2 * params for r in replicas)


def test_zero_2_owners_are_contiguous_runs_balanced_by_size():
    # rank 0 first; each rank filled to about its share (here 10 of 30 elements)
    assert contiguous_owners([4, 4, 4, 4, 4, 4, 6], 3) == [0, 0, 0, 1, 1, 1, 2]
    # a pinned tensor stays where it is and counts in its rank's share
    assert contiguous_owners([10, 5, 5, 5, 5], 2, pinned=[1, None, None, None, None]) == \
        [1, 0, 0, 0, 1]
    assert contiguous_owners([1], 4) == [0]


def _owners_along_the_model(overrides):
    cfg = config(*overrides)
    topo = hybridpar.init(pp=1, tp=1, dp=2, timeout=60)
    pipe = build_pipe(cfg, topo)
    optimizer = build_optimizer(pipe, cfg)
    masters = optimizer.masters
    owned = [id(p) in masters for p in pipe.parameters() if p.requires_grad]
    buckets = pipe._dp_buckets.buckets
    pipe.close()
    return owned, buckets


def test_zero_2_buckets_each_cover_one_stretch_of_the_backward():
    # Regression (issue 39): dealt largest first, the owners alternated along the model, so
    # every owner's gradient bucket filled during the whole backward and the staging
    # buffers alive were the whole model's gradients again (dp 4, 25 M parameters: the
    # rank's peak 297 MiB above its baseline, 238 MiB with contiguous owners).
    ranks = hybridpar.spawn(_owners_along_the_model, 2,
                            args=(["parallel.pp=1", "parallel.tp=1", "parallel.dp=2",
                                   "parallel.zero=2"],), timeout=TIMEOUT)
    (owned0, buckets), (owned1, _) = ranks
    assert [not o for o in owned0] == owned1               # each parameter has one owner
    switches = sum(a != b for a, b in itertools.pairwise(owned0))
    assert switches == 1 and owned0[0]                     # rank 0's run, then rank 1's
    # in the reverse order backward makes them: one owner's buckets, then the other's
    firsts = [min(b) for b in buckets]
    assert firsts == sorted(firsts, reverse=True)
