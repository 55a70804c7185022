"""Shared harness for pipeline parity tests: models, data, the single-device reference."""

from __future__ import annotations

import torch
from torch import nn

import hybridpar


def mlp(seed: int = 0, width: int = 8, layers: int = 4, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for _ in range(layers - 1):
        blocks.append(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Dropout(dropout)))
    blocks.append(nn.Linear(width, 3))
    return nn.Sequential(*blocks)


MODELS = {"mlp": mlp}


def data(steps: int, batch: int, width: int = 8, classes: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(batch, width, generator=g) for _ in range(steps)]
    ys = [torch.randint(0, classes, (batch,), generator=g) for _ in range(steps)]
    return xs, ys


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=0.01)


def reference(model: nn.Sequential, xs, ys, *, optimizer: str = "sgd", chunks: int = 1):
    """The plain single-device run: losses per step and the final state dict."""
    opt = make_optimizer(optimizer, model.parameters())
    losses = []
    for x, y in zip(xs, ys):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def checked_step(pipe, x, y) -> float:
    """`pipe.train_step(x, y)`'s loss, then the replica check (`HybridPipe.check_replicas`):
    every copy of a replicated parameter (tp, dp, ties) equal in values and gradients."""
    loss = pipe.train_step(x, y).item()
    pipe.check_replicas()
    return loss


def pipe_worker(model_name: str, model_kwargs: dict, balance, layout, steps: int, batch: int,
                options: dict, optimizer: str = "sgd"):
    """Train the pipe for `steps` steps; returns losses and the consolidated state dict."""
    pp, tp, dp = layout
    topo = hybridpar.init(pp=pp, tp=tp, dp=dp, timeout=60)
    model = MODELS[model_name](**model_kwargs)
    pipe = hybridpar.HybridPipe(model, balance, topology=topo,
                                loss_fn=nn.functional.cross_entropy, **options)
    # a stage may hold no parameter at all (a lone StashShort); torch optimizers refuse that
    opt = make_optimizer(optimizer, list(pipe.parameters()) or [nn.Parameter(torch.zeros(1))])
    xs, ys = data(steps, batch * dp)
    losses = []
    rows = batch
    for x, y in zip(xs, ys):
        x = x[topo.dp_rank * rows:(topo.dp_rank + 1) * rows]
        y = y[topo.dp_rank * rows:(topo.dp_rank + 1) * rows]
        opt.zero_grad()
        losses.append(checked_step(pipe, x, y))
        opt.step()
    return {"losses": losses, "state": pipe.consolidated_state_dict()}


def attempt(fn) -> list[str]:
    """["ok", ""] when fn() returns, else [exception type name, message] (for a rank to
    report a failure to the test as a value)."""
    try:
        fn()
        return ["ok", ""]
    except Exception as e:  # recorded for the test to assert
        return [type(e).__name__, str(e)]


# a net whose skips jump over stages, with BatchNorm -----------------------------------------
from torchgpipe.skip import pop, skippable, stash  # noqa: E402


@skippable(stash=["long"])
class StashLong(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        x = self.fc(x)
        yield stash("long", x)
        return torch.tanh(x)


@skippable(stash=["short"])
class StashShort(nn.Module):
    def forward(self, x):
        yield stash("short", x * 2)
        return x


@skippable(pop=["short"])
class PopShort(nn.Module):
    def forward(self, x):
        short = yield pop("short")
        return x + short


@skippable(pop=["long"])
class PopLong(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        long = yield pop("long")
        return self.fc(x) + long


def skipnet(seed: int = 0, width: int = 8, batch_norm: bool = False,
            dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        StashLong(width),                                              # 0: stash long
        nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width)) if batch_norm
        else nn.Linear(width, width),                                  # 1
        StashShort(),                                                  # 2: stash short
        nn.Sequential(nn.Dropout(dropout), nn.Linear(width, width)),   # 3
        PopShort(),                                                    # 4: pop short
        PopLong(width),                                                # 5: pop long
        nn.Linear(width, 3),                                           # 6
    )


MODELS["skipnet"] = skipnet
