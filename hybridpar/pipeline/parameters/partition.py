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
from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from hybridpar.keyed import KeyedInit, reset_of
from hybridpar.sharded.attrs import is_sharded_layer, tags_kept

__all__ = ["balance_problem", "check_balance", "check_sequential", "free_layers", "layer_spans",
           "materialize", "split", "stage_bounds"]

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
    if len({id(child) for child in module.children()}) != len(module._modules):
        # torchgpipe's error, word for word; a module used twice cannot live on two stages
        raise ValueError("module with duplicate children is not supported; give each place "
                         "its own module (copy.deepcopy), or wrap a shared one in a layer "
                         "that calls it twice")
    return module


def check_balance(module: nn.Sequential, balance: Sequence[int], stages: int, *,
                  unit: str = "pp") -> list[int]:
    """Validate `balance` for `module` over `stages` pipeline stages (torchgpipe's rules;
    `unit` names the stage count in the message: ``pp`` or ``pp * virtual_stages``)."""
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):  # list expected
        raise TypeError(f"balance must be a list of layer counts, got {balance!r}; "
                        f"{_BALANCE_HINT}")
    counts = list(balance)
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        raise TypeError(f"balance must hold integers, got {counts}; {_BALANCE_HINT}")
    problem = balance_problem(counts, stages, len(module), unit=unit)
    if problem is not None:
        raise ValueError(problem)
    return counts


def balance_problem(balance: Sequence[int], stages: int, layers: int, *,
                    name: str = "balance", model: str = "the model", unit: str = "pp"
                    ) -> str | None:
    """What is wrong with the layer counts `balance` for `stages` stages over `layers` layers,
    as one line that says how to fix it (None: nothing).

    The one rule `HybridPipe` (`check_balance`) and the config's ``parallel.balance`` share;
    `name` and `model` say which balance and which model the line is about.
    """
    counts = list(balance)
    problem = (f"has {len(counts)} stages but the pipeline has {unit}={stages}"
               if len(counts) != stages else
               "has a stage with no layer" if any(c < 1 for c in counts) else
               f"covers {sum(counts)} layers but {model} has {layers}"
               if sum(counts) != layers else None)
    if problem is None:
        return None
    return (f"{name} {counts} {problem}; give one layer count per stage ({unit}={stages}), each at "
            f"least 1, summing to the {layers} layers of {model}, or one of 'time', 'size', "
            "'params', 'uniform'")


def stage_bounds(balance: Sequence[int]) -> list[tuple[int, int]]:
    """The ``[start, stop)`` layer range of every stage."""
    bounds, start = [], 0
    for count in balance:
        bounds.append((start, start + count))
        start += count
    return bounds


