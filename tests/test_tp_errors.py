"""Misuse of the tensor-parallel layers fails early, on every rank, saying how to fix it."""

import pytest
import torch

import hybridpar
from hybridpar import topology
from hybridpar.sharded.attrs import register_parallel_dim
from hybridpar.tensor_parallel.functional import parallel_embedding, parallel_linear
from hybridpar.tensor_parallel.layers import ParallelEmbedding, ParallelLinear, RegisterParallelDim
from hybridpar.tensor_parallel.state import relocate_state_dict, slice


@pytest.mark.parametrize("make", [
    lambda: ParallelLinear(4, 4, dim=2),
    lambda: ParallelEmbedding(4, 4, dim=-2),
    lambda: RegisterParallelDim(3),
    lambda: parallel_linear(torch.ones(2, 4), torch.ones(4, 4), dim=2),
    lambda: parallel_embedding(torch.tensor([1]), torch.ones(4, 4), dim="0"),
])
def test_a_dim_other_than_none_0_1_minus_1_is_rejected(make):
    with pytest.raises(ValueError, match=r"dim=None .*dim=0 .*dim=1 / -1"):
        make()


@pytest.mark.parametrize("make", [
    lambda: ParallelLinear(4, 4, dim=-1),
    lambda: ParallelLinear(4, 4, dim=0),
    lambda: ParallelEmbedding(10, 4, dim=0),
    lambda: parallel_linear(torch.ones(2, 4), torch.ones(4, 4), dim=-1),
])
def test_a_parallel_layer_before_init_asks_for_hybridpar_init(make, monkeypatch):
    monkeypatch.setattr(topology, "_current", None)
    with pytest.raises(RuntimeError, match=r"call hybridpar\.init"):
        make()


def test_bad_arguments_without_a_group():
    with pytest.raises(ValueError, match="padding_idx=10 must be within the vocabulary"):
        ParallelEmbedding(10, 4, padding_idx=10)
    with pytest.raises(ValueError, match=r"_weight has shape \(3, 4\), expected the full"):
        ParallelEmbedding(10, 4, _weight=torch.ones(3, 4))
    with pytest.raises(ValueError, match="num_partitions must be a positive integer"):
        slice(torch.ones(4), 0)


def _catch(fn):
    try:
        fn()
    except Exception as e:  # the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _tagged(x):
    register_parallel_dim(x, -1)
    return x


def _errors_worker(tp):
    hybridpar.init(tp=tp)
    col = ParallelLinear(8, 8, dim=-1)
    row = ParallelLinear(8, 8, dim=0)
    sharded = _tagged(torch.ones(2, 8 // tp))
    return {
        "in_features": _catch(lambda: ParallelLinear(7, 8, dim=0)),
        "out_features": _catch(lambda: ParallelLinear(8, 7, dim=1)),
        "column width": _catch(lambda: col(torch.ones(2, 6))),
        "column sharded": _catch(lambda: col(sharded)),
        "row width": _catch(lambda: row(torch.ones(2, 6))),
        "row tagged width": _catch(lambda: row(_tagged(torch.ones(2, 3)))),
        "num_embeddings": _catch(lambda: parallel_embedding(
            torch.tensor([1]), torch.ones(5, 4), dim=0)),
        "relocate": _catch(lambda: relocate_state_dict(col, {"weight": torch.ones(4, 8)})),
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_multi_rank_misuse_raises_a_clear_error_on_every_rank(tp):
    expected = {
        "in_features": f"ValueError: ParallelLinear(in_features=7, out_features=8, dim=0): "
                       f"in_features=7 is not divisible by the tp size {tp}",
        "out_features": f"ValueError: ParallelLinear(in_features=8, out_features=7, dim=1): "
                        f"out_features=7 is not divisible by the tp size {tp}",
        "column width": "ValueError: column-parallel linear expects input width "
                        "(in_features) 8, got 6",
        "column sharded": "tagged as sharded on its last dim",
        "row width": "ValueError: row-parallel linear expects an untagged input of width "
                     "in_features = 8",
        "row tagged width": f"ValueError: row-parallel linear expects an input tagged as sharded "
                            f"of width in_features / tp = {8 // tp}, got 3",
        "num_embeddings": "ValueError: vocab-parallel embedding (dim=0) needs num_embeddings=",
        "relocate": "ValueError: state_dict['weight'] has shape (4, 8) but the full parameter "
                    "has shape (8, 8)",
    }
    for rank, got in enumerate(hybridpar.spawn(_errors_worker, tp, args=(tp,), timeout=60)):
        for case, phrase in expected.items():
            assert phrase in got[case], f"rank {rank}, {case}: {got[case]}"
