"""parallel.zero = 1 and 2 in float64 against one device: AdamW, clipping, a tie across stages.

The float64 language model of test_tied (its embedding and head are one parameter, on the
first and the last stage) trains 3 AdamW steps with clipping at pp2 x dp2, tp2 x dp2 and
pp2 x tp2 x dp2 (1F1B and ZBV) through `hybridpar.optim.pipe_optimizer`; every run has the
one-device losses, norms and weights. At zero = 2 each rank holds the gradients of the
parameters it owns only (each parameter on one dp rank), and the gradients move as reduces
to their owner, one per bucket and micro-batch.
"""

from __future__ import annotations

import pytest
import torch
from spawn_cases import spawn_by_world

import hybridpar
from hybridpar.optim import owned_parameters, pipe_optimizer
from hybridpar.precision import grad_of

from test_tied import batches, lm_loss, one_device, tied_lm

TIMEOUT = 240
STEPS, BATCH, CLIP = 3, 4, 0.5


def _worker(layout, balance, schedule, zero, tp_plan):
    pp, tp, dp = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, timeout=60)
    pipe = hybridpar.HybridPipe(tied_lm(), balance, chunks=2, topology=topo, schedule=schedule,
                                loss_fn=lm_loss, tp_plan=tp_plan)
    opt = pipe_optimizer(pipe, torch.optim.AdamW, zero=zero, lr=0.02)
    rows = BATCH // dp
    losses, norms, held = [], [], []
    for x, y in zip(*batches(STEPS, BATCH)):
        part = slice(topo.dp_rank * rows, (topo.dp_rank + 1) * rows)
        opt.zero_grad()
        hybridpar.reset_comm_stats()
        losses.append(pipe.train_step(x[part], y[part]).item())
        comm = hybridpar.comm_stats()
        held.append(sorted(id(p) for p in pipe.parameters() if grad_of(p) is not None))
        pipe.check_replicas()
        norms.append(float(pipe.clip_grad_norm_(CLIP)))
        opt.step()
    owned = owned_parameters(opt)
    buckets = pipe._dp_buckets
    sizes = [sum(buckets.params[i].numel() for i in b) for b in buckets.buckets] \
        if zero == 2 else []
    return {"losses": losses, "norms": norms, "state": pipe.consolidated_state_dict(),
            "held_is_owned": all(set(h) == owned for h in held),
            "owned": sum(p.numel() for p in pipe.parameters() if id(p) in owned),
            "elements": sum(p.numel() for p in pipe.parameters()),
            "comm": comm, "rounds": buckets.rounds if zero == 2 else [],
            "bucket_elements": sizes, "dp_rank": topo.dp_rank, "pp_rank": topo.pp_rank,
            "tp_rank": topo.tp_rank}


LAYOUTS = {   # name -> (pp, tp, dp), balance, schedule, tp plan
    "pp2 x dp2": ((2, 1, 2), [3, 4], "1f1b", None),
    "tp2 x dp2": ((1, 2, 2), [7], "1f1b", "auto"),
    "pp2 x tp2 x dp2": ((2, 2, 2), [3, 4], "1f1b", "auto"),
    "zbv pp2 x tp2 x dp2": ((2, 2, 2), [2, 2, 2, 1], "zbv", "auto"),
}
CASES = {f"{name} zero{zero}": (pp * tp * dp, ((pp, tp, dp), balance, schedule, zero, plan))
         for name, ((pp, tp, dp), balance, schedule, plan) in LAYOUTS.items()
         for zero in (1, 2) if zero == 2 or pp * tp * dp == 4}


@pytest.fixture(scope="module")
def runs():
    return spawn_by_world(_worker, CASES, timeout=TIMEOUT)


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_optimizers_train_as_one_device(runs, name):
    ref_losses, ref_norms, ref_state = one_device(STEPS, BATCH, clip=CLIP)
    for r in runs[name]:
        assert r["losses"] == pytest.approx(ref_losses, rel=1e-6)    # reported in fp32
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-6)
        for key, value in ref_state.items():
            torch.testing.assert_close(r["state"][key], value, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", [n for n in CASES if n.endswith("zero2")])
def test_zero_2_keeps_each_gradient_on_its_owner_only(runs, name):
    results = runs[name]
    assert all(r["held_is_owned"] for r in results)
    places: dict[tuple[int, int], list[dict]] = {}
    for r in results:
        places.setdefault((r["pp_rank"], r["tp_rank"]), []).append(r)
    for replicas in places.values():               # the dp ranks of one stage and tp shard
        assert sum(r["owned"] for r in replicas) == replicas[0]["elements"]
        assert max(r["owned"] for r in replicas) < 0.8 * replicas[0]["elements"]
        for r in replicas:
            # every bucket goes out once per micro-batch (2), float64; ZBV's first rank runs
            # the first and the last stage, which both use the tie: its bucket goes out twice
            # as often
            assert sum(r["bucket_elements"]) == r["elements"]
            expected = [2] * len(r["rounds"])
            if "zbv" in name and r["pp_rank"] == 0:
                expected[0] = 4
            assert sorted(r["rounds"]) == sorted(expected)
            assert r["comm"]["reduce"]["bytes"] == 8 * sum(
                k * n for k, n in zip(r["rounds"], r["bucket_elements"], strict=True))


def test_zero_1_moves_gradients_by_all_reduce_not_reduce(runs):
    for r in runs["pp2 x dp2 zero1"]:
        assert "reduce" not in r["comm"] or r["comm"]["reduce"]["calls"] == 0
