"""gpu_check's check 8: every schedule on several devices, with skips over stages.

The P2P order of each schedule is what NCCL must progress (DESIGN §9); on CPU it is proven
by replaying the recorded groups under NCCL's rules. On GPUs this runs it for real: one
`hybridpar.spawn` per schedule (a deadlock fails that schedule alone, by timeout), pp ranks,
the skip model below split so that both skips cross stages, fp32 with TF32 off, against the
plain model on the rank's own device. Three SGD steps: two of 32 rows (the first sends
headers, the second payloads alone) and one of 29 (new shapes: headers again, uneven
micro-batches).

    the skip model (16 layers, width 64)      pp = 4, v = 1: 4 layers a stage
    0        Linear, stash "long"             long:  stage 0 -> stage 3 (over 1 and 2)
    1-4      Linear + tanh                    short: stage 1 -> stage 2
    5        stash "short" (2 x)              pp = 4, v = 2 (interleaved, ZBV): 2 layers a
    6-9      Linear + tanh                    stage, long 0 -> 7, short 2 -> 5
    10       pop "short", add
    11-14    Linear + tanh
    15       pop "long": Linear(x) + long
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torchgpipe.skip import pop, skippable, stash

import hybridpar

from .gpu import environment, norm_of, plain, relative_error

__all__ = ["LAYERS", "SCHEDULES", "schedule_rank", "skip_model"]

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
VIRTUAL = {"interleaved": 2, "zbv": 2}    # stages per rank; the others hold one
LAYERS, WIDTH = 16, 64
ROWS = (32, 32, 29)                         # the steps' batch sizes (29: new shapes, uneven)
LR = 0.1


@skippable(stash=["long"])
class StashLong(nn.Module):
    """Linear, then stash its output as "long"."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Any:
        x = self.fc(x)
        yield stash("long", x)
        return torch.tanh(x)


@skippable(stash=["short"])
class StashShort(nn.Module):
    """Stash twice the input as "short"; pass the input on."""

    def forward(self, x: Tensor) -> Any:
        yield stash("short", x * 2)
        return x


@skippable(pop=["short"])
class PopShort(nn.Module):
    """Add the popped "short"."""

    def forward(self, x: Tensor) -> Any:
        short = yield pop("short")
        return x + short


@skippable(pop=["long"])
class PopLong(nn.Module):
    """Linear, plus the popped "long"."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Any:
        long = yield pop("long")
        return self.fc(x) + long


def skip_model(seed: int = 0, width: int = WIDTH) -> nn.Sequential:
    """The 16-layer skip model of the table above (the same weights for the same seed)."""
    torch.manual_seed(seed)

    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(width, width), nn.Tanh())

    return nn.Sequential(StashLong(width), *(block() for _ in range(4)), StashShort(),
                         *(block() for _ in range(4)), PopShort(),
                         *(block() for _ in range(4)), PopLong(width))


def _batch(step: int, rows: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(rows, WIDTH, generator=gen), torch.randn(rows, WIDTH, generator=gen)


def schedule_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """One schedule on pp ranks (spawn target): losses and first-step gradient errors
    against the plain model on this rank's device."""
    # a step stuck that long is a hang: the watchdog (GPUs) or the bounded waits (gloo) then
    # name the first P2P operation that did not complete, before the launch times out
    topo = hybridpar.init(pp=cfg["pp"], timeout=cfg["hang_timeout"])
    torch.backends.cuda.matmul.allow_tf32 = False     # parity in true fp32
    torch.backends.cudnn.allow_tf32 = False
    device, schedule = topo.device, cfg["schedule"]
    stages = cfg["pp"] * VIRTUAL.get(schedule, 1)
    ref = skip_model().to(device)
    pipe = hybridpar.HybridPipe(skip_model(), [LAYERS // stages] * stages,
                                chunks=2 * cfg["pp"], topology=topo, schedule=schedule,
                                checkpoint="except_last", loss_fn=nn.functional.mse_loss)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses, ref_losses, errors = [], [], {}
    for step, rows in enumerate(ROWS):
        x, y = _batch(step, rows)
        ref_opt.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        ref_loss = nn.functional.mse_loss(ref(x.to(device)), y.to(device))
        ref_loss.backward()
        losses.append(float(pipe.train_step(x, y)))
        ref_losses.append(ref_loss.item())
        if step == 0:
            refs = dict(ref.named_parameters())
            whole = norm_of(p.grad for p in refs.values())
            errors = {name: float("inf") if p.grad is None else
                      relative_error(p.grad, refs[name].grad, whole)
                      for name, p in pipe.named_parameters()}
        ref_opt.step()
        opt.step()
    worst = max(errors, key=errors.__getitem__) if errors else None
    return plain({"rank": topo.rank, "environment": environment(device), "losses": losses,
                  "ref_losses": ref_losses, "grad_rel": errors[worst] if worst else 0.0,
                  "worst_param": worst, "params": len(errors), "stages": stages})
