"""The model zoo: builders by name, with each model's loss and a synthetic batch maker.

    name   builder   input                      target        loss
    gpt    gpt       (B, block_size) int64 ids   (B, block_size) next ids   gpt_loss
    mlp    mlp       (B, in_features) float      (B,) class ids             mlp_loss
    unet   unet      (B, in_channels, S, S)      (B,) class ids             unet_loss
                     S = 2 ** (depth + 2)

The synthetic batches are learnable (a fixed rule maps input to target), deterministic given
`seed`, and drawn from their own generator (the global RNG is left alone):
gpt: arithmetic sequences ``(start + t * step) % vocab_size``; mlp / unet: the argmax of a
fixed random linear "teacher" of the input (of its quadrant means, for images).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from hybridpar.models.gpt import gpt, gpt_loss
from hybridpar.models.mlp import mlp, mlp_loss
from hybridpar.models.sampling import generate
from hybridpar.models.unet import unet, unet_loss

__all__ = [
    "MODELS",
    "MODEL_LOSS",
    "build_model",
    "example_batch",
    "generate",
    "gpt",
    "gpt_loss",
    "loss_fn",
    "mlp",
    "mlp_loss",
    "unet",
    "unet_loss",
]

MODELS: dict[str, Callable[..., nn.Sequential]] = {"gpt": gpt, "mlp": mlp, "unet": unet}
MODEL_LOSS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "gpt": gpt_loss, "mlp": mlp_loss, "unet": unet_loss}

_TEACHER_SEED = 20240  # the fixed rule of the synthetic tasks, the same for every `seed`


def _check_name(name: str) -> None:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(sorted(MODELS))}")


def _config(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The model's keyword defaults updated by `kwargs` (unknown names raise TypeError)."""
    defaults = dict(MODELS[name].__kwdefaults__ or {})
    unknown = sorted(set(kwargs) - set(defaults))
    if unknown:
        raise TypeError(f"{name}() got unexpected options {unknown}; it takes "
                        f"{sorted(defaults)}")
    return {**defaults, **kwargs}


def build_model(name: str, **kwargs: Any) -> nn.Sequential:
    """Build model `name` of `MODELS` with its keyword options."""
    _check_name(name)
    return MODELS[name](**kwargs)


def loss_fn(name: str) -> Callable[[Tensor, Tensor], Tensor]:
    """The loss of model `name`: ``loss(output, target)`` -> mean scalar (a HybridPipe loss_fn)."""
    _check_name(name)
    return MODEL_LOSS[name]


def _gpt_batch(batch_size: int, g: torch.Generator, cfg: dict[str, Any]) -> tuple[Tensor, Tensor]:
    V, T = cfg["vocab_size"], cfg["block_size"]
    start = torch.randint(0, V, (batch_size, 1), generator=g)               # (B, 1)
    step = torch.randint(1, max(2, min(V, 8)), (batch_size, 1), generator=g)  # (B, 1)
    seq = (start + step * torch.arange(T + 1)) % V                          # (B, T + 1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()                # (B, T), (B, T)


def _mlp_batch(batch_size: int, g: torch.Generator, cfg: dict[str, Any]) -> tuple[Tensor, Tensor]:
    teacher = torch.randn(cfg["in_features"], cfg["out_features"],
                          generator=torch.Generator().manual_seed(_TEACHER_SEED))
    x = torch.randn(batch_size, cfg["in_features"], generator=g)             # (B, in)
    return x, (x @ teacher).argmax(dim=-1)                                  # (B,)


def _unet_batch(batch_size: int, g: torch.Generator, cfg: dict[str, Any]) -> tuple[Tensor, Tensor]:
    C, size = cfg["in_channels"], 2 ** (cfg["depth"] + 2)
    teacher = torch.randn(C * 4, cfg["classes"],
                          generator=torch.Generator().manual_seed(_TEACHER_SEED))
    x = torch.randn(batch_size, C, size, size, generator=g)                 # (B, C, S, S)
    quadrants = torch.nn.functional.adaptive_avg_pool2d(x, 2).flatten(1)   # (B, 4C)
    return x, (quadrants @ teacher).argmax(dim=-1)                          # (B,)


_BATCHES = {"gpt": _gpt_batch, "mlp": _mlp_batch, "unet": _unet_batch}


def example_batch(name: str, batch_size: int, *, seed: int = 0,
                  **model_kwargs: Any) -> tuple[Tensor, Tensor]:
    """A synthetic (input, target) batch for model `name` built with `model_kwargs`.

    The same (name, batch_size, seed, model_kwargs) give the same tensors on every call and
    every rank. Options of the model that do not shape the data (tp, dropout, ...) are
    accepted and ignored, so one config dict serves both `build_model` and this.
    """
    _check_name(name)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    cfg = _config(name, model_kwargs)
    return _BATCHES[name](batch_size, torch.Generator().manual_seed(seed), cfg)
