"""torchgpipe's checkpoint tests (tests/test_checkpoint.py of kakaobrain/torchgpipe v0.0.7,
BSD-3-Clause, Copyright 2019-2020 Kakao Brain), through `HybridPipe` across processes.

Adapted: `checkpoint(f, x)` on one device -> a two-stage pipe (one rank per stage) with
`checkpoint='always'` (or 'never') and `chunks=1`, whose `train_step` does the forward and the
backward; results are compared with the plain function on one device under the same seed.
Not ported: `test_serial_checkpoints` (the order torchgpipe's fork/join phonies impose on
recomputations: hybridpar's schedule orders them); `test_not_requires_grad` (torchgpipe's
`Checkpointing` class and `Batch`, internals).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hybridpar


class Scale(nn.Module):
    """x * a, a a parameter (torchgpipe's `f`)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.rand(1))

    def forward(self, x):
        return x * self.a


class Detect(nn.Module):
    def __init__(self):
        super().__init__()
        self.logs = []

    def forward(self, input):
        self.logs.append([hybridpar.is_checkpointing(), hybridpar.is_recomputing()])
        return input


def _norm(output, target):
    return output.norm()


def _sum(output, target):
    return output.sum()


def _grads(module):
    return {k: p.grad.clone() for k, p in module.named_parameters() if p.grad is not None}


def _worker():
    topo = hybridpar.init(pp=2, timeout=30)
    r = {}
    # an input that does not require grad: the parameters still get gradients
    torch.manual_seed(0)
    pipe = hybridpar.HybridPipe(nn.Sequential(Scale(), Scale()), [1, 1], checkpoint="always",
                                topology=topo, loss_fn=_sum)
    x = torch.rand(1, 1, generator=torch.Generator().manual_seed(1))
    pipe.train_step(x, torch.zeros(1))
    r["not_requires_grad_with_parameter"] = _grads(pipe)

    # dropout inside a checkpointed stage: the recomputation replays the mask
    r["random"] = {}
    for mode in ("always", "never"):
        pipe = hybridpar.HybridPipe(nn.Sequential(nn.Dropout(p=0.5), nn.Identity()), [1, 1],
                                    checkpoint=mode, topology=topo, loss_fn=_norm)
        torch.manual_seed(0)
        x = torch.randn(3, 3, requires_grad=True)
        pipe.train_step(x, torch.zeros(3))
        r["random"][mode] = x.grad

    # is_checkpointing / is_recomputing as each stage's module sees them
    r["detect"] = {}
    for mode in ("always", "never"):
        pipe = hybridpar.HybridPipe(nn.Sequential(Detect(), Detect()), [1, 1], checkpoint=mode,
                                    topology=topo, loss_fn=_sum)
        pipe.train_step(torch.rand(1, requires_grad=True), torch.zeros(1))
        r["detect"][mode] = pipe[0].logs
    return r


@pytest.fixture(scope="module")
def results():
    return hybridpar.spawn(_worker, 2, timeout=60)


def test_not_requires_grad_with_parameter(results):
    torch.manual_seed(0)
    model = nn.Sequential(Scale(), Scale())
    model(torch.rand(1, 1, generator=torch.Generator().manual_seed(1))).sum().backward()
    r0, r1 = results
    got = {**r0["not_requires_grad_with_parameter"], **r1["not_requires_grad_with_parameter"]}
    assert set(got) == {"0.a", "1.a"}
    for k, p in model.named_parameters():
        assert torch.allclose(got[k], p.grad), k


def test_random_in_checkpoint(results):
    dropout = nn.Dropout(p=0.5)
    torch.manual_seed(0)
    x = torch.randn(3, 3, requires_grad=True)
    dropout(x).norm().backward()
    first = results[0]["random"]
    assert torch.allclose(first["always"], x.grad)   # checkpointed = one device
    assert torch.allclose(first["never"], x.grad)


def test_detect_checkpointing_recomputing(results):
    for r in results:
        assert r["detect"]["always"] == [[True, False], [False, True]]


def test_detect_checkpointing_recomputing_without_checkpoint(results):
    for r in results:
        assert r["detect"]["never"] == [[False, False]]
