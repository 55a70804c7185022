"""A config's ``model.name``: the zoo's models, Hugging Face families, or a user's builder.

    model.name                   builder                                     returns
    "gpt" | "mlp" | "unet"       `hybridpar.models.MODELS[name]`             nn.Sequential
    "hf:llama" | "hf:gpt2" ...   `hybridpar.models.hf.FAMILIES[family]`      (Sequential, loss)
    "hf:<any model type>"        `hybridpar.models.hf.any_family(type)`      (Sequential, loss)
    "package.module:function"    the user's function, imported               (Sequential, loss)

The builder's keyword-only options are the ``[model]`` keys. Every builder but mlp and unet
trains on tokens (``data.source = "corpus"`` or ``"text"``: input ids (B, T) and the next
ids as target); the zoo's models also have synthetic batches.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

__all__ = ["LossFn", "build", "builder", "has_synthetic_data", "is_zoo", "takes_tokens"]

LossFn = Callable[[Tensor, Tensor], Tensor]


def is_zoo(name: str) -> bool:
    """Whether `name` is one of `hybridpar.models.MODELS` (gpt, mlp, unet)."""
    from hybridpar.models import MODELS

    return name in MODELS


def _describe_choices() -> str:
    from hybridpar.models import MODELS
    from hybridpar.models.hf import FAMILIES

    return (", ".join(sorted(MODELS)) + ", " + ", ".join(f"hf:{f}" for f in FAMILIES)
            + ", hf:<another model type of transformers>, or 'package.module:function' (your "
            "builder returning (nn.Sequential, loss))")


def builder(name: str) -> Callable[..., Any]:
    """The function that builds model `name` (a `ValueError` naming the choices if none)."""
    from hybridpar.models import MODELS
    from hybridpar.models.hf import FAMILIES, any_family

    if not isinstance(name, str) or not name:
        raise ValueError(f"unknown model {name!r}; choose one of {_describe_choices()}")
    if name in MODELS:
        return MODELS[name]
    if name.startswith("hf:"):
        family = name.removeprefix("hf:")
        return FAMILIES[family] if family in FAMILIES else any_family(family)
    where, sep, attr = name.partition(":")
    if not sep or not where or not attr:
        raise ValueError(f"unknown model {name!r}; choose one of {_describe_choices()}")
    if os.getcwd() not in sys.path:   # as `python -m` does: modules of the working directory
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(where)
    except ImportError as e:
        raise ValueError(f"model {name!r}: cannot import module {where!r} ({e}); it must be "
                         "importable from the working directory or the environment") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"model {name!r}: module {where!r} has no function {attr!r}")
    return fn


def build(name: str, **options: Any) -> tuple[nn.Sequential, LossFn]:
    """Model `name` built with `options`, and its loss ``loss(output, target)``."""
    from hybridpar.models import MODEL_LOSS, MODELS

    if name in MODELS:
        return MODELS[name](**options), MODEL_LOSS[name]
    result = builder(name)(**options)
    if not (isinstance(result, tuple) and len(result) == 2
            and isinstance(result[0], nn.Sequential) and callable(result[1])):
        raise TypeError(f"model {name!r} returned {type(result).__name__}; a builder returns "
                        "(nn.Sequential, loss_fn), loss_fn(output, target) -> a mean scalar")
    return result[0], result[1]


def takes_tokens(name: str) -> bool:
    """Whether model `name` trains on token ids (``data.source = "corpus"`` / ``"text"``)."""
    return name not in ("mlp", "unet")


def has_synthetic_data(name: str) -> bool:
    """Whether ``data.source = "synthetic"`` has batches for model `name` (the zoo's only)."""
    return is_zoo(name)
