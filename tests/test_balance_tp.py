"""Balancing a model whose layers are already sharded over a real tp group."""

import torch
from torch import nn

import hybridpar
from hybridpar.nn import ParallelLinear, RegisterParallelDim


def _sharded_model():
    torch.manual_seed(0)
    layers = []
    for _ in range(3):
        layers.append(nn.Sequential(ParallelLinear(16, 64, dim=-1), nn.GELU(),
                                    RegisterParallelDim(-1), ParallelLinear(64, 16, dim=0)))
    layers.append(nn.Linear(16, 4))
    return nn.Sequential(*layers)


def _balance_in_a_tp_group(by):
    hybridpar.init(tp=2, timeout=60)
    model = _sharded_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(8, 16)
    if by == "time":
        balance = hybridpar.balance_by_time(2, model, sample, timeout=0.3, tp=2)
    else:
        balance = hybridpar.balance_by_size(2, model, sample, tp=2)
    unchanged = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    return {"balance": balance, "unchanged": unchanged,
            "grads": [p.grad is None for p in model.parameters()]}


def test_sharded_layers_are_profiled_inside_their_tp_group_without_a_hang():
    for by in ("time", "size"):
        for r in hybridpar.spawn(_balance_in_a_tp_group, 2, args=(by,), timeout=120):
            assert sum(r["balance"]) == 4 and min(r["balance"]) >= 1
            assert r["unchanged"] and all(r["grads"])  # no trace left
