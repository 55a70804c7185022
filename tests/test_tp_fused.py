"""A fused column layer of unequal parts (q | k | v under grouped queries: Phi-3's qkv_proj):
each rank keeps its slice of every part, gathers and checkpoints part by part.

    full out = (8 | 4 | 4) = 16        rank r of tp 2 keeps [q_r (4) | k_r (2) | v_r (2)]
"""

import pytest
import torch
from torch import nn

import hybridpar
from hybridpar.tensor_parallel.fused import fused_ranges, fused_sizes, local_ranges, part_sizes
from hybridpar.tensor_parallel.layers import ParallelLinear
from hybridpar.tensor_parallel.state import gather_full, shard_ranges

SIZES = (8, 4, 4)


def _full(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(6, sum(SIZES), dtype=torch.float64)


def test_the_ranges_of_unequal_parts_are_each_parts_rth_slice():
    assert fused_ranges(SIZES, 2, 0) == [(0, 4), (8, 10), (12, 14)]
    assert fused_ranges(SIZES, 2, 1) == [(4, 8), (10, 12), (14, 16)]
    assert fused_ranges((6, 6, 6), 3, 2) == [(4, 6), (10, 12), (16, 18)]   # equal parts
    assert part_sizes(3, 18) == (6, 6, 6) and part_sizes(SIZES, 16) == SIZES
    assert local_ranges(SIZES, 2) == [(0, 4), (4, 6), (6, 8)]   # in a rank's shard


# fused parts that ParallelLinear refuses at tp 2, and its message
REFUSED = [((8, 4, 2), "made of k equal parts"), ((8, 5, 3), "each a multiple of tp=2")]


def _worker(folder, tp):
    from hybridpar.train.checkpoints.checkpoint import load_checkpoint, save_checkpoint
    from hybridpar.train.checkpoints.shards import model_entries

    topo = hybridpar.init(tp=tp, timeout=60)
    group = topo.tp_group
    full = _full(0 if tp == 2 else 9)
    layer = ParallelLinear.from_module(full, -1, fused=SIZES, group=group)
    assert fused_sizes(layer.weight) == SIZES and fused_sizes(layer.bias) == SIZES
    model = nn.Sequential(layer)
    x = torch.randn(3, 6, dtype=torch.float64)
    out = {"ranges": shard_ranges(layer.weight, group).ranges, "y": layer(x),
           "want": full(x).detach()}
    entries = model_entries(model, group if tp > 1 else None)
    if tp == 2:
        save_checkpoint(folder, 1, entries, keep=1)
        for fused, message in REFUSED:
            with pytest.raises(ValueError, match=message):
                ParallelLinear(6, 16, dim=-1, fused=fused, group=group)
    else:
        load_checkpoint(f"{folder}/step-1", entries)
    out["weight"], out["bias"] = (gather_full(p.detach(), p, group) for p in (layer.weight,
                                                                           layer.bias))
    return out


def test_a_fused_layer_of_unequal_parts_computes_gathers_and_checkpoints_part_by_part(tmp_path):
    saved = hybridpar.spawn(_worker, 2, args=(str(tmp_path), 2), timeout=120)
    expected = _full(0)
    for rank, r in enumerate(saved):
        assert r["ranges"] == fused_ranges(SIZES, 2, rank)
        # its output is its slice of each part of the full output, in order
        want = torch.cat([r["want"][:, a:b] for a, b in r["ranges"]], -1)
        torch.testing.assert_close(r["y"], want, atol=1e-14, rtol=0)
        torch.testing.assert_close(r["weight"], expected.weight.detach(), atol=0, rtol=0)
        torch.testing.assert_close(r["bias"], expected.bias.detach(), atol=0, rtol=0)
    (loaded,) = hybridpar.spawn(_worker, 1, args=(str(tmp_path), 1), timeout=120)
    torch.testing.assert_close(loaded["weight"], expected.weight.detach(), atol=0, rtol=0)
    torch.testing.assert_close(loaded["bias"], expected.bias.detach(), atol=0, rtol=0)
