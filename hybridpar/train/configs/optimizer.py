"""The optimizer a config's [optim] names: its class, the options its constructor takes, and a
check before any worker starts that it can step a rank's shard at the run's ZeRO level."""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any

import torch

from hybridpar.optim.zero import check_shardable

if TYPE_CHECKING:   # config.py calls check_optim: the types only, not a cycle at run time
    from hybridpar.train.configs.config import Config, Where
    from hybridpar.train.configs.sections import OptimConfig

__all__ = ["OPTIMIZERS", "check_optim", "optimizer_class", "optimizer_options"]

#: the short names of optim.name; any other optimizer: "package.module:Class"
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}
# [optim] keys handed to the constructor when it takes them (weight_decay goes per group)
_OPTIONS = ("betas", "eps", "momentum", "nesterov")


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class of optim.name `name`; a `ValueError` saying what to give else."""
    if name in OPTIMIZERS:
        return OPTIMIZERS[name]
    valid = f"give one of {', '.join(OPTIMIZERS)} or a class as 'package.module:Class'"
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"unknown optimizer {name!r}; {valid}")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import optimizer {name!r}: {e}; {valid}") from None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"{name!r} is {cls!r}, not a torch.optim.Optimizer class; {valid}")
    return cls


def _takes(cls: type[torch.optim.Optimizer]) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters)


def optimizer_options(optim: OptimConfig, cls: type[torch.optim.Optimizer]) -> dict[str, Any]:
    """The [optim] keys `cls`'s constructor takes, as it takes them (betas a tuple); a
    `ValueError` naming a key set away from its default that `cls` does not take."""
    from hybridpar.train.configs.sections import OptimConfig

    takes, default = _takes(cls), OptimConfig()
    out: dict[str, Any] = {}
    for name in (*_OPTIONS, "weight_decay"):
        value = getattr(optim, name)
        if name in takes:
            if name != "weight_decay":
                out[name] = tuple(value) if name == "betas" else value
        elif value != getattr(default, name):
            raise ValueError(f"optim.{name} = {value!r}, but {cls.__name__} takes no {name}: "
                             f"remove it, or choose an optimizer that has it")
    return out


def _steps_without_closure(cls: type[torch.optim.Optimizer]) -> bool:
    closure = inspect.signature(cls.step).parameters.get("closure")
    return closure is None or closure.default is not inspect.Parameter.empty


def check_optim(config: Config, where: Where) -> None:
    """Raise `where.error` if [optim] cannot train: an unknown or unimportable class, state a
    checkpoint cannot hold (not tensors), betas that are not two numbers, a key the class
    does not take, a step that needs a closure (the trainer steps without one), state that
    ZeRO cannot shard, or options the class refuses (it is built and stepped once over a
    two-element parameter, as every rank will build it over its shard)."""
    optim, name = config.optim, config.optim.name
    try:
        cls = optimizer_class(name)
    except ValueError as e:
        raise where.error(f"optim.name: {e}", "optim.name") from None
    if not _steps_without_closure(cls):
        raise where.error(f"optim.name = {name!r}: {cls.__name__}.step needs a closure that "
                          "re-evaluates the loss, which the trainer's step does not give; "
                          "choose an optimizer that steps on the gradients alone (adamw, "
                          "adam, sgd)", "optim.name")
    if len(optim.betas) != 2:
        raise where.error(f"optim.betas must be two numbers (the first and second moments' "
                          f"decay rates), got {optim.betas!r}", "optim.betas")
    try:
        options = optimizer_options(optim, cls)
    except ValueError as e:
        raise where.error(str(e), str(e).split(" ", 1)[0]) from None   # "optim.<key> = ..."
    if config.parallel.zero:
        try:
            check_shardable(cls)
        except ValueError as e:
            raise where.error(f"optim.name = {name!r} with parallel.zero = "
                              f"{config.parallel.zero}: {e}", "optim.name",
                              "parallel.zero") from None
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.full((2,), 0.5)
    group: dict[str, Any] = {"params": [weight]}
    if "weight_decay" in _takes(cls):
        group["weight_decay"] = optim.weight_decay
    try:
        made: Any = cls   # a subclass's constructor takes lr; Optimizer's own takes defaults
        probe = made([group], lr=config.train.lr, **options)
        probe.step()
    except Exception as e:   # a user's class may raise anything: one line, before the workers
        raise where.error(f"optim.name = {name!r}: {cls.__name__} refuses these options "
                          f"({', '.join(f'{k}={v!r}' for k, v in options.items())}): "
                          f"{type(e).__name__}: {e}", "optim.name",
                          *[f"optim.{k}" for k in options]) from None
    kept = {k: type(v).__name__ for k, v in probe.state[weight].items()
            if v is not None and not isinstance(v, torch.Tensor)}
    if kept:   # a checkpoint holds tensors (train/checkpoints/shards.py)
        raise where.error(f"optim.name = {name!r}: {cls.__name__} keeps state that is not a "
                          f"tensor ({', '.join(f'{k}: {t}' for k, t in kept.items())}), which "
                          "a checkpoint cannot hold; choose an optimizer whose state is "
                          "tensors (adamw, adam, sgd)", "optim.name")
