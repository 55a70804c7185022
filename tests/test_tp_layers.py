"""Tensor-parallel layers give the one-device numbers: outputs, input and parameter gradients.

Each parallel layer is built under the same seed as its plain torch layer and must hold the
plain layer's slice; forward and backward must match it (float64, to 1e-9). One spawned worker
per tp size runs every check and returns their names.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar
from hybridpar.sharded.attrs import (
    get_order_type,
    get_parallel_dim,
    register_parallel_dim,
    tensor_shard_dim,
)
from hybridpar.sharded.mappings import shard_range
from hybridpar.tensor_parallel.functional import parallel_embedding, parallel_linear
from hybridpar.tensor_parallel.init import shard_init_helper_
from hybridpar.tensor_parallel.layers import ParallelEmbedding, ParallelLinear, RegisterParallelDim
from hybridpar.tensor_parallel.state import full_shape, slice

F64 = torch.float64


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-9, msg=lambda m: f"{what}: {m}")


def _equal(actual, expected, what):
    assert actual.shape == expected.shape and torch.equal(actual, expected), what


class _Shard:
    """This rank's slice of full tensors, as the layers split them."""

    def __init__(self, tp, rank):
        self.tp, self.rank = tp, rank

    def __call__(self, t, dim):
        if dim is None:
            return t
        start, stop = shard_range(t.shape[dim], self.tp, self.rank)
        return t.narrow(dim, start, stop - start)


# linear -------------------------------------------------------------------------------------

def _check_linear(shard, dim, *, bias=True, tagged_input=False):
    torch.manual_seed(0)
    ref = nn.Linear(8, 12, bias, dtype=F64)
    ref_next = torch.rand(1)
    torch.manual_seed(0)
    par = ParallelLinear(8, 12, bias, dim=dim, dtype=F64)
    _equal(torch.rand(1), ref_next, "the RNG stream after construction")
    w_dim = {None: None, 0: 1, 1: 0, -1: 0}[dim]
    b_dim = 0 if dim in (1, -1) else None
    _equal(par.weight, shard(ref.weight, w_dim), "weight is the slice of nn.Linear's")
    if bias:
        _equal(par.bias, shard(ref.bias, b_dim), "bias is the slice of nn.Linear's")
    else:
        assert par.bias is None

    torch.manual_seed(1)
    x = torch.randn(3, 5, 8, dtype=F64)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    g = torch.randn_like(y_ref)
    y_ref.backward(g)

    if tagged_input:
        x_par = shard(x, -1).clone().requires_grad_()
        register_parallel_dim(x_par, -1)
    else:
        x_par = x.clone().requires_grad_()
    y_par = par(x_par)
    out_dim = -1 if dim in (1, -1) else None
    assert get_parallel_dim(y_par) == out_dim
    _close(y_par, shard(y_ref, out_dim), f"output dim={dim}")
    y_par.backward(shard(g, out_dim))
    _close(x_par.grad, shard(x_ref.grad, -1 if tagged_input else None), f"input grad dim={dim}")
    _close(par.weight.grad, shard(ref.weight.grad, w_dim), f"weight grad dim={dim}")
    if bias:
        _close(par.bias.grad, shard(ref.bias.grad, b_dim), f"bias grad dim={dim}")

    torch.manual_seed(5)
    ref.reset_parameters()
    torch.manual_seed(5)
    par.reset_parameters()
    _equal(par.weight, shard(ref.weight, w_dim), "reset_parameters keeps the slice")
    assert repr(par) == (f"ParallelLinear(in_features=8, out_features=12, bias={bias}, "
                         f"dim={dim})")


