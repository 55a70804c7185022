"""torchgpipe's regression tests (tests/test_bugs.py of kakaobrain/torchgpipe v0.0.7,
BSD-3-Clause, Copyright 2019-2020 Kakao Brain), on `HybridPipe` across processes.

Adapted: `GPipe(model, balance, devices=..., chunks=...)` -> `HybridPipe(model, balance,
chunks=..., topology=hybridpar.init(pp=len(balance)))` in spawned ranks; `y = model(x);
y.norm().backward()` -> `pipe.train_step(x, y)` with the norm as the loss (the last stage
keeps each micro-batch's output to compare); `test_tuple_wait` (CUDA streams in torchgpipe)
runs on CPU without the CUDA sleep, its gradients compared with the plain model's.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input):
        return input

    @staticmethod
    def backward(ctx, grad):
        return grad


class M(nn.Module):
    def forward(self, input):
        return Identity.apply(input)


class Layer1(nn.Module):
    def forward(self, pair):
        a, b = pair
        return a*1, b*2, b*3


class Layer2(nn.Module):
    def forward(self, triple):
        a, b, c = triple
        return a+b+c


class Dropouts(nn.Module):
    def forward(self, x):
        for _ in range(100):
            x = F.dropout(x, p=0.001)
        return x


def _norm(output, target):
    return output.norm()


def _worker():
    topo = hybridpar.init(pp=2, timeout=30)
    r = {}
    # a Python autograd function returning its input, checkpointed
    pipe = hybridpar.HybridPipe(nn.Sequential(M(), M()), [1, 1], checkpoint="always",
                                topology=topo, loss_fn=_norm)
    x = torch.rand(42, requires_grad=True)
    r["autograd_function"] = [x, pipe(x), pipe.train_step(x, torch.zeros(42)), x.grad]

    # a tuple crosses the stages; every element's gradient arrives
    pipe = hybridpar.HybridPipe(nn.Sequential(Layer1(), Layer2()), [1, 1], chunks=4,
                                checkpoint="never", topology=topo,
                                loss_fn=lambda y, _: y.pow(2).mean())
    a, b = (torch.rand(8, 3, 4, 4, generator=torch.Generator().manual_seed(i),
                       requires_grad=True) for i in range(2))
    pipe.train_step((a, b), torch.zeros(8))
    r["tuple_wait"] = [a.grad, b.grad]

    # dropout masks on both stages, checkpointed: recomputed exactly
    outputs = []

    def keep(output, target):
        outputs.append(output.detach())
        return output.norm()

    pipe = hybridpar.HybridPipe(nn.Sequential(Dropouts(), Dropouts()), [1, 1], chunks=10,
                                checkpoint="always", topology=topo, loss_fn=keep)
    x = torch.rand(10, 10, requires_grad=True)
    pipe.train_step(x, torch.zeros(10))
    r["parallel_randoms"] = [x.grad, torch.cat(outputs[:10]) if outputs else None]
    return r


@pytest.fixture(scope="module")
def results():
    return hybridpar.spawn(_worker, 2, timeout=60)


def test_python_autograd_function(results):
    for r in results:
        x, y, loss, _ = r["autograd_function"]
        assert torch.allclose(x, y)
        assert torch.allclose(loss, x.norm())
    x, _, _, grad = results[0]["autograd_function"]
    assert torch.allclose(grad, x / x.norm())   # the gradient came back through both stages


def test_tuple_wait(results):
    a, b = (torch.rand(8, 3, 4, 4, generator=torch.Generator().manual_seed(i),
                       requires_grad=True) for i in range(2))
    Layer2()(Layer1()((a, b))).pow(2).mean().backward()
    a_grad, b_grad = results[0]["tuple_wait"]
    assert torch.allclose(a_grad, a.grad) and torch.allclose(b_grad, b.grad)


def test_parallel_randoms(results):
    x_grad = results[0]["parallel_randoms"][0]
    y = results[1]["parallel_randoms"][1]
    assert (y == 0).any()   # some elements were dropped
    assert y.to(torch.bool).tolist() == x_grad.to(torch.bool).tolist()


class ExpectedException(Exception):
    pass


class Pass(nn.Module):
    def forward(self, x):
        return x


class Raise(nn.Module):
    def forward(self, x):
        raise ExpectedException()


TIMEOUT = 2


def _no_hang():
    """Three stages, the last one raises in a forward; the failing rank stays alive past the
    timeout (its peers must not need its process to end). Each rank returns [error, seconds]."""
    topo = hybridpar.init(pp=3, timeout=TIMEOUT)
    pipe = hybridpar.HybridPipe(nn.Sequential(Pass(), Pass(), Raise()), [1, 1, 1], chunks=3,
                                topology=topo)
    start = time.monotonic()
    try:
        pipe(torch.rand(3))
        error = "no error"
    except Exception as e:   # the failing rank's own, or its peers' PipelineError
        error = f"{type(e).__name__}: {e}"
    seconds = time.monotonic() - start
    if error.startswith("ExpectedException"):
        time.sleep(TIMEOUT + 0.5)
    return [error, seconds]


def test_exception_no_hang():
    # A later stage's failure in a forward-only step owes the earlier stages no message, so
    # no abort reached them: stage 1 waited out the timeout on its sends to the failed stage,
    # stage 0 in the output broadcast, neither naming the failure. Fixed by the listener
    # (pipeline/failures/listener.py): the failure is published for the whole pipeline, and each
    # peer's listener breaks its wait.
    results = hybridpar.spawn(_no_hang, 3, timeout=60)
    assert results[2][0].startswith("ExpectedException")
    for error, seconds in results[:2]:   # at once, naming the failure, not after the timeout
        assert error.startswith("PipelineError") and "ExpectedException" in error, error
        assert seconds < TIMEOUT
