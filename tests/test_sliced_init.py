"""A tp shard's keyed draw gives the slice of the full draw, bit for bit, without the full tensor.

`hybridpar.tensor_parallel.sliced_init` redoes the full layer's initializer chunk by chunk on
the shard. Checked here: every dtype and size (16 not dividing it: normal_'s last block), the
random state afterwards, every tp layer's slices at tp = 2 (plain, fused, row, uneven
vocabulary, padding row), no tensor as large as the full one allocated on the way, and the
fall-back to the full tensor for an initializer that reads values.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hybridpar
from hybridpar.tensor_parallel.sliced_init import ShardProxy, init_from_full, init_shards
from hybridpar.tensor_parallel.state import shard_of


def _meta_module(shape, dtype):
    module = nn.Module()
    module.weight = nn.Parameter(torch.empty(shape, device="meta", dtype=dtype))
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [7, 16, 17, 100, 4099])
@pytest.mark.parametrize("op", ["normal", "uniform", "kaiming", "normal then mul and row"])
def test_a_chunked_draw_is_the_full_draw(dtype, numel, op):
    def init(module):
        w = module.weight
        if op == "kaiming":
            nn.init.kaiming_uniform_(w.view(numel, 1), a=5 ** 0.5)
        elif op == "uniform":
            nn.init.uniform_(w, -0.3, 0.7)
        else:
            nn.init.normal_(w, mean=0.1, std=0.02)
        if op == "normal then mul and row":
            w.mul_(0.5)
            w[3:5].zero_()
            w.data[numel - 1] = 2.0

    torch.manual_seed(3)
    full = torch.empty(numel, dtype=dtype)
    init(type("Full", (), {"weight": full})())
    after_full = torch.get_rng_state()

    torch.manual_seed(3)
    shard = torch.full((numel,), float("nan"), dtype=dtype)
    module = _meta_module((numel,), dtype)
    assert init_shards(module, init, {shard: (module, "weight")}, chunk=32)
    assert torch.equal(shard, full)
    assert torch.equal(torch.get_rng_state(), after_full)   # the next layer draws the same


def test_the_chunk_must_hold_whole_normal_blocks():
    with pytest.raises(ValueError, match="chunk=24 must be a multiple of 16"):
        init_shards(nn.Module(), lambda m: None, {}, chunk=24)


def test_an_initializer_that_reads_values_falls_back_and_draws_nothing_twice():
    shard = torch.empty(40)
    module = _meta_module((40,), torch.float32)
    state = torch.get_rng_state()
    assert not init_shards(module, lambda m: nn.init.trunc_normal_(m.weight, std=0.02),
                           {shard: (module, "weight")}, chunk=16)
    assert torch.equal(torch.get_rng_state(), state)
    assert module.weight.is_meta and not isinstance(module.weight, ShardProxy)


class _Largest(TorchDispatchMode):
    """The most elements of any real tensor an op returned."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not isinstance(t, ShardProxy) \
                    and t.device.type != "meta":
                self.numel = max(self.numel, t.numel())
        return out


# Each layer at tp = 2, over 2**20 elements (the default chunk) with 16 not dividing its size.
_V, _D = 1031, 1026     # odd vocabulary (uneven shards), 1031 * 1026 % 16 = 6


def _layers():
    from hybridpar.tensor_parallel.feature.dense import TPDense
    from hybridpar.tensor_parallel.layers import ParallelConv1D, ParallelEmbedding, ParallelLinear

    def conv1d_full():
        full = nn.Module()
        full.weight = nn.Parameter(torch.empty(1030, _D))
        full.bias = nn.Parameter(torch.empty(_D))
        nn.init.normal_(full.weight, std=0.02)
        nn.init.zeros_(full.bias)
        return full

    def dense_full():
        full = nn.Linear(1030, _D)
        full.weight.data.mul_(0.5)
        return full

    return {
        "linear column": (lambda: ParallelLinear(1030, _D, dim=-1),
                          lambda: nn.Linear(1030, _D)),
        "linear row": (lambda: ParallelLinear(1030, _D, dim=0), lambda: nn.Linear(1030, _D)),
        "linear fused q|k|v": (lambda: ParallelLinear(1030, 1032, dim=-1, fused=3),
                               lambda: nn.Linear(1030, 1032)),
        "conv1d row": (lambda: ParallelConv1D(_D, 1030, dim=0), conv1d_full),
        "embedding vocabulary": (lambda: ParallelEmbedding(_V, _D, padding_idx=_V - 1, dim=0),
                                 lambda: nn.Embedding(_V, _D, padding_idx=_V - 1)),
        "embedding features": (lambda: ParallelEmbedding(_V, _D, dim=-1),
                               lambda: nn.Embedding(_V, _D)),
        "tpdense gather": (lambda: TPDense(1030, _D, mode="gather", init_scale=0.5),
                           dense_full),
    }


def _layers_worker():
    hybridpar.init(tp=2)
    done = []
    for name, (make, make_full) in _layers().items():
        with torch.device("meta"):
            layer = make()
        layer.to_empty(device="cpu")
        torch.manual_seed(5)
        with _Largest() as largest:
            layer.reset_parameters()
        after = torch.get_rng_state()
        torch.manual_seed(5)
        full = make_full()
        assert torch.equal(torch.get_rng_state(), after), name
        full_numel = full.weight.numel()
        assert largest.numel < full_numel, (name, largest.numel, full_numel)
        for pname, param in layer.named_parameters():
            expected = shard_of(getattr(full, pname).detach(), param, layer.group)
            assert torch.equal(param.detach(), expected), (name, pname)
        done.append(name)

    # an initializer that reads values (trunc_normal_'s rejection) draws the full tensor
    from hybridpar.tensor_parallel.layers import ParallelLinear

    layer = ParallelLinear(64, 32, dim=-1)
    torch.manual_seed(9)
    init_from_full(layer, nn.Linear(64, 32, device="meta"),
                   lambda m: nn.init.trunc_normal_(m.weight, std=0.02), group=layer.group)
    torch.manual_seed(9)
    w = nn.init.trunc_normal_(torch.empty(32, 64), std=0.02)
    assert torch.equal(layer.weight.detach(), shard_of(w, layer.weight, layer.group))
    return [*done, "fall-back"]


def test_every_tp_layer_draws_its_slice_without_the_full_tensor():
    results = hybridpar.spawn(_layers_worker, 2, timeout=120)
    assert results[0] == results[1] == [*_layers(), "fall-back"]
