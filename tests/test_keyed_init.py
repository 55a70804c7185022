"""Layout-invariant initialization: every module drawn under a seed keyed by its name.

A GPT built on `meta` and materialized by `HybridPipe` (each rank draws only its stages and tp
slices) holds, bit for bit, the slices of ``torch.manual_seed(0); gpt()`` built whole on one
device, in every layout; trained 3 SGD steps, it matches the one-device run as the parity
tests do.
"""

from __future__ import annotations

import pytest
import torch
from spawn_cases import spawn_by_world
from test_pipe_tp import BATCH, SMALL, _batches, _reference
from torch import nn

import hybridpar
from hybridpar.keyed import KeyedInit, keyed_reset_, module_seed
from hybridpar.models import gpt, gpt_loss
from hybridpar.pipeline.parameters.partition import materialize

from pipe_harness import checked_step


def test_a_module_seed_depends_on_the_seed_and_the_name_alone():
    assert module_seed(0, "3.attn.q") == module_seed(0, "3.attn.q")
    assert len({module_seed(0, "3.attn.q"), module_seed(1, "3.attn.q"),
                module_seed(0, "3.attn.k")}) == 3
    assert 0 <= module_seed(2**40, "x") < 2**63


def test_keyed_values_do_not_depend_on_the_other_layers_nor_move_the_random_state():
    torch.manual_seed(0)
    whole = gpt(**SMALL)
    state = torch.get_rng_state()
    with torch.device("meta"):
        part = gpt(**SMALL)
    tail = nn.Sequential()               # a stage holding layers 2, 3, 4 only, original names
    for name in ("2", "3", "4"):
        tail.add_module(name, part.get_submodule(name))
    materialize(tail, "cpu", init_fn=KeyedInit(0))
    for key, value in tail.state_dict().items():
        assert torch.equal(value, whole.state_dict()[key]), key
    assert torch.equal(torch.get_rng_state(), state)   # materializing drew nothing globally


def test_a_tied_parameter_ends_with_its_first_holders_draw():
    emb, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    keyed_reset_(model, 5)
    alone = nn.Embedding(8, 4)
    keyed_reset_(nn.Sequential(alone), 5)          # the same name "0", the same seed
    assert torch.equal(model[0].weight, alone.weight)


# every layout, from a meta build --------------------------------------------------------------

LAYOUTS = {   # name -> ((pp, tp), balance, options)
    "1x1": ((1, 1), [5], {}),
    "pp2": ((2, 1), [2, 3], {"schedule": "1f1b"}),
    "tp2": ((1, 2), [5], {}),
    "pp2 x tp2": ((2, 2), [3, 2], {"schedule": "1f1b"}),
    "interleaved": ((2, 1), [1, 1, 2, 1], {"schedule": "interleaved"}),
}


def _meta_worker(layout, balance, options):
    pp, tp = layout
    topo = hybridpar.init(pp=pp, tp=tp, timeout=60)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = gpt(**SMALL, tp=tp if tp > 1 else None)
    pipe = hybridpar.HybridPipe(model, balance, topology=topo, loss_fn=gpt_loss, chunks=2,
                                **options)        # no init_fn: KeyedInit(torch.initial_seed())
    initial = pipe.consolidated_state_dict()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    losses, norms = [], []
    for x, y in _batches(BATCH):
        opt.zero_grad()
        losses.append(checked_step(pipe, x, y))
        norms.append(pipe.clip_grad_norm_(0.5).item())
        opt.step()
    return {"initial": initial, "losses": losses, "norms": norms,
            "state": pipe.consolidated_state_dict()}


@pytest.fixture(scope="module")
def runs():
    return spawn_by_world(_meta_worker, {
        name: (layout[0] * layout[1], (layout, balance, options))
        for name, (layout, balance, options) in LAYOUTS.items()}, timeout=240)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_meta_build_draws_the_one_device_weights_and_trains_as_one_device(name, runs):
    torch.manual_seed(0)
    whole = gpt(**SMALL).state_dict()
    ref_losses, ref_norms, ref_state = _reference(0.0)
    for r in runs[name]:
        assert list(r["initial"]) == list(whole)
        for k, v in whole.items():
            assert torch.equal(r["initial"][k], v), k          # bit for bit
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5)
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5)
        for k, v in ref_state.items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-5, rtol=0)
