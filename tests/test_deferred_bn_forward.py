"""Deferred BatchNorm commits after every mini-batch forward in training mode (torchgpipe)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import hybridpar


def model() -> nn.Sequential:
    torch.manual_seed(0)
    # one BatchNorm: after it, micro-batches are normalized by their own statistics (as in
    # torchgpipe), so a later BatchNorm would see other inputs than on one device
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).double()


def data():
    g = torch.Generator().manual_seed(2)
    x1, x2 = (torch.randn(8, 4, generator=g, dtype=torch.float64) for _ in range(2))
    return x1, x2, torch.randint(0, 3, (8,), generator=g)


def one_device():
    net = model()
    x1, x2, y = data()
    net(x1)                                         # a forward in training mode: one update
    after_forward = {k: v.clone() for k, v in net.state_dict().items() if "running" in k}
    F.cross_entropy(net(x2), y).backward()          # then a training step: another
    return after_forward, {k: v.clone() for k, v in net.state_dict().items() if "running" in k}


def worker():
    topo = hybridpar.init(pp=2, timeout=30)
    pipe = hybridpar.HybridPipe(model(), [2, 2], chunks=4, topology=topo,
                                deferred_batch_norm=True, loss_fn=F.cross_entropy)
    x1, x2, y = data()
    pipe(x1)
    full = pipe.consolidated_state_dict()
    after_forward = {k: v for k, v in full.items() if "running" in k}
    pipe.train_step(x2, y)
    full = pipe.consolidated_state_dict()
    return after_forward, {k: v for k, v in full.items() if "running" in k}


def test_a_forward_in_training_mode_commits_its_own_statistics():
    ref_forward, ref_step = one_device()
    for got_forward, got_step in hybridpar.spawn(worker, 2, timeout=60):
        for k, v in ref_forward.items():
            torch.testing.assert_close(got_forward[k], v, atol=1e-12, rtol=0, msg=k)
        for k, v in ref_step.items():
            torch.testing.assert_close(got_step[k], v, atol=1e-12, rtol=0, msg=k)
