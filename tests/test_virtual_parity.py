"""Virtual stages (interleaved 1F1B, ZBV) against the plain single-device model.

Each run trains several configurations one after another in one process group (losses and
every parameter after 3 steps, fp32 1e-5): the checkpoint modes, dp, skips between chunks on
the same rank (handed over) and on others (messages), deferred BatchNorm, uneven batches, tied
embedding/head, the tp GPT. Every run is order-only (all tags 0, as NCCL matches) and its P2P
groups are replayed under NCCL's rules. The runs of every test are cases of one spawn per
world size (1, 2, 4, 8 ranks: the module fixture `runs`); each test asserts on its own.
"""

from __future__ import annotations

import pytest
import torch
from spawn_cases import selected_ids, spawn_by_world
from torch import nn

import hybridpar
from hybridpar.models import example_batch, gpt, gpt_loss
from hybridpar.pipeline.schedules import replay as nccl

from pipe_harness import checked_step, data, make_optimizer, mlp, reference, skipnet
from test_pipe_features import _bn_reference
from test_tied import batches, lm_loss, one_device, tied_lm

VIRTUAL = ["interleaved", "zbv"]
BUILDERS = {"mlp": mlp, "skipnet": skipnet}


def _train(pipe, topo, xs, ys, optimizer="sgd"):
    opt = make_optimizer(optimizer, list(pipe.parameters()) or [nn.Parameter(torch.zeros(1))])
    rows = xs[0].shape[0] // topo.dp
    losses = []
    for x, y in zip(xs, ys):
        x, y = (t[topo.dp_rank * rows:(topo.dp_rank + 1) * rows] for t in (x, y))
        opt.zero_grad()
        losses.append(checked_step(pipe, x, y))
        opt.step()
    return losses


def _worker(layout, cases):
    """Train each case (model, kwargs, balance, options, batch) in turn; losses, state and
    the P2P log of each."""
    pp, tp, dp = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, timeout=60)
    out = []
    for model_name, kwargs, balance, options, batch, optimizer in cases:
        pipe = hybridpar.HybridPipe(BUILDERS[model_name](**kwargs), balance, topology=topo,
                                    loss_fn=nn.functional.cross_entropy, **options)
        pipe.p2p_log = []
        xs, ys = data(3, batch * dp)
        losses = _train(pipe, topo, xs, ys, optimizer)
        log = [[[op.kind, op.peer, op.numel, op.dtype, op.label] for op in group]
               for group in pipe.p2p_log]
        out.append({"losses": losses, "state": pipe.consolidated_state_dict(), "log": log,
                    "stages": pipe.stages})
    return out


def _check(results, refs, tol=1e-5):
    for case, (ref_losses, ref_state) in enumerate(refs):
        for r in results:
            got = r[case]
            assert got["losses"] == pytest.approx(ref_losses, abs=tol), case
            assert list(got["state"]) == list(ref_state)
            for k, v in ref_state.items():
                torch.testing.assert_close(got["state"][k], v, atol=tol, rtol=0,
                                           msg=lambda m, k=k, c=case: f"case {c}, {k}: {m}")
        logs = {rank: [[nccl.P2POp(*op) for op in group] for group in r[case]["log"]]
                for rank, r in enumerate(results)}
        assert nccl.replay(logs, check_labels=True).pairs > 0, case


def _reference(model_name, kwargs, batch, dp=1, optimizer="sgd"):
    xs, ys = data(3, batch * dp)
    return reference(BUILDERS[model_name](**kwargs), xs, ys, optimizer=optimizer)


def _mlp_cases(schedule):
    cases = [("mlp", {}, [1, 1, 1, 1],
              {"chunks": 4, "schedule": schedule, "checkpoint": mode}, 8, "sgd")
             for mode in ("always", "except_last", "never")]
    return cases + [("mlp", {}, [1, 1, 1, 1], {"chunks": 4, "schedule": schedule}, batch, "sgd")
                    for batch in (7, 3)]


def _skip_cases(schedule):
    cases = [("skipnet", {}, balance, {"chunks": 4, "schedule": schedule,
                                       "checkpoint": mode}, 8, "sgd")
             for balance, mode in (([2, 2, 2, 1], "always"), ([1, 1, 1, 4], "never"))]
    batch_norm = ("skipnet", {"batch_norm": True}, [2, 2, 2, 1],
                  {"chunks": 4, "schedule": schedule, "deferred_batch_norm": True}, 8, "sgd")
    return [*cases, batch_norm]


TIED = [("interleaved", (2, 1)), ("zbv", (2, 1)), ("zbv", (2, 2))]
TIED_IDS = [f"{schedule}-pp{pp}tp{tp}" for schedule, (pp, tp) in TIED]