def _check_mlp(shard):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16, dtype=F64), nn.ReLU(), nn.Linear(16, 8, dtype=F64))
    torch.manual_seed(0)
    par = nn.Sequential(ParallelLinear(8, 16, dim=-1, dtype=F64), nn.ReLU(),
                        RegisterParallelDim(-1), ParallelLinear(16, 8, dim=0, dtype=F64))
    torch.manual_seed(1)
    x = torch.randn(4, 8, dtype=F64)
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_par = ref(x_ref), par(x_par)
    _close(y_par, y_ref, "MLP output")
    y_ref.square().sum().backward()
    y_par.square().sum().backward()
    _close(x_par.grad, x_ref.grad, "MLP input grad")
    _close(par[0].weight.grad, shard(ref[0].weight.grad, 0), "fc1 weight grad")
    _close(par[0].bias.grad, shard(ref[0].bias.grad, 0), "fc1 bias grad")
    _close(par[3].weight.grad, shard(ref[2].weight.grad, 1), "fc2 weight grad")
    _close(par[3].bias.grad, ref[2].bias.grad, "fc2 bias grad")


def _check_meta_copy_and_tags(shard, tp):
    torch.manual_seed(0)
    ref = nn.Linear(8, 12, dtype=F64)
    state = torch.random.get_rng_state()
    par = ParallelLinear(8, 12, dim=-1, device="meta", dtype=F64)
    assert par.weight.is_meta and par.weight.shape == (12 // tp, 8)
    _equal(torch.random.get_rng_state(), state, "a meta layer draws no random number")
    par.to_empty(device="cpu")
    torch.manual_seed(0)
    par.reset_parameters()
    _equal(par.weight, shard(ref.weight, 0), "materialized then reset")

    w, b = par.weight, par.bias
    assert (get_parallel_dim(w), get_order_type(w), tensor_shard_dim(w)) == (-1, 0, 0)
    assert (get_parallel_dim(b), tensor_shard_dim(b)) == (-1, 0)
    assert full_shape(w) == (12, 8) and full_shape(b) == (12,)
    row = ParallelLinear(8, 12, dim=0)
    assert (get_parallel_dim(row.weight), tensor_shard_dim(row.weight)) == (0, 1)
    assert get_parallel_dim(row.bias) is None and row.bias.shape == (12,)
    emb = ParallelEmbedding(10, 6, dim=0)
    assert (get_parallel_dim(emb.weight), get_order_type(emb.weight)) == (0, 1)
    assert full_shape(emb.weight) == (10, 6)

    twin = copy.deepcopy(par)
    assert twin.group is par.group and tensor_shard_dim(twin.weight) == 0
    assert full_shape(twin.weight) == (12, 8)
    _equal(twin.weight, par.weight, "deepcopy keeps values")


def _check_convert(shard):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Sequential(nn.Linear(12, 4)))
    full = [p.detach().clone() for p in model.parameters()]
    state = torch.random.get_rng_state()
    converted = ParallelLinear.convert_parallel_linear(model, dim=-1)
    _equal(torch.random.get_rng_state(), state, "conversion draws no random number")
    assert converted is model
    assert isinstance(model[0], ParallelLinear) and isinstance(model[2][0], ParallelLinear)
    assert repr(model[0]) == "ParallelLinear(in_features=8, out_features=12, bias=True, dim=-1)"
    for p, f in zip(model.parameters(), full):
        _equal(p, shard(f, 0), "converted values are the slices")

    linear = nn.Linear(8, 12)
    row = ParallelLinear.convert_parallel_linear(linear, dim=0)
    assert isinstance(row, ParallelLinear) and row is not linear
    _equal(row.weight, shard(linear.weight.detach(), 1), "row-converted weight")
    _equal(row.bias, linear.bias.detach(), "row-converted bias")


