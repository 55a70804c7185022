"""State dicts of sharded models: collect gives the one-device dict, relocate loads at any tp.

A model of every parallel layer kind (vocab- and feature-parallel embeddings with uneven
shards, a column -> row MLP, a BatchNorm with buffers, a dim=None linear) is built next to
the same model of plain torch layers under one seed: the collected state dict must be the
plain model's, key for key, and must load back into a model of another tp size.
"""

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import hybridpar
from hybridpar.tensor_parallel.layers import ParallelEmbedding, ParallelLinear, RegisterParallelDim
from hybridpar.tensor_parallel.state import (
    collect_state_dict,
    gather_full,
    register_ddp_parameters_to_ignore,
    relocate_state_dict,
    shard_of,
    sharded_parameters,
)

SHARDED = ["tok.weight", "feat.weight", "mlp.0.weight", "mlp.0.bias", "mlp.3.weight"]


class Net(nn.Module):
    """ids (B, T) -> (B, T, 4); every layer kind, parallel or plain."""

    def __init__(self, parallel):
        super().__init__()

        def kw(dim):
            return {"dim": dim} if parallel else {}

        emb = ParallelEmbedding if parallel else nn.Embedding
        lin = ParallelLinear if parallel else nn.Linear
        self.tok = emb(10, 8, padding_idx=1, **kw(0))        # vocab 10: uneven over 4
        self.feat = emb(10, 6, **kw(-1))                      # features 6: uneven over 4
        self.mlp = nn.Sequential(lin(8, 16, **kw(-1)), nn.ReLU(),
                                 RegisterParallelDim(-1) if parallel else nn.Identity(),
                                 lin(16, 8, **kw(0)))
        self.norm = nn.BatchNorm1d(8)
        self.head = lin(8, 4, **kw(None))

    def forward(self, ids):
        h = self.tok(ids) + self.feat(ids).sum(-1, keepdim=True)     # (B, T, 8)
        h = self.mlp(h)                                                # (B, T, 8)
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)               # (B, T, 8)
        return self.head(h)                                            # (B, T, 4)


IDS = torch.tensor([[0, 1, 4, 9], [3, 3, 7, 2]])


def _build(parallel, seed):
    torch.manual_seed(seed)
    return Net(parallel)


def _assert_same_dict(actual, expected):
    assert list(actual) == list(expected)
    for key in expected:
        assert actual[key].shape == expected[key].shape, key
        # exact for parameters; BatchNorm statistics went through a row-parallel sum
        torch.testing.assert_close(actual[key].detach(), expected[key].detach(), rtol=0,
                                   atol=1e-12, msg=lambda m, key=key: f"{key}: {m}")


def _assert_same_params(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def _state_worker(tp):
    torch.set_default_dtype(torch.float64)
    topo = hybridpar.init(tp=tp)
    plain, par = _build(False, 0), _build(True, 0)
    plain.train()(IDS)                      # give BatchNorm buffers non-default values
    par.train()(IDS)

    full = collect_state_dict(par, par.state_dict())
    _assert_same_dict(full, plain.state_dict())
    assert hasattr(full, "_metadata")
    _assert_same_dict(collect_state_dict(par, par.state_dict(keep_vars=True)),
                      plain.state_dict())
    outer = nn.ModuleDict({"model": par})
    _assert_same_dict(collect_state_dict(par, outer.state_dict(), prefix="model."),
                      nn.ModuleDict({"model": plain}).state_dict())

    other = _build(True, 1)
    other.load_state_dict(relocate_state_dict(other, full))
    _assert_same_params(other, par)

    # helpers the pipeline reuses
    w = par.mlp[0].weight
    assert torch.equal(shard_of(plain.mlp[0].weight, w), w.detach())
    assert torch.equal(gather_full(w.detach(), w), plain.mlp[0].weight.detach())
    assert [name for name, _, _ in sharded_parameters(par)] == SHARDED

    names = register_ddp_parameters_to_ignore(par)
    assert names == SHARDED and par._ddp_params_and_buffers_to_ignore == SHARDED
    if tp > 1:  # world == tp here: DDP must neither overwrite shards nor average them
        ddp = DistributedDataParallel(par)
        _assert_same_params(par, other)
        ddp(IDS).square().sum().backward()
        plain(IDS).square().sum().backward()
        torch.testing.assert_close(par.head.weight.grad, plain.head.weight.grad,
                                   rtol=0, atol=1e-9)
        torch.testing.assert_close(par.mlp[3].bias.grad, plain.mlp[3].bias.grad,
                                   rtol=0, atol=1e-9)
        w_grad = plain.mlp[0].weight.grad
        torch.testing.assert_close(par.mlp[0].weight.grad, shard_of(w_grad, par.mlp[0].weight),
                                   rtol=0, atol=1e-9)
    return dict(full) if topo.tp_rank == 0 else None


def _relocate_worker(tp, full):
    torch.set_default_dtype(torch.float64)
    hybridpar.init(tp=tp)
    par = _build(True, 7)
    par.load_state_dict(relocate_state_dict(par, full))
    _assert_same_dict(collect_state_dict(par, par.state_dict()), full)
    plain = _build(False, 8)
    plain.load_state_dict(full)
    out_par, out_plain = par.eval()(IDS), plain.eval()(IDS)
    torch.testing.assert_close(out_par, out_plain, rtol=0, atol=1e-9)
    return out_par


@pytest.fixture(scope="module")
def collected_at_tp2():
    return hybridpar.spawn(_state_worker, 2, args=(2,), timeout=90)[0]


@pytest.mark.parametrize("tp", [1, 4])
def test_collect_and_relocate_round_trip_at_one_tp_size(tp):
    full = hybridpar.spawn(_state_worker, tp, args=(tp,), timeout=90)[0]
    assert full["tok.weight"].shape == (10, 8) and full["mlp.3.weight"].shape == (8, 16)


@pytest.mark.parametrize("tp", [1, 4])
def test_a_dict_collected_at_tp2_loads_at_another_tp_size(collected_at_tp2, tp):
    assert collected_at_tp2["feat.weight"].shape == (10, 6)
    outputs = hybridpar.spawn(_relocate_worker, tp, args=(tp, collected_at_tp2), timeout=90)
    assert all(torch.equal(o, outputs[0]) for o in outputs)


def test_state_dicts_without_sharded_parameters_pass_through_without_init():
    model = nn.Sequential(nn.Linear(3, 4), ParallelLinear(4, 2))
    state = model.state_dict()
    for out in (collect_state_dict(model, state), relocate_state_dict(model, state)):
        assert list(out) == list(state)
        assert all(out[k] is state[k] for k in state)
    assert register_ddp_parameters_to_ignore(model) == []
    assert model._ddp_params_and_buffers_to_ignore == []
