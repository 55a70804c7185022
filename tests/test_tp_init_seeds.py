"""shard_init_helper_ gives one consistent tensor whatever each rank's seed (torchshard's
tests seed every rank differently; slicing each rank's own draw gave inconsistent shards)."""

from __future__ import annotations

import torch
from torch import nn

import hybridpar
from hybridpar.nn import ParallelLinear
from hybridpar.nn.init import shard_init_helper_
from hybridpar.tensor_parallel.state import gather_full


def worker():
    topo = hybridpar.init(tp=2, timeout=30)
    col = ParallelLinear(6, 8, dim=-1)
    replica = torch.empty(3, 4)
    torch.manual_seed(100 + topo.rank)              # a different seed on every rank
    shard_init_helper_(nn.init.normal_, col.weight)
    shard_init_helper_(nn.init.normal_, replica)
    full = gather_full(col.weight.detach(), col.weight, topo.tp_group)
    torch.manual_seed(100)                           # rank 0's draw: the one every rank keeps
    return {"full": full, "expected": nn.init.normal_(torch.empty(8, 6)),
            "replica": replica, "expected_replica": nn.init.normal_(torch.empty(3, 4))}


def test_shards_and_replicas_come_from_the_first_ranks_draw():
    ranks = hybridpar.spawn(worker, 2, timeout=60)
    for r in ranks:
        assert torch.equal(r["full"], ranks[0]["expected"])
        assert torch.equal(r["replica"], ranks[0]["expected_replica"])


def ddp_worker():
    topo = hybridpar.init(tp=2, timeout=30)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    replicated = nn.Linear(4, 4)
    same = ParallelLinear.convert_parallel_linear(replicated, dim=None)
    converted = ParallelLinear.convert_parallel_linear(model, dim=-1)
    return {"ignored": sorted(converted._ddp_params_and_buffers_to_ignore),
            "reused": same.weight is replicated.weight and same.bias is replicated.bias,
            "tp": topo.tp}


def test_conversions_register_shards_for_ddp_and_keep_unsharded_parameters():
    for r in hybridpar.spawn(ddp_worker, 2, timeout=60):
        assert r["ignored"] == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert r["reused"]


def test_torchshards_argument_forms_of_the_tags():
    from hybridpar import get_parallel_dim, register_parallel_dim
    from hybridpar.nn import RegisterParallelDim

    t = torch.zeros(2)
    register_parallel_dim(t)                 # torchshard: no dim means replicated
    assert get_parallel_dim(t) is None
    register_parallel_dim(t, value=0)        # torchshard's keyword
    assert get_parallel_dim(t) == 0 and t.parallel_dim == 0   # torchshard's attribute name
    a, b = RegisterParallelDim(-1)((torch.zeros(1), torch.zeros(1)))   # a tuple: each tagged
    assert get_parallel_dim(a) == get_parallel_dim(b) == -1
