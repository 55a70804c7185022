"""The run's model as a worker and `hybridpar balance` build it: on `meta`, with its initializer.

    model                          built            initializer of a stage (or profiled layer)
    the zoo (gpt, mlp, unet)       on meta          KeyedInit(train.seed): reset_parameters,
                                                    keyed by name
    hf:<family>                    on meta          KeyedInit(train.seed, Hugging Face's draws)
    hf:<family>, model.pretrained  on meta          zeros and rotary buffers, then the
                                                    checkpoint's slices (`build_pipe`)
    "package.module:function"      whole, on CPU    None: the builder's own values (its
                                                    initialization would be lost on meta)

Keyed (`hybridpar.keyed`), every layout draws the values of the model built whole on one
device from the same seed, and a rank draws only what it keeps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hybridpar.keyed import KeyedInit
from hybridpar.models import MODELS
from hybridpar.models.registry import LossFn, build
from hybridpar.train.config import Config

__all__ = ["BuiltModel", "build_model"]

BuiltModel = tuple[nn.Sequential, LossFn, Callable[[nn.Module], None] | None]


def build_model(config: Config, **extra: Any) -> BuiltModel:
    """(model, loss, init_fn) of `config`'s model with the options `extra` added (``tp``,
    ``group``); the model on `meta` when `init_fn` is not None."""
    name = config.model.name
    args = {**config.model.args, **extra}
    pretrained = args.get("pretrained") if name.startswith("hf:") else None
    on_meta = pretrained is not None or name in MODELS or name.startswith("hf:")
    with torch.device("meta") if on_meta else contextlib.nullcontext():
        model, loss = build(name, **args)
    init: Callable[[nn.Module], None] | None = None
    if pretrained is not None:
        from hybridpar.hf import init_for_loading

        init = init_for_loading
    elif name.startswith("hf:"):
        from hybridpar.hf import config_of, init_fn

        init = KeyedInit(config.train.seed, init=init_fn(config_of(model)))
    elif on_meta:
        init = KeyedInit(config.train.seed)
    return model, loss, init
