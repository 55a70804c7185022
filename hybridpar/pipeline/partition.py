"""Split an nn.Sequential into stages by a balance, keeping the layers' original names.

A stage is an `nn.Sequential` whose children keep their keys in the original model, so the
parameters of stage 1 of ``balance=[2, 3]`` are named ``"2.weight"``, ``"3.fc1.weight"``, ...:
the same names as in the unsplit model, whatever the layout (checkpoints and balance stay
independent of each other).

    model  | 0 1 2 3 4          balance [2, 3]
    stage  | 0 0 1 1 1          stage 1 = Sequential({"2": ..., "3": ..., "4": ...})
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["check_balance", "check_sequential", "free_layers", "materialize", "split",
           "stage_bounds"]

_BALANCE_HINT = ("give one layer count per stage, or use balance='time' / 'size' / 'params' / "
                 "'uniform' (hybridpar.balance_by_time, balance_by_size)")


def check_sequential(module: object) -> nn.Sequential:
    """`module` itself if it is an `nn.Sequential`, else a `TypeError` that says what to do."""
    if not isinstance(module, nn.Sequential):
        raise TypeError(
            f"HybridPipe needs an nn.Sequential, got {type(module).__name__}; "
            "express the model as nn.Sequential(layer, layer, ...) of its stages' layers"
        )
    if len(module) == 0:
        raise ValueError("the model is an empty nn.Sequential; give it at least one layer")
    return module


def check_balance(module: nn.Sequential, balance: Sequence[int], stages: int) -> list[int]:
    """Validate `balance` for `module` over `stages` pipeline stages (torchgpipe's rules)."""
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):  # list expected
        raise TypeError(f"balance must be a list of layer counts, got {balance!r}; "
                        f"{_BALANCE_HINT}")
    counts = list(balance)
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        raise TypeError(f"balance must hold integers, got {counts}; {_BALANCE_HINT}")
    if len(counts) != stages:
        raise ValueError(
            f"balance {counts} has {len(counts)} stages but the pipeline has pp={stages}; "
            f"{_BALANCE_HINT}"
        )
    if any(c < 1 for c in counts):
        raise ValueError(f"balance {counts} has a stage with no layer; every entry must be >= 1")
    if sum(counts) != len(module):
        raise ValueError(
            f"balance {counts} covers {sum(counts)} layers but the model has {len(module)}; "
            f"give counts that sum to {len(module)}, or use balance='time'"
        )
    return counts


def stage_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """The ``[start, stop)`` layer range of every stage."""
    bounds, start = [], 0
    for count in balance:
        bounds.append((start, start + count))
        start += count
    return bounds


def split(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Every stage as an `nn.Sequential` that keeps the original child names."""
    names = list(module._modules.keys())
    layers = list(module.children())
    return [nn.Sequential(OrderedDict((names[i], layers[i]) for i in range(a, b)))
            for a, b in stage_bounds(balance)]


def free_layers(stages: Sequence[nn.Sequential], keep: int) -> None:
    """Release the parameters and buffers of every stage but `keep` (moved to `meta`)."""
    for index, stage in enumerate(stages):
        if index != keep:
            stage.to("meta")


def materialize(stage: nn.Module, device: torch.device | str) -> None:
    """Give a `meta`-built stage real storage on `device` and initialize it (reset_parameters)."""
    tensors = list(stage.parameters()) + list(stage.buffers())
    if not any(t.is_meta for t in tensors):
        return
    stage.to_empty(device=device)
    for sub in stage.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()  # nn.BatchNorm's covers its running statistics too
    # A module without reset_parameters keeps uninitialized storage: such a model must be
    # built on a real device (the README says so).
