"""Rank math without processes, and the process groups with real gloo ranks."""

import datetime

import pytest
import torch
import torch.distributed as dist

import hybridpar
from hybridpar.topology import Coordinate, ParallelDims, Topology


def test_tp_varies_fastest_then_pp_then_dp():
    dims = ParallelDims(dp=2, pp=2, tp=2)
    table = [tuple(dims.coordinate(r)) for r in range(8)]
    assert table == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1),
        (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1),
    ]


@pytest.mark.parametrize("dp,pp,tp", [(1, 1, 1), (2, 1, 1), (1, 4, 1), (1, 1, 4), (2, 3, 2)])
def test_rank_and_coordinate_are_inverse(dp, pp, tp):
    dims = ParallelDims(dp=dp, pp=pp, tp=tp)
    for r in range(dims.world_size):
        assert dims.rank(*dims.coordinate(r)) == r
    assert isinstance(dims.coordinate(0), Coordinate)


def test_dp_is_inferred_from_the_world_size():
    assert ParallelDims.for_world(8, pp=2, tp=2) == ParallelDims(dp=2, pp=2, tp=2)
    assert ParallelDims.for_world(4) == ParallelDims(dp=4)


def test_world_that_does_not_match_the_layout_is_rejected_with_the_numbers():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by pp \* tp = 2 \* 2"):
        ParallelDims.for_world(6, pp=2, tp=2)
    with pytest.raises(ValueError, match=r"world size 8 != dp \* pp \* tp = 3 \* 2 \* 1 = 6"):
        ParallelDims.for_world(8, pp=2, dp=3)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_sizes_must_be_positive_integers(bad):
    with pytest.raises(ValueError, match="positive integer"):
        ParallelDims(dp=1, pp=bad, tp=1)


def test_coordinates_outside_the_grid_are_rejected():
    dims = ParallelDims(dp=1, pp=2, tp=2)
    with pytest.raises(ValueError, match="rank 4 is outside a world of 4 ranks"):
        dims.coordinate(4)
    with pytest.raises(ValueError, match=r"tp coordinate 2 is outside 0\.\.1"):
        dims.rank(0, 0, 2)


def test_using_the_topology_before_init_says_to_call_init():
    hybridpar.shutdown()
    with pytest.raises(RuntimeError, match=r"call hybridpar.init"):
        hybridpar.current_topology()


def _groups_worker():
    topo = hybridpar.init(pp=2, tp=2, timeout=30)
    out = {"coord": list(topo.coordinate), "dims": [topo.dp, topo.pp, topo.tp],
           "timeout": topo.timeout.total_seconds()}
    for name in ("dp", "pp", "tp"):
        group = getattr(topo, f"{name}_group")
        members = [torch.zeros(1) for _ in range(dist.get_world_size(group))]
        dist.all_gather(members, torch.tensor([float(topo.rank)]), group=group)
        out[name] = [int(m.item()) for m in members]
    out["next_stage"] = topo.stage_rank((topo.pp_rank + 1) % topo.pp)
    assert hybridpar.current_topology() is topo
    # every group hybridpar makes waits as long as the topology says (torch's own default
    # for a new group is 30 minutes, whatever the world group has): the mesh's, and a tie's
    tied = hybridpar.HybridPipe(_tied_model(), [1, 1], topology=topo)
    groups = [topo.dp_group, topo.pp_group, topo.tp_group,
              *[g for g, _ in tied._ties.groups]]
    out["timeouts"] = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                       for g in groups]
    out["tie groups"] = len(tied._ties.groups)
    return out


def _tied_model():
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    return torch.nn.Sequential(emb, head)


def test_groups_hold_the_ranks_that_share_the_other_coordinates():
    results = hybridpar.spawn(_groups_worker, 8, timeout=90)
    for rank, out in enumerate(results):
        dp, pp, tp = out["coord"]
        assert out["dims"] == [2, 2, 2]
        assert out["timeout"] == 30
        assert out["tp"] == [(dp * 2 + pp) * 2 + t for t in range(2)]
        assert out["pp"] == [(dp * 2 + p) * 2 + tp for p in range(2)]
        assert out["dp"] == [(d * 2 + pp) * 2 + tp for d in range(2)]
        assert out["next_stage"] == (dp * 2 + (1 - pp)) * 2 + tp
        assert out["tie groups"] == 1 and out["timeouts"] == [30.0] * 4


def _bad_layout_worker():
    try:
        hybridpar.init(pp=3)
    except ValueError as e:
        return str(e)
    return "no error"


def test_bad_layout_is_reported_on_every_rank():
    messages = hybridpar.spawn(_bad_layout_worker, 4, timeout=60)
    assert all("world size 4 is not divisible by pp * tp = 3 * 1" in m for m in messages)


def test_timeout_accepts_seconds_and_timedelta():
    from hybridpar.topology import _as_timedelta

    assert _as_timedelta(5) == datetime.timedelta(seconds=5)
    assert _as_timedelta(datetime.timedelta(minutes=1)).total_seconds() == 60
    with pytest.raises(ValueError, match="timeout must be positive"):
        _as_timedelta(0)


def _expert_groups_worker():
    topo = hybridpar.init(dp=4, ep=2, timeout=30)
    out = {"ep": topo.ep, "ep_rank": topo.ep_rank}
    for name in ("ep", "expert_dp"):
        group = getattr(topo, f"{name}_group")
        members = [torch.zeros(1) for _ in range(dist.get_world_size(group))]
        dist.all_gather(members, torch.tensor([float(topo.rank)]), group=group)
        out[name] = [int(m.item()) for m in members]
    out["timeout"] = topo.ep_group._get_backend(
        torch.device("cpu")).options._timeout.total_seconds()
    return out


def test_ep_groups_are_blocks_of_dp_ranks_and_the_expert_dp_groups_their_columns():
    """dp 4, ep 2: ep groups {0, 1} {2, 3} (each holds every expert), expert dp groups
    {0, 2} {1, 3} (the same experts: their gradients summed)."""
    results = hybridpar.spawn(_expert_groups_worker, 4, timeout=90)
    assert [r["ep"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["expert_dp"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["ep_rank"] for r in results] == [0, 1, 0, 1]
    assert all(r["timeout"] == 30 for r in results)


def test_ep_must_divide_dp_naming_the_choices():
    with pytest.raises(ValueError, match=r"ep=3 does not divide dp=4: .* choose ep among "
                                         r"\[1, 2, 4\]"):
        ParallelDims(dp=4, ep=3)
    assert ParallelDims.for_world(8, pp=2, ep=2).ep == 2
    with pytest.raises(RuntimeError, match="no expert groups"):
        Topology(ParallelDims(dp=2), 0, None).ep_group
