"""gpu_check's check 8: every schedule on several devices, with skips over stages.

The P2P order of each schedule is what NCCL must progress (DESIGN §9); on CPU it is proven
by replaying the recorded groups under NCCL's rules. On GPUs this runs it for real: one
`hybridpar.spawn` per schedule (a deadlock fails that schedule alone), pp ranks, the model
zoo's U-Net of depth 3 without BatchNorm (9 layers; nested @skippable skips, each from a
Down to its Up), in float64 (so that only a wrong message, never a summation order, can
move the numbers: the convolutions' fp32 micro-batch sums alone differ by ~5e-5), against
the plain model on the rank's own device. Three
SGD steps: two of 32 rows (the first sends headers, the second payloads alone) and one of 29
(new shapes: headers again, uneven micro-batches).

    stages  balance                   skips (layer -> layer: stage -> stage)
    2       [5, 4]                    1 -> 7, 2 -> 6, 3 -> 5: all 0 -> 1
    4       [3, 2, 2, 2]              1 -> 7: 0 -> 3 (over 1 and 2), 2 -> 6: 0 -> 2, 3 -> 5: 1 -> 2
    8       [2, 1, 1, 1, 1, 1, 1, 1]  (pp 4 x v 2) 1 -> 7: 0 -> 6, 2 -> 6: 1 -> 5, 3 -> 5: 2 -> 4
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

import hybridpar
from hybridpar.models import example_batch, unet, unet_loss

from .gpu import environment, plain, side_by_side

__all__ = ["MODEL", "SCHEDULES", "schedule_balance", "schedule_rank"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
VIRTUAL = {"interleaved": 2, "zbv": 2}    # stages per rank; the others hold one
MODEL = {"depth": 3, "channels": 4, "batch_norm": False}   # 2 * 3 + 3 = 9 layers
ROWS = (32, 32, 29)                         # the steps' batch sizes (29: new shapes, uneven)
LR = 0.1


def schedule_balance(stages: int, layers: int = 2 * MODEL["depth"] + 3) -> list[int]:
    """`layers` over `stages`, the first stages one more when it does not divide."""
    return [layers // stages + (k < layers % stages) for k in range(stages)]


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return unet(**MODEL).double()


def _batches() -> Iterator[tuple[Tensor, Tensor]]:
    """The steps' (images, class ids), the images in float64."""
    for step, rows in enumerate(ROWS):
        x, y = example_batch("unet", rows, seed=100 + step, **MODEL)
        yield x.double(), y


def schedule_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """One schedule on pp ranks (spawn target): losses and first-step gradient errors
    against the plain model on this rank's device."""
    # a step stuck that long is a hang: the watchdog (GPUs) or the bounded waits (gloo) then
    # name the first P2P operation that did not complete, before the launch times out
    topo = hybridpar.init(pp=cfg["pp"], timeout=cfg["hang_timeout"])
    schedule = cfg["schedule"]
    stages = cfg["pp"] * VIRTUAL.get(schedule, 1)
    ref = _model().to(topo.device)
    pipe = hybridpar.HybridPipe(_model(), schedule_balance(stages), chunks=2 * cfg["pp"],
                                topology=topo, schedule=schedule, checkpoint="except_last",
                                loss_fn=unet_loss)
    result = side_by_side(pipe, ref, (torch.optim.SGD(pipe.parameters(), lr=LR),
                                      torch.optim.SGD(ref.parameters(), lr=LR)),
                          _batches(), unet_loss, topo)
    return plain({"rank": topo.rank, "environment": environment(topo.device), **result,
                  "stages": stages})
