"""The sharded optimizer's update goes out in place and overlaps the next step's forwards.

On 2 dp ranks (gloo) with `pipe_optimizer(..., zero=2)`: the parameters are views of their
message's flat buffer (runs of consecutive parameters of one owner); after `step()` every
message is on the wire, the first layer's forward waits for its own messages only, a
`train_step` leaves none pending, every replica then holds the same weights, and
``state_dict()`` and the replica check wait for the rest themselves.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from spawn_cases import spawn_cases
from torch import nn

import hybridpar
from hybridpar.optim import pipe_optimizer

TIMEOUT = 120


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def _worker(what):
    topo = hybridpar.init(dp=2, timeout=60)
    pipe = hybridpar.HybridPipe(_model(), [5], chunks=2, topology=topo, loss_fn=F.mse_loss)
    opt = pipe_optimizer(pipe, torch.optim.AdamW, zero=2, lr=0.05)
    broadcast = opt.broadcast
    g = torch.Generator().manual_seed(topo.dp_rank)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    out = {"messages": [(owner, [n for n, p in pipe.named_parameters() if any(
        p is q for q in params)]) for owner, _, params in broadcast.messages]}
    out["views"] = all(
        any(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
            for _, flat, params in broadcast.messages if any(p is q for q in params))
        for p in pipe.parameters())
    opt.zero_grad()
    pipe.train_step(x, y)
    opt.step()
    out["after_step"] = broadcast.pending
    if what == "forward":
        pipe[0](torch.randn(1, 8))                   # the first layer waits for its own
        out["after_first_layer"] = broadcast.pending
        opt.zero_grad()
        pipe.train_step(x, y)
        out["after_train_step"] = broadcast.pending
    elif what == "state_dict":
        state = {k: v.clone() for k, v in pipe.state_dict().items()}
        out["after_state_dict"] = broadcast.pending
        out["state"] = state
    else:
        out["worst"] = pipe.check_replicas()
        out["after_check"] = broadcast.pending
    return out


def test_the_update_overlaps_the_next_forwards():
    results = spawn_cases(_worker, 2, {"forward": ("forward",), "state_dict": ("state_dict",),
                                       "check": ("check",)}, timeout=TIMEOUT)
    r0, r1 = results["forward"]
    assert r0["messages"] == r1["messages"]           # one order on every rank
    messages = r0["messages"]
    names = [n for _, params in messages for n in params]
    # runs of consecutive parameters of one owner, in the model's order (both owners send);
    # zero 2's owners hold contiguous runs of the model (`optim.contiguous_owners`), so here
    # one message each: the first layer's owner, then the rest's
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
    assert all(a[0] != b[0] for a, b in itertools.pairwise(messages))
    assert {owner for owner, _ in messages} == {0, 1} and len(messages) >= 2
    assert messages[0][1][:2] == ["0.weight", "0.bias"] and len(messages[0][1]) < len(names)
    assert r0["views"] and r1["views"]
    for r in results["forward"]:
        assert r["after_step"] == len(messages)      # all on the wire after step()
        first = sum(1 for _, params in messages if any(n.startswith("0.") for n in params))
        assert r["after_first_layer"] == len(messages) - first
        assert r["after_train_step"] == 0
    a, b = results["state_dict"]
    assert a["after_state_dict"] == b["after_state_dict"] == 0
    for key in a["state"]:
        assert torch.equal(a["state"][key], b["state"][key]), key
    for r in results["check"]:
        assert r["worst"] == 0.0 and r["after_check"] == 0
