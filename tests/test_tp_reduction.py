"""A norm over the whole width of a column's shard, summed over tp (`tensor_parallel.reduction`):
OLMo 2's q / k RMSNorm, here on a plain module, float64, at tp 2 on gloo ranks: the output,
the input's gradient and every parameter's gradient as one device's; a norm that also reduces
a full tensor keeps its column replicated, with the reason; a forward that fails inside the
norm leaves no mode behind.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hybridpar
from hybridpar.tensor_parallel.plans.plan import apply_tp_plan, plan_decisions
from hybridpar.tensor_parallel.state import gather_full

F64 = torch.float64


class RMSNorm(nn.Module):
    """An RMSNorm over the last dim (OLMo 2's, in the input's dtype); given `other`, it adds
    that full tensor's mean over its features too."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.fail = False

    def forward(self, x: torch.Tensor, other: torch.Tensor | None = None) -> torch.Tensor:
        if self.fail:
            raise ValueError("the norm failed")
        y = self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return y if other is None else y + other.mean(-1, keepdim=True)


class NormedProjection(nn.Module):
    """x + o(RMSNorm(q(x))) over q's 16 features; with `whole`, the norm also reduces x."""

    def __init__(self, *, whole: bool = False) -> None:
        super().__init__()
        self.q = nn.Linear(8, 16)
        self.norm = RMSNorm(16)
        self.o = nn.Linear(16, 8)
        self.whole = whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.o(self.norm(self.q(x), x if self.whole else None))


def _worker(whole: bool):
    topo = hybridpar.init(tp=2, timeout=60)
    torch.manual_seed(0)
    ref = NormedProjection(whole=whole).to(F64)
    model = apply_tp_plan(copy.deepcopy(ref), "auto", group=topo.tp_group)
    if whole:   # its decisions only
        return {"decisions": plan_decisions(model)}
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1), dtype=F64)
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out = ref(x_ref), model(x_tp)
    w = torch.randn(out_ref.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    (out_ref * w).sum().backward()
    (out * w).sum().backward()
    params = dict(model.named_parameters())
    grads = {k: float((gather_full(params[k].grad, params[k], topo.tp_group) - p.grad).abs().max())
             for k, p in ref.named_parameters()}
    failed = None
    model.norm.fail = True
    try:
        model(x)
    except ValueError as e:
        failed = str(e)
    return {"out": float((out - out_ref).detach().abs().max()),
            "input grad": float((x_tp.grad - x_ref.grad).abs().max()), "grads": grads,
            "decisions": plan_decisions(model), "failed": failed,
            "modes left": len(torch.overrides._get_current_function_mode_stack())}


@pytest.fixture(scope="module")
def runs():
    from spawn_cases import spawn_cases

    return spawn_cases(_worker, 2, {"norm": (False,), "whole": (True,)}, timeout=120)


def test_a_norm_over_a_columns_shard_sums_over_tp_as_one_device(runs):
    for r in runs["norm"]:
        assert r["out"] < 1e-14 and r["input grad"] < 1e-14, r
        assert max(r["grads"].values()) < 1e-14, r["grads"]
        d = r["decisions"]
        assert any(line.startswith("q (Linear 8->16): column") for line in d), d
        assert "norm: its means / sums over the features summed over tp (the features of q " \
               "are sharded)" in d
        assert "norm.weight: sharded by head (dim 0: 8 of 16 per rank), as the column whose " \
               "heads it meets" in d
        # a forward that fails inside the norm: the mode is left all the same
        assert r["failed"] == "the norm failed" and r["modes left"] == 0


def test_a_norm_that_also_reduces_a_full_tensor_keeps_its_column_replicated(runs):
    for r in runs["whole"]:
        q = next(line for line in r["decisions"] if line.startswith("q (Linear"))
        assert ": replicate - 'norm' reduces over the features of its shard and of full " \
               "activations (only the first sum over tp)" in q, q
