"""torchshard's promises kept by hybridpar itself: consistent initialization whatever each
rank's seed, conversions that DDP handles right, and torchshard's methods and argument forms."""

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


def embedding_worker():
    from hybridpar.nn import ParallelEmbedding

    hybridpar.init(tp=2, timeout=30)

    torch.manual_seed(0)
    ids = torch.tensor([[0, 5, 9, 3], [7, 7, 1, 2]])
    out = {}
    for dim in (0, -1, None):
        model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 2))
        expected = model(ids)
        table = model[0].weight
        converted = ParallelEmbedding.convert_parallel_embedding(model, dim=dim)
        out[str(dim)] = [torch.allclose(converted(ids), expected, atol=1e-6),
                         sorted(converted._ddp_params_and_buffers_to_ignore),
                         converted[0].weight is table]
    layer = nn.Linear(4, 4)
    parallel = ParallelLinear.convert_parallel_linear(layer, dim=-1)
    parallel.slice_params()
    before = parallel.weight.detach().clone()
    torch.manual_seed(1)
    parallel.reset_params()
    out["reset"] = not torch.equal(before, parallel.weight.detach())
    return out


def test_convert_parallel_embedding_keeps_values_and_registers_shards():
    for r in hybridpar.spawn(embedding_worker, 2, timeout=60):
        assert r["0"] == [True, ["0.weight"], False]
        assert r["-1"] == [True, ["0.weight"], False]
        assert r["None"] == [True, [], True]     # not sharded: the very same Parameter
        assert r["reset"]


def test_parallel_cross_entropy_functional_entry_point():
    from hybridpar.nn.functional import ParallelCrossEntropy

    logits, target = torch.randn(5, 7), torch.tensor([0, 3, 6, 2, 1])
    loss = ParallelCrossEntropy.apply(logits, target, None, None, -100, None, "mean")
    assert torch.allclose(loss, nn.functional.cross_entropy(logits, target))


def max_norm_worker():
    from hybridpar.nn import ParallelEmbedding

    topo = hybridpar.init(tp=2, timeout=30)
    torch.manual_seed(0)
    plain = nn.Embedding(10, 6, max_norm=1.0)
    ids = torch.tensor([[0, 5, 9, 3], [7, 7, 1, 2]])
    sharded = ParallelEmbedding.convert_parallel_embedding(
        nn.Sequential(nn.Embedding(10, 6, max_norm=1.0)), dim=-1)[0]
    sharded.weight.data.copy_(plain.weight.data.chunk(2, dim=1)[topo.tp_rank])
    out, expected = sharded(ids), plain(ids)          # both renormalize the rows they look up
    table = gather_full(sharded.weight.detach(), sharded.weight, topo.tp_group)
    return {"out": torch.allclose(out, expected, atol=1e-6),
            "table": torch.allclose(table, plain.weight.detach(), atol=1e-6)}


def test_max_norm_on_a_feature_sharded_table_renormalizes_by_the_full_row_norm():
    for r in hybridpar.spawn(max_norm_worker, 2, timeout=60):
        assert r == {"out": True, "table": True}