def _case(kind, *args):
    return {"train": _worker, "dropout": _dropout_worker, "tied": _tied_worker,
            "gpt": _gpt_worker}[kind](*args)


@pytest.fixture(scope="module")
def runs(request):
    """The selected tests' runs (tests/tiers.py holds some for the campaign), by name: one
    spawn per world size, the cases in turn."""
    def wanted(test: str) -> set[str]:
        return selected_ids(request, test)

    cases = {}
    for schedule in wanted("test_mlp_over_checkpoint_modes_and_uneven_batches_matches_one_"
                           "device"):
        cases[f"mlp {schedule}"] = (2, ("train", (2, 1, 1), _mlp_cases(schedule)))
    for schedule in wanted("test_pp4_and_dp2_match_one_device"):
        cases[f"pp4 {schedule}"] = (4, ("train", (4, 1, 1), [
            ("mlp", {"layers": 8}, [1] * 8, {"chunks": 8, "schedule": schedule}, 8, "adamw")]))
        cases[f"dp2 {schedule}"] = (4, ("train", (2, 1, 2), [
            ("mlp", {}, [1, 1, 1, 1], {"chunks": 4, "schedule": schedule}, 8, "adamw")]))
    for schedule in wanted("test_skips_between_chunks_and_deferred_batch_norm_match_one_device"):
        cases[f"skips {schedule}"] = (2, ("train", (2, 1, 1), _skip_cases(schedule)))
    for schedule in wanted("test_dropout_masks_under_recompute_are_the_one_device_masks"):
        cases[f"dropout {schedule}"] = (1, ("dropout", schedule))
    for schedule in wanted("test_tp_gpt_pp2_tp2_dp2_matches_one_device"):
        cases[f"gpt {schedule}"] = (8, ("gpt", (2, 2, 2), schedule, [1, 1, 2, 1]))
    tied = wanted("test_tied_embedding_and_head_match_one_device")
    for (schedule, layout), name in zip(TIED, TIED_IDS):
        if name in tied:
            cases[f"tied {schedule} {layout}"] = (layout[0] * layout[1],
                                                  ("tied", layout, schedule, [2, 2, 2, 1]))
    return spawn_by_world(_case, cases, timeout=600)


@pytest.mark.parametrize("schedule", VIRTUAL)
def test_mlp_over_checkpoint_modes_and_uneven_batches_matches_one_device(schedule, runs):
    """pp 2 x v 2: a stage per layer; batch 7 in 4 chunks (2+2+2+1), 3 in 4 (1+1+1)."""
    cases = _mlp_cases(schedule)
    results = runs[f"mlp {schedule}"]
    _check(results, [_reference("mlp", {}, case[4]) for case in cases])
    # looped: rank 0 holds stages 0 and 2; V: rank 0 holds 0 and 3 (and the loss)
    assert results[0][0]["stages"] == ((0, 2) if schedule == "interleaved" else (0, 3))


@pytest.mark.parametrize("schedule", VIRTUAL)
def test_pp4_and_dp2_match_one_device(schedule, runs):
    """pp 4 x v 2 over an 8-layer mlp, and pp 2 x dp 2 (AdamW; dp buckets armed before the
    rank's last backward or W)."""
    _check(runs[f"pp4 {schedule}"], [_reference("mlp", {"layers": 8}, 8, optimizer="adamw")])
    _check(runs[f"dp2 {schedule}"], [_reference("mlp", {}, 8, dp=2, optimizer="adamw")])


@pytest.mark.parametrize("schedule", VIRTUAL)
def test_skips_between_chunks_and_deferred_batch_norm_match_one_device(schedule, runs):
    """skipnet's long skip (layer 0 -> 5) and short one (2 -> 4) over 4 chunks: under the
    looped placement [2, 2, 2, 1] hands `long` over on rank 0 and sends `short` 1 -> 0;
    under the V it sends `long` (rank 0 -> 1) and hands `short` over on rank 1."""
    results = runs[f"skips {schedule}"]
    xs, ys = data(3, 8)
    _check(results, [_reference("skipnet", {}, 8), _reference("skipnet", {}, 8),
                     _bn_reference(skipnet(batch_norm=True), xs, ys, 4)])
    assert results[0][2]["state"]["1.1.num_batches_tracked"].item() == 3


