"""Expert parallelism: the MoE GPT with its experts split over ep ranks, against one device.

ep is carved out of dp: an ep group of P dp replicas holds every expert once (E / P each) and
sends each token's copies to the rank of its expert and back by all-to-all. Every layout
must train as one device with gradient accumulation over the same micro-batches (every
parameter to 1e-9 in float64 after 3 AdamW steps, the clipped norm too), the replica check
must pass (dense parameters equal over dp, each expert equal over the dp ranks holding it),
and each rank must hold exactly E / ep experts of every MoE layer.
"""

from __future__ import annotations

import pytest
import torch
from spawn_cases import selected_ids, spawn_by_world
from test_moe_gpt import BATCH, MOE, _batches, _rows

import hybridpar
from hybridpar.models import gpt, gpt_loss
from hybridpar.moe import Experts

from pipe_harness import checked_step

CLIP = 0.5


def _reference(micro: int):
    torch.manual_seed(0)
    model = gpt(**MOE).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    norms = []
    for x, y in _batches(False):
        opt.zero_grad()
        rows = BATCH // micro
        for i in range(micro):
            (gpt_loss(model(_rows(x, i * rows, (i + 1) * rows)), y[i * rows:(i + 1) * rows])
             / micro).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return model.state_dict(), norms


def _worker(layout, ep, balance, options):
    pp, tp, dp = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, ep=ep, timeout=60)
    torch.manual_seed(0)
    model = gpt(**MOE, ep=ep, **({"tp": tp} if tp > 1 else {})).double()
    held = [(m.first, m.local) for m in model.modules() if isinstance(m, Experts)]
    pipe = hybridpar.HybridPipe(model, balance, topology=topo, loss_fn=gpt_loss, **options)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    rows, norms = BATCH // dp, []
    for x, y in _batches(False):
        opt.zero_grad()
        checked_step(pipe, _rows(x, topo.dp_rank * rows, (topo.dp_rank + 1) * rows),
                     y[topo.dp_rank * rows:(topo.dp_rank + 1) * rows])
        norms.append(float(pipe.clip_grad_norm_(CLIP)))
        opt.step()
    return {"state": pipe.consolidated_state_dict(), "norms": norms, "held": held,
            "ep_rank": topo.ep_rank}


# (pp, tp, dp), ep, balance over the 7 layers, options
LAYOUTS = [
    ((1, 1, 2), 2, [7], {"chunks": 2, "schedule": "gpipe", "checkpoint": "never"}),
    ((1, 1, 4), 2, [7], {"chunks": 1, "schedule": "gpipe", "checkpoint": "never"}),
    ((1, 1, 4), 4, [7], {"chunks": 2, "schedule": "gpipe", "checkpoint": "always"}),
    ((2, 1, 2), 2, [3, 4], {"chunks": 2, "schedule": "1f1b", "checkpoint": "except_last"}),
    ((2, 1, 2), 2, [2, 2, 2, 1], {"chunks": 4, "schedule": "zbv", "checkpoint": "never"}),
    ((1, 2, 2), 2, [7], {"chunks": 2, "schedule": "gpipe", "checkpoint": "never"}),
]
IDS = [f"pp{pp}tp{tp}dp{dp}ep{ep}-{o['schedule']}-{o['checkpoint']}"
       for (pp, tp, dp), ep, _, o in LAYOUTS]


@pytest.fixture(scope="module")
def runs(request):
    wanted = selected_ids(request, "test_expert_parallel_moe_gpt_equals_one_device")
    cases = {name: (layout[0] * layout[1] * layout[2], (layout, ep, balance, options))
             for (layout, ep, balance, options), name in zip(LAYOUTS, IDS) if name in wanted}
    return spawn_by_world(_worker, cases, timeout=240)


@pytest.mark.parametrize("layout,ep,balance,options", LAYOUTS, ids=IDS)
def test_expert_parallel_moe_gpt_equals_one_device(layout, ep, balance, options, runs, request):
    results = runs[request.node.callspec.id]
    reference, norms = _reference(options["chunks"] * layout[2])
    local = MOE["n_experts"] // ep
    for r in results:
        assert r["held"] == [(r["ep_rank"] * local, local)] * MOE["n_layer"]
        assert r["norms"] == pytest.approx(norms, rel=1e-6)    # returned in float32
        assert list(r["state"]) == list(reference)
        for k, v in reference.items():
            torch.testing.assert_close(r["state"][k], v, atol=1e-9, rtol=0,
                                       msg=lambda m, k=k: f"{k}: {m}")
