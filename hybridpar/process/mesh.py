"""The process groups of the parallel grid: one per row of each dim, each with the timeout.

`init_device_mesh` gives its groups torch's default timeout (30 minutes, whatever the world
group has), so the groups are made here: every rank creates every group of each dim, in the
same order (`new_group` is collective), and keeps its own. Ranks are laid out dp-major, tp
fastest: rank = (dp · pp + pp_rank) · tp + tp_rank.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["build_mesh", "expert_groups"]


def _own_groups(grid: torch.Tensor, dims: tuple[int, ...], rank: int,
                timeout: datetime.timedelta) -> list[ProcessGroup]:
    """Every group along each of `dims` of `grid` (ranks), created in order; `rank`'s."""
    mine: list[ProcessGroup] = []
    for dim in dims:
        rows = grid.movedim(dim, -1).reshape(-1, grid.shape[dim])   # the groups along `dim`
        for ranks in rows.tolist():
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                assert group is not None
                mine.append(group)
    return mine


def build_mesh(dp: int, pp: int, tp: int, rank: int, device_type: str, *,
               timeout: datetime.timedelta) -> DeviceMesh:
    """The ("dp", "pp", "tp") device mesh of `rank`, every group with `timeout`."""
    grid = torch.arange(dp * pp * tp).view(dp, pp, tp)
    mine = _own_groups(grid, (0, 1, 2), rank, timeout)
    return DeviceMesh.from_group(mine, device_type, mesh=grid, mesh_dim_names=("dp", "pp", "tp"))


def expert_groups(dp: int, ep: int, pp: int, tp: int, rank: int, *,
                  timeout: datetime.timedelta) -> tuple[ProcessGroup, ProcessGroup]:
    """`rank`'s (ep group, expert dp group): the dp ranks, at the same pp and tp, split into
    blocks of ep consecutive dp ranks (parallel folding: ep carved out of dp).

        dp = 4, ep = 2     dp ranks  0 1 | 2 3      experts held   0..E/2-1   E/2..E-1
        ep groups          {0, 1}  {2, 3}           (each holds every expert once)
        expert dp groups   {0, 2}  {1, 3}           (the same experts: gradients summed)
    """
    grid = torch.arange(dp * pp * tp).view(dp // ep, ep, pp, tp)
    ep_group, expert_dp_group = _own_groups(grid, (1, 0), rank, timeout)
    return ep_group, expert_dp_group
