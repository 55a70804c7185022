"""A small U-Net classifier built of torchgpipe @skippable layers: long skips and BatchNorm.

depth=2 (c = channels), 7 layers; the skips jump over the layers between their ends, so a
pipeline split puts `stash` and `pop` on different stages:

    index  layer        shape out            skip
    0      Stem         (N, c, H, W)
    1      Down 0       (N, 2c, H/2, W/2)     stash level 0 (its input)  ─────────┐
    2      Down 1       (N, 4c, H/4, W/4)     stash level 1 ──────────┐           │
    3      Bottleneck   (N, 4c, H/4, W/4)                              │           │
    4      Up 1         (N, 2c, H/2, W/2)     pop level 1  <──────────┘           │
    5      Up 0         (N, c, H, W)          pop level 0  <──────────────────────┘
    6      Classifier   (N, classes)          global average pool + Linear

Each Down / Up pair shares a `Namespace` (``isolate``), as a torchgpipe user writes it, so
every level may use the skip name "skip". Any H, W work (Up resizes to its skip's size).
"""

from __future__ import annotations

from collections.abc import Generator

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchgpipe.skip import Namespace, pop, skippable, stash
from torchgpipe.skip.skippable import Skippable

from hybridpar.keyed import keyed

__all__ = ["Bottleneck", "Classifier", "Down", "Stem", "Up", "unet", "unet_loss"]

SkipGenerator = Generator[stash | pop, Tensor | None, Tensor]


def _conv_bn_relu(in_channels: int, out_channels: int, *, batch_norm: bool) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=not batch_norm),
        nn.BatchNorm2d(out_channels) if batch_norm else nn.Identity(),
        nn.ReLU(),
    )


def _isolate(layer: nn.Module, ns: Namespace) -> nn.Module:
    """`layer.isolate(ns)` (a helper: mypy does not see the class @skippable returns)."""
    assert isinstance(layer, Skippable)
    return layer.isolate(ns)


class Stem(nn.Module):
    """Conv-BN-ReLU from the image channels: (N, C_in, H, W) -> (N, c, H, W)."""

    def __init__(self, in_channels: int, channels: int, *, batch_norm: bool = True) -> None:
        super().__init__()
        self.conv = _conv_bn_relu(in_channels, channels, batch_norm=batch_norm)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)                                       # (N, c, H, W)


@skippable(stash=["skip"])
class Down(nn.Module):
    """Stash the input for the matching Up, then max-pool and Conv-BN-ReLU to `out_channels`."""

    def __init__(self, in_channels: int, out_channels: int, *, batch_norm: bool = True) -> None:
        super().__init__()
        self.conv = _conv_bn_relu(in_channels, out_channels, batch_norm=batch_norm)

    def forward(self, x: Tensor) -> SkipGenerator:
        yield stash("skip", x)                                    # (N, C, H, W)
        return self.conv(F.max_pool2d(x, 2, ceil_mode=True))     # (N, 2C, ⌈H/2⌉, ⌈W/2⌉)


class Bottleneck(nn.Module):
    """Conv-BN-ReLU at the coarsest resolution, channels kept."""

    def __init__(self, channels: int, *, batch_norm: bool = True) -> None:
        super().__init__()
        self.conv = _conv_bn_relu(channels, channels, batch_norm=batch_norm)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


@skippable(pop=["skip"])
class Up(nn.Module):
    """Pop the matching Down's input, upsample to its size, concatenate, Conv-BN-ReLU."""

    def __init__(self, in_channels: int, skip_channels: int, out_channels: int, *,
                 batch_norm: bool = True) -> None:
        super().__init__()
        self.conv = _conv_bn_relu(in_channels + skip_channels, out_channels,
                                  batch_norm=batch_norm)

    def forward(self, x: Tensor) -> SkipGenerator:
        skip = yield pop("skip")                                  # (N, C_s, H, W)
        assert skip is not None
        x = F.interpolate(x, size=skip.shape[-2:], mode="nearest")   # (N, C_in, H, W)
        return self.conv(torch.cat([x, skip], dim=1))             # (N, C_out, H, W)


class Classifier(nn.Module):
    """Global average pool and a Linear: (N, c, H, W) -> logits (N, classes)."""

    def __init__(self, channels: int, classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x.mean(dim=(2, 3)))                        # (N, classes)


def unet(*, channels: int = 8, depth: int = 2, in_channels: int = 3, classes: int = 10,
         batch_norm: bool = True) -> nn.Sequential:
    """A U-Net classifier of ``2 * depth + 3`` layers: images (N, C_in, H, W) -> (N, classes).

    Level i's Down stashes its input (c * 2**i channels) and its Up pops it, so the skips
    are nested: level 0's spans every layer but the stem and the classifier.
    """
    for name, value in (("channels", channels), ("depth", depth),
                        ("in_channels", in_channels), ("classes", classes)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"unet: {name} must be a positive integer, got {value!r}")
    widths = [channels * 2 ** i for i in range(depth + 1)]        # c, 2c, ..., 2**depth c
    levels = [Namespace() for _ in range(depth)]
    layers: list[nn.Module] = [Stem(in_channels, channels, batch_norm=batch_norm)]
    for i in range(depth):
        layers.append(_isolate(Down(widths[i], widths[i + 1], batch_norm=batch_norm), levels[i]))
    layers.append(Bottleneck(widths[depth], batch_norm=batch_norm))
    for i in reversed(range(depth)):
        layers.append(_isolate(Up(widths[i + 1], widths[i], widths[i], batch_norm=batch_norm),
                               levels[i]))
    layers.append(Classifier(channels, classes))
    return keyed(torch.initial_seed(), nn.Sequential(*layers))


def unet_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy of logits (N, classes) and class ids (N,)."""
    return F.cross_entropy(logits, target)