def _check_init_helper(shard):
    col, row = ParallelLinear(20, 32, dim=-1), ParallelLinear(20, 32, dim=0)
    torch.manual_seed(3)
    out = shard_init_helper_(nn.init.kaiming_normal_, col.weight, a=0, mode="fan_in",
                             nonlinearity="leaky_relu")
    assert out is col.weight
    torch.manual_seed(3)
    full = nn.init.kaiming_normal_(torch.empty(32, 20), a=0, mode="fan_in",
                                   nonlinearity="leaky_relu")
    _equal(col.weight.detach(), shard(full, 0), "kaiming on the full weight, sliced")
    shard_init_helper_(nn.init.constant_, col.bias, val=0.1)
    _equal(col.bias.detach(), torch.full((32 // shard.tp,), 0.1), "constant bias")
    torch.manual_seed(4)
    shard_init_helper_(nn.init.xavier_uniform_, row.weight)
    torch.manual_seed(4)
    full = nn.init.xavier_uniform_(torch.empty(32, 20))
    _equal(row.weight.detach(), shard(full, 1), "xavier on the full row weight, sliced")
    plain = torch.empty(3, 4)
    torch.manual_seed(6)
    shard_init_helper_(nn.init.normal_, plain, std=2.0)
    torch.manual_seed(6)
    _equal(plain, torch.empty(3, 4).normal_(std=2.0), "an untagged tensor is initialized whole")


# embedding ----------------------------------------------------------------------------------

_IDS = torch.tensor([[0, 3, 7, 9, 7, 2], [2, 7, 5, 9, 1, 8]])


def _check_embedding(shard, dim, num=10, width=6, *, sparse=False, weight=False, **kw):
    torch.manual_seed(0)
    full = torch.randn(num, width, dtype=F64) if weight else None
    ref = nn.Embedding(num, width, sparse=sparse, dtype=F64,
                       _weight=None if full is None else full.clone(), **kw)
    ref_next = torch.rand(1)
    torch.manual_seed(0)
    if weight:
        torch.randn(num, width, dtype=F64)
    par = ParallelEmbedding(num, width, sparse=sparse, dim=dim, dtype=F64,
                            _weight=None if full is None else full.clone(), **kw)
    _equal(torch.rand(1), ref_next, "the RNG stream after construction")
    w_dim = {None: None, 0: 0, 1: 1, -1: 1}[dim]
    _equal(par.weight, shard(ref.weight, w_dim), f"embedding weight dim={dim} {kw}")

    ids = _IDS % num
    y_ref, y_par = ref(ids), par(ids)
    assert get_parallel_dim(y_par) is None
    _close(y_par, y_ref, f"embedding output dim={dim} {kw}")
    g = torch.randn_like(y_ref)
    y_ref.backward(g)
    y_par.backward(g)
    _equal(par.weight.detach(), shard(ref.weight.detach(), w_dim), "weights after max_norm")
    grad_ref, grad_par = ref.weight.grad, par.weight.grad
    assert grad_par.is_sparse == sparse
    if sparse:
        grad_ref, grad_par = grad_ref.to_dense(), grad_par.to_dense()
    _close(grad_par, shard(grad_ref, w_dim), f"embedding weight grad dim={dim} {kw}")
    pad = kw.get("padding_idx")
    if pad is not None and dim == 0:
        start, stop = shard_range(num, shard.tp, shard.rank)
        if start <= pad % num < stop:
            assert not grad_par[pad % num - start].any(), "the padding row gets no gradient"


def _check_functional(shard):
    torch.manual_seed(0)
    w, b, x = torch.randn(12, 8, dtype=F64), torch.randn(12, dtype=F64), torch.randn(4, 8,
                                                                                     dtype=F64)
    y = F.linear(x, w, b)
    _close(parallel_linear(x, w, b), y, "parallel_linear dim=None")
    col = parallel_linear(x, shard(w, 0), shard(b, 0), dim=-1)
    assert get_parallel_dim(col) == -1
    _close(col, shard(y, -1), "parallel_linear dim=-1")
    _close(parallel_linear(x, shard(w, 1), b, dim=0), y, "parallel_linear dim=0")
    table = torch.randn(10, 6, dtype=F64)
    e = F.embedding(_IDS, table)
    _close(parallel_embedding(_IDS, table), e, "parallel_embedding dim=None")
    _close(parallel_embedding(_IDS, shard(table, 0), num_embeddings=10, dim=0), e,
           "parallel_embedding dim=0")
    _close(parallel_embedding(_IDS, shard(table, 1), dim=-1, embedding_dim=6), e,
           "parallel_embedding dim=-1")


def _layers_worker(tp):
    topo = hybridpar.init(tp=tp)
    shard = _Shard(tp, topo.tp_rank)
    done = []
    for dim in (None, 1, -1, 0):
        _check_linear(shard, dim)
        done.append(f"linear {dim}")
    _check_linear(shard, -1, bias=False)
    _check_linear(shard, 0, bias=False, tagged_input=True)
    _check_linear(shard, 0, tagged_input=True)
    done.append("linear tagged")
    _check_mlp(shard)
    done.append("mlp")
    for dim in (None, 0, -1, 1):
        _check_embedding(shard, dim, padding_idx=7)
        _check_embedding(shard, dim, sparse=True)
        _check_embedding(shard, dim, scale_grad_by_freq=True, padding_idx=-1)
        _check_embedding(shard, dim, weight=True)
        done.append(f"embedding {dim}")
    for dim in (None, 0):
        _check_embedding(shard, dim, max_norm=1.5, padding_idx=2)
        _check_embedding(shard, dim, max_norm=0.5, norm_type=1.0)
    done.append("max_norm")
    _check_embedding(shard, 0, num=7, width=5, padding_idx=6)       # uneven vocabulary
    _check_embedding(shard, -1, num=7, width=7, padding_idx=3)      # uneven features
    done.append("uneven")
    _check_functional(shard)
    _check_meta_copy_and_tags(shard, tp)
    _check_convert(shard)
    _check_init_helper(shard)
    done += ["functional", "meta", "convert", "init"]
    return done


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_parallel_layers_match_the_plain_torch_layers(tp):
    results = hybridpar.spawn(_layers_worker, tp, args=(tp,), timeout=90)
    assert len(results) == tp
    assert all(r == results[0] for r in results)
    assert results[0][-1] == "init" and "mlp" in results[0]


# without any process group --------------------------------------------------------------------

def test_dim_none_layers_are_plain_torch_layers_without_init():
    torch.manual_seed(0)
    ref = nn.Linear(20, 30)
    torch.manual_seed(0)
    par = ParallelLinear(20, 30)
    assert par.group is None
    assert torch.equal(par.weight, ref.weight) and torch.equal(par.bias, ref.bias)
    assert repr(par) == "ParallelLinear(in_features=20, out_features=30, bias=True, dim=None)"
    x = torch.randn(128, 20)
    assert torch.equal(par(x), ref(x))
    torch.manual_seed(0)
    ref_e = nn.Embedding(64, 16, padding_idx=3)
    torch.manual_seed(0)
    par_e = ParallelEmbedding(64, 16, padding_idx=3)
    ids = torch.tensor([1, 3, 63])
    assert torch.equal(par_e(ids), ref_e(ids))
    table = torch.randn(5, 4)
    assert ParallelEmbedding(5, 4, _weight=table).weight.data_ptr() == table.data_ptr()


def test_register_parallel_dim_tags_and_returns_the_same_tensor():
    x = torch.empty(3)
    assert get_parallel_dim(x) is None
    out = RegisterParallelDim(dim=0)(x)
    assert out is x and get_parallel_dim(x) == 0
    assert RegisterParallelDim(-1)(x) is x and get_parallel_dim(x) == -1
    assert repr(RegisterParallelDim(-1)) == "RegisterParallelDim(dim=-1)"


def test_slice_splits_like_torch_split_and_unevenly_like_the_layers():
    x = torch.arange(30.0).view(3, 10)
    a, b = slice(x, 2, dim=-1)
    assert a.shape == b.shape == (3, 5) and torch.equal(torch.cat([a, b], -1), x)
    assert [p.shape[1] for p in slice(x, 4)] == [3, 3, 2, 2]   # default: the last dim
    rows = slice(x, 3, dim=0, contiguous=True)
    assert all(r.is_contiguous() and r.shape == (1, 10) for r in rows)
