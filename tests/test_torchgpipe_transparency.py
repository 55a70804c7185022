"""torchgpipe's transparency test (tests/test_transparency.py of kakaobrain/torchgpipe v0.0.7,
BSD-3-Clause, Copyright 2019-2020 Kakao Brain), on `HybridPipe` across processes.

Adapted: `GPipe(model, [2, 2], devices=['cpu', 'cpu'], chunks=4)` -> `HybridPipe(model, [2, 2],
chunks=4, topology=hybridpar.init(pp=2))` in two spawned ranks, `model(x).mean().backward()`
-> `pipe.train_step(x, y)` with the mean loss; torchgpipe compares the sum of all gradients
after one step, here every gradient, the loss and the weights over three SGD steps.
"""

from __future__ import annotations

import torch
from torch import nn

import hybridpar

STEPS = 3


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(1, 2),
        nn.Linear(2, 4),
        nn.Linear(4, 2),
        nn.Linear(2, 1),
    )


def _inputs(step):
    return torch.rand(8, 1, generator=torch.Generator().manual_seed(step))


def _mean(output, target):
    return output.mean()


def _worker():
    topo = hybridpar.init(pp=2, timeout=30)
    pipe = hybridpar.HybridPipe(_model(), [2, 2], chunks=4, topology=topo, loss_fn=_mean)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    steps = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = pipe.train_step(_inputs(step), torch.zeros(8))
        steps.append([loss, {k: p.grad.clone() for k, p in pipe.named_parameters()}])
        opt.step()
    return steps


def test_simple_linears():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    results = hybridpar.spawn(_worker, 2, timeout=60)
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(_inputs(step)).mean()
        loss.backward()
        got = {**results[0][step][1], **results[1][step][1]}
        assert set(got) == {k for k, _ in model.named_parameters()}
        for r in results:
            assert torch.allclose(r[step][0], loss, atol=1e-6), step
        for k, p in model.named_parameters():
            assert torch.allclose(got[k], p.grad, atol=1e-6), (step, k)
        opt.step()
