"""The run's model as a worker and `hybridpar balance` build it: on `meta`, with its initializer.

    model                          model.init  built            initializer of a stage (or
                                                                profiled layer)
    the zoo (gpt, mlp, unet)       "keyed"     on meta          KeyedInit(train.seed):
                                                                reset_parameters, keyed by name
    hf:<family>                    "keyed"     on meta          KeyedInit(train.seed, Hugging
                                                                Face's draws)
    hf:<family>, model.pretrained  "keyed"     on meta          zeros and rotary buffers, then
                                                                the checkpoint's slices
                                                                (`build_pipe`)
    "package.module:function"      "keyed"     on meta,         KeyedInit(train.seed), as the
                                               checked first    zoo's
    any of them                    "full"      whole, on CPU    None: the builder's own values
                                                                from train.seed

Keyed (`hybridpar.keyed`), every layout draws the values of the model built whole on one
device from the same seed, and a rank draws only what it keeps. A user's builder is checked
first, on the meta model (`builder_check`, no storage): a `MetaBuildError` if its modules'
resets would not set every tensor as the builder does (its own initialization would be
lost), naming both fixes: a ``reset_parameters()``, or ``model.init = "full"``, the opt-out
with which every rank builds the whole model, as before meta builds.

With ``data.pack = "documents"`` the model is made to take (ids, document positions)
(`models.packing.pack_documents`: no parameter, name or value changes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hybridpar.keyed import KeyedInit
from hybridpar.models.registry import LossFn, build, is_zoo
from hybridpar.train.configs.builder_check import build_checked
from hybridpar.train.configs.config import Config

__all__ = ["BuiltModel", "build_model"]

BuiltModel = tuple[nn.Sequential, LossFn, Callable[[nn.Module], None] | None]


def build_model(config: Config, **extra: Any) -> BuiltModel:
    """(model, loss, init_fn) of `config`'s model with the options `extra` added (``tp``,
    ``group``); the model on `meta` when `init_fn` is not None."""
    model, loss, init = _build_model(config, **extra)
    if config.data.pack == "documents":
        from hybridpar.models.packing import pack_documents

        pack_documents(model)
    return model, loss, init


def _build_model(config: Config, **extra: Any) -> BuiltModel:
    name = config.model.name
    args = {**config.model.args, **extra}
    if config.model.init == "full":   # whole, on the CPU: the caller seeded the draws
        model, loss = build(name, **args)
        return model, loss, None
    if not (is_zoo(name) or name.startswith("hf:")):   # a user's builder: checked on meta
        model, loss = build_checked(name, lambda: build(name, **args))
        return model, loss, KeyedInit(config.train.seed)
    with torch.device("meta"):
        model, loss = build(name, **args)
    init: Callable[[nn.Module], None]
    if args.get("pretrained") is not None and name.startswith("hf:"):
        from hybridpar.hf import init_for_loading

        init = init_for_loading
    elif name.startswith("hf:"):
        from hybridpar.hf import config_of, init_fn

        init = KeyedInit(config.train.seed, init=init_fn(config_of(model)))
    else:
        init = KeyedInit(config.train.seed)
    return model, loss, init