def _dropout_worker(schedule):
    topo = hybridpar.init(pp=1, timeout=60)
    out = []
    for mode in ("always", "never"):
        balance = [1, 1, 1, 1] if schedule == "interleaved" else [2, 2]
        pipe = hybridpar.HybridPipe(mlp(dropout=0.3), balance, chunks=4, topology=topo,
                                    schedule=schedule, checkpoint=mode,
                                    loss_fn=nn.functional.cross_entropy,
                                    virtual_stages=4 if schedule == "interleaved" else None)
        torch.manual_seed(5)
        xs, ys = data(3, 8)
        out.append({"losses": _train(pipe, topo, xs, ys), "state": pipe.state_dict()})
    return out


@pytest.mark.parametrize("schedule", VIRTUAL)
def test_dropout_masks_under_recompute_are_the_one_device_masks(schedule, runs):
    """One rank holding every chunk (pp 1; interleaved v 4, ZBV its V of 2): each
    micro-batch goes through the chunks in order before the next starts, so its dropout
    masks are those of one device running the micro-batches in turn, in the first forward
    and again in the recompute (RNG replay)."""
    results = runs[f"dropout {schedule}"][0]
    model = mlp(dropout=0.3)
    torch.manual_seed(5)
    xs, ys = data(3, 8)
    ref_losses, ref_state = _chunked_reference(model, xs, ys, chunks=4)
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-6)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-6, rtol=0)


def _chunked_reference(model, xs, ys, *, chunks):
    """One device, micro-batch after micro-batch (the pipe's order of dropout draws)."""
    opt = make_optimizer("sgd", model.parameters())
    losses = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        total = torch.zeros(())
        for xc, yc in zip(x.chunk(chunks), y.chunk(chunks)):
            loss = nn.functional.cross_entropy(model(xc), yc) * len(xc) / len(x)
            loss.backward()
            total += loss.detach()
        opt.step()
        losses.append(total.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


# tied embedding / head, and the tp GPT ------------------------------------------------------


def _tied_worker(layout, schedule, balance):
    pp, tp = layout
    topo = hybridpar.init(pp=pp, tp=tp, timeout=60)
    pipe = hybridpar.HybridPipe(tied_lm(), balance, chunks=2, topology=topo, schedule=schedule,
                                loss_fn=lm_loss, tp_plan="auto" if tp > 1 else None)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.02)
    losses = []
    for x, y in zip(*batches(3, 4)):
        opt.zero_grad()
        losses.append(checked_step(pipe, x, y))
        opt.step()
    return {"losses": losses, "state": pipe.consolidated_state_dict(),
            "stages": pipe.stages}


@pytest.mark.parametrize("schedule,layout", TIED, ids=TIED_IDS)
def test_tied_embedding_and_head_match_one_device(schedule, layout, runs):
    """Looped: the embedding (stage 0) on rank 0, the head (stage 3) on rank 1, their
    gradients summed over a group; V: both on rank 0, one Parameter there."""
    ref_losses, _, ref_state = one_device(3, 4)
    results = runs[f"tied {schedule} {layout}"]
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-6)
        for key, value in ref_state.items():
            torch.testing.assert_close(r["state"][key], value, atol=1e-12, rtol=0)
    assert 3 in results[0]["stages"] if schedule == "zbv" else 3 in results[-1]["stages"]


SMALL = {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}


def _gpt_worker(layout, schedule, balance):
    pp, tp, dp = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, timeout=60)
    torch.manual_seed(0)
    pipe = hybridpar.HybridPipe(gpt(**SMALL, tp=tp), balance, chunks=4, topology=topo,
                                schedule=schedule, loss_fn=gpt_loss, checkpoint="always")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.3)
    losses = []
    for step in range(3):
        x, y = example_batch("gpt", 8 * dp, seed=step, **SMALL)
        rows = slice(topo.dp_rank * 8, (topo.dp_rank + 1) * 8)
        opt.zero_grad()
        losses.append(checked_step(pipe, x[rows], y[rows]))
        opt.step()
    return {"losses": losses, "state": pipe.consolidated_state_dict()}


@pytest.mark.parametrize("schedule", VIRTUAL)
def test_tp_gpt_pp2_tp2_dp2_matches_one_device(schedule, runs):
    """The tp GPT (vocab-parallel embedding and loss, sharded blocks) at pp 2 x tp 2 x dp 2
    over 4 chunks, recomputing every micro-batch."""
    torch.manual_seed(0)
    model = gpt(**SMALL, tp=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    ref_losses = []
    for step in range(3):
        x, y = example_batch("gpt", 16, seed=step, **SMALL)
        opt.zero_grad()
        loss = gpt_loss(model(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(loss.item())
    results = runs[f"gpt {schedule}"]
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5)
        for k, v in model.state_dict().items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-5, rtol=0)