def layer_spans(layers: Sequence[int]) -> str:
    """Ascending layer indices as runs: ``(0, 1, 4, 5)`` -> ``"0..1, 4..5"``."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}..{b}" for a, b in runs)


def split(module: nn.Sequential, balance: Sequence[int]) -> list[nn.Sequential]:
    """Every stage as an `nn.Sequential` that keeps the original child names."""
    names = list(module._modules.keys())
    layers = list(module.children())
    return [nn.Sequential(OrderedDict((names[i], layers[i]) for i in range(a, b)))
            for a, b in stage_bounds(balance)]


def free_layers(stages: Sequence[nn.Sequential], keep: Collection[int]) -> None:
    """Release the parameters and buffers of every stage not in `keep` (moved to `meta`)."""
    for index, stage in enumerate(stages):
        if index not in keep:
            stage.to("meta")


def materialize(stage: nn.Module, device: torch.device | str, *,
                init_fn: Callable[[nn.Module], None] | None = None) -> None:
    """Give a `meta`-built stage real storage on `device` and initialize every tensor.

    ``init_fn(module)`` is applied to every module, children first (as ``model.apply``),
    e.g. a Hugging Face model's ``model._init_weights``; without it each module's
    ``reset_parameters()`` (or ``_reset_parameters()``: `hybridpar.keyed.reset_of`). The tp
    layers a ``tp_plan`` put in (`ParallelLayer`, `sharded.attrs.is_sharded_layer`:
    `ParallelLinear`, `ParallelEmbedding`, ...) are not the layers a model's own initializer
    knows: one that `init_fn` left wholly untouched (every tensor of its own still all NaN)
    is drawn by its own ``reset_parameters()`` (the full plain layer's init, sliced);
    `hybridpar.hf.init_fn` draws them as Hugging Face would. Nothing may stay
    uninitialized:

    * without `init_fn`, a module holding parameters or buffers of its own and neither
      ``reset_parameters`` nor ``_reset_parameters`` is a `ValueError` before anything
      changes;
    * the new storage is filled with NaN first, and a floating tensor still holding a NaN
      after the initialization is a `ValueError` naming it (a buffer computed in
      ``__init__``, such as a rotary embedding's ``inv_freq``, that the initializer did not
      recompute; a tp layer `init_fn` drew only in part).
    """
    tensors = list(stage.parameters()) + list(stage.buffers())
    if not any(t.is_meta for t in tensors):
        return
    if init_fn is None or (isinstance(init_fn, KeyedInit) and init_fn.init is None):
        bare = [(name, sub) for name, sub in stage.named_modules() if _holds_tensors(sub)
                and reset_of(sub) is None]
        if bare:
            name, sub = bare[0]
            raise ValueError(
                f"module '{name}' ({type(sub).__name__}) holds parameters or buffers but has no "
                "reset_parameters(): built on the meta device it would keep uninitialized "
                "memory. Pass HybridPipe(..., init_fn=fn), a callable applied to every module "
                "(for a Hugging Face model: init_fn=model._init_weights, or "
                f"hybridpar.hf.init_fn(model)), or give {type(sub).__name__} a "
                "reset_parameters(); or build the model on a real device")
    holders: dict[int, list[tuple[nn.Module, str]]] = {}   # a tied Parameter's users
    for module in stage.modules():
        for key, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, key))
    with tags_kept(stage):
        stage.to_empty(device=device)
    for users in holders.values():   # to_empty gives each user its own copy: tie them again
        first_module, first_key = users[0]
        for module, key in users[1:]:
            module._parameters[key] = first_module._parameters[first_key]
    with torch.no_grad():
        for t in [*stage.parameters(), *stage.buffers()]:
            if t.is_floating_point() or t.is_complex():
                t.fill_(float("nan"))
        if init_fn is not None:
            if isinstance(init_fn, KeyedInit):   # it needs the modules' names
                init_fn.initialize(stage)
            else:
                stage.apply(init_fn)
            _reset_untouched_tp_layers(stage)
        else:
            for sub in stage.modules():
                reset = reset_of(sub)
                if reset is not None:
                    reset()  # nn.BatchNorm's covers its running statistics too
    for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
        if is_fake(t):   # a dry run (`hybridpar check`): no values to look at
            continue
        if (t.is_floating_point() or t.is_complex()) and bool(torch.isnan(t).any()):
            how = "init_fn" if init_fn is not None else "reset_parameters()"
            raise ValueError(
                f"'{name}' is not initialized after materializing the meta-built model with "
                f"{how} (it still holds the NaN it was filled with): make the initializer "
                "cover it (a buffer computed in __init__, like a rotary embedding's inv_freq, "
                "must be recomputed; a tp layer it draws must be drawn whole, or left to the "
                "layer's reset_parameters()), or build the model on a real device")


def _reset_untouched_tp_layers(stage: nn.Module) -> None:
    """``reset_parameters()`` of every tp layer whose own tensors all still hold only NaN
    (an `init_fn` that does not know the layer); one drawn in part is left to the NaN check."""
    for sub in stage.modules():
        if not is_sharded_layer(sub):
            continue
        own = [t for t in (*sub._parameters.values(), *sub._buffers.values())
               if t is not None and (t.is_floating_point() or t.is_complex())]
        if not own or any(is_fake(t) for t in own):   # a dry run: no values to look at
            continue
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset) and all(bool(torch.isnan(t).all()) for t in own):
            reset()


def _holds_tensors(module: nn.Module) -> bool:
    """Whether `module` has parameters or buffers of its own (not its children's)."""
    return any(t is not None for t in (*module._parameters.values(),
                                        *module._buffers.values()))
