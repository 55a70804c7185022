"""HybridPipe with tensor-parallel stages: a GPT built from hybridpar.nn layers against the
plain single-device GPT, over (pp, tp, dp) layouts, schedules and checkpoint modes.

SGD, not AdamW: Adam turns a 1e-9 rounding difference in a near-zero gradient into a step of
the size of the learning rate, so it compares rounding noise, not the pipeline.

Every run is a case of one spawn per world size (the `runs` module fixture: 2, 4 and 8
ranks; a case calls `hybridpar.init` with its own layout and seeds its own model); each test
asserts on its own case."""

import pytest
import torch
from spawn_cases import layout_id, selected_ids, spawn_by_world

import hybridpar
from hybridpar.models import example_batch, gpt, gpt_loss

from pipe_harness import checked_step

SMALL = {"vocab_size": 32, "block_size": 8, "n_layer": 2, "n_head": 4, "n_embd": 16}
STEPS, BATCH = 3, 4


def _batches(rows):
    return [example_batch("gpt", rows, seed=step, **SMALL) for step in range(STEPS)]


def _reference(dropout, dtype=torch.float32):
    torch.manual_seed(0)
    model = gpt(**SMALL, dropout=dropout).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, norms = [], []
    for x, y in _batches(BATCH):
        opt.zero_grad()
        loss = gpt_loss(model(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5).item())
        opt.step()
        losses.append(loss.item())
    return losses, norms, model.state_dict()


def _gpt_worker(layout, balance, options, dropout):
    pp, tp, dp = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, timeout=60)
    torch.manual_seed(0)
    model = gpt(**SMALL, dropout=dropout, tp=tp)
    pipe = hybridpar.HybridPipe(model, balance, topology=topo, loss_fn=gpt_loss, **options)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    losses, norms = [], []
    rows = BATCH // dp
    for x, y in _batches(BATCH):
        x, y = x[topo.dp_rank * rows:(topo.dp_rank + 1) * rows], \
            y[topo.dp_rank * rows:(topo.dp_rank + 1) * rows]
        opt.zero_grad()
        losses.append(checked_step(pipe, x, y))
        norms.append(pipe.clip_grad_norm_(0.5).item())
        opt.step()
    return {"losses": losses, "norms": norms, "state": pipe.consolidated_state_dict()}


LAYOUTS = [
    ((1, 2, 1), [5], {"chunks": 2, "schedule": "gpipe", "checkpoint": "except_last"}),
    ((2, 2, 1), [2, 3], {"chunks": 2, "schedule": "gpipe", "checkpoint": "always"}),
    ((2, 2, 1), [3, 2], {"chunks": 4, "schedule": "1f1b", "checkpoint": "never"}),
    ((2, 2, 2), [2, 3], {"chunks": 2, "schedule": "1f1b", "checkpoint": "except_last"}),
    # zero bubble: the column / row layers' weight gradients wait for W
    ((2, 2, 1), [3, 2], {"chunks": 4, "schedule": "zb-h1", "checkpoint": "never"}),
    ((2, 2, 2), [2, 3], {"chunks": 2, "schedule": "zb-h1", "checkpoint": "except_last"}),
    ((4, 1, 1), [2, 1, 1, 1], {"chunks": 4, "schedule": "zb-h1", "checkpoint": "always"}),
]
DROPOUT = [
    {"chunks": 1},
    {"chunks": 1, "schedule": "zb-h1", "checkpoint": "always"},   # recomputed in I, W apart
]
LOADS = [((2, 2, 1), [3, 2]), ((1, 4, 1), [5])]
IDS = [layout_id(layout, options) for layout, _, options in LAYOUTS]


def _case(what, *args):
    return _load_worker(*args) if what == "load" else _gpt_worker(*args)


@pytest.fixture(scope="module")
def runs(request):
    """Each test's run by name: "train <layout> <balance> <options>", "dropout <options>",
    "load <layout> <balance>"."""
    _, _, trained = _reference(0.0)
    cases = {}   # name -> (world size, _case's arguments)
    wanted = selected_ids(request, "test_tensor_parallel_gpt_pipeline_matches_one_device")
    for (layout, balance, options), name in zip(LAYOUTS, IDS):
        if name not in wanted:   # the campaign's (tests/tiers.py)
            continue
        cases[f"train {layout} {balance} {options}"] = (
            layout[0] * layout[1] * layout[2], ("train", layout, balance, options, 0.0))
    for options in DROPOUT:
        cases[f"dropout {options}"] = (2, ("train", (1, 2, 1), [5], options, 0.2))
    for layout, balance in LOADS:
        cases[f"load {layout} {balance}"] = (layout[0] * layout[1] * layout[2],
                                             ("load", layout, balance, trained))
    return spawn_by_world(_case, cases, timeout=240)


def assert_like_one_device(results, dropout=0.0, dtype=torch.float32):
    """Every rank's losses, state (and without dropout its clip norms) as `_reference`'s:
    to 1e-5 in float32; in float64 the state to 1e-9, the losses and norms to float32's
    precision (`train_step` and `clip_grad_norm_` return them in float32)."""
    ref_losses, ref_norms, ref_state = _reference(dropout, dtype)
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    for r in results:
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5)
        if dropout == 0.0:
            assert r["norms"] == pytest.approx(ref_norms, rel=1e-5 if tol > 1e-9 else 1e-7)
        assert list(r["state"]) == list(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=tol, rtol=0)


@pytest.mark.parametrize("layout,balance,options", LAYOUTS, ids=IDS)
def test_tensor_parallel_gpt_pipeline_matches_one_device(layout, balance, options, runs):
    assert_like_one_device(runs[f"train {layout} {balance} {options}"])


@pytest.mark.parametrize("options", DROPOUT)
def test_tensor_parallel_dropout_masks_equal_the_single_device_ones(options, runs):
    # one stage, one micro-batch: the RNG streams line up with the plain model's exactly
    assert_like_one_device(runs[f"dropout {options}"], 0.2)


def _load_worker(layout, balance, state):
    pp, tp, dp = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, timeout=60)
    torch.manual_seed(123)  # other weights: everything must come from the loaded state
    pipe = hybridpar.HybridPipe(gpt(**SMALL, tp=tp), balance, topology=topo, chunks=2)
    pipe.load_consolidated_state_dict(state)
    x, _ = _batches(BATCH)[0]
    return {"state": pipe.consolidated_state_dict(), "out": pipe(x)}


@pytest.mark.parametrize("layout,balance", LOADS)
def test_a_consolidated_state_dict_loads_into_any_layout(layout, balance, runs):
    _, _, trained = _reference(0.0)
    torch.manual_seed(0)
    plain = gpt(**SMALL)
    plain.load_state_dict(trained)
    x, _ = _batches(BATCH)[0]
    expected = plain(x)
    for r in runs[f"load {layout} {balance}"]:
        for k, v in trained.items():
            assert torch.equal(r["state"][k], v), k
        torch.testing.assert_close(r["out"], expected, atol=1e-5, rtol=0)
