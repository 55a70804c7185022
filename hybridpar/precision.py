"""Low-precision weights: the model's parameters cast, their gradients kept in float32.

With ``train.param_dtype = "bf16"`` the model's parameters are bf16 while their gradients
accumulate in float32, micro-batch after micro-batch: autograd's bf16 ``.grad`` of each
accumulation is added into a float32 tensor kept on the parameter as ``main_grad`` and then
dropped (`pipeline.parameters.reduce.GradBuckets`). Code that reads or scales gradients (clipping,
the dp / tp / tie sums, the replica check, the optimizer's master weights) goes through
`grad_of` and `set_grad`:

    parameter                   its gradient
    as trained (fp32, fp64)     p.grad
    low-precision weights       p.main_grad (float32); p.grad is None between accumulations

The float32 values the optimizer updates (master weights) live in `hybridpar.optim.master`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["MAIN_GRAD", "PARAM_DTYPES", "cast_parameters", "check_dtype_runs", "grad_of",
           "grad_or_zeros", "has_main_grad", "set_grad"]

#: ``train.param_dtype`` -> the dtype of the model's parameters (None: as built)
PARAM_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}

MAIN_GRAD = "main_grad"


def has_main_grad(param: nn.Parameter) -> bool:
    """Whether `param`'s gradient lives in ``param.main_grad`` (its weights are lower)."""
    return hasattr(param, MAIN_GRAD)


def grad_of(param: nn.Parameter) -> Tensor | None:
    """`param`'s accumulated gradient (``main_grad`` where it has one, else ``.grad``)."""
    return getattr(param, MAIN_GRAD) if hasattr(param, MAIN_GRAD) else param.grad


def grad_or_zeros(param: nn.Parameter) -> Tensor:
    """`param`'s gradient, or zeros of its shape and of the dtype its gradient has (float32
    for low-precision weights)."""
    grad = grad_of(param)
    if grad is not None:
        return grad
    dtype = torch.float32 if has_main_grad(param) else param.dtype
    return torch.zeros(param.shape, dtype=dtype, device=param.device)


def set_grad(param: nn.Parameter, grad: Tensor | None) -> None:
    """Make `grad` `param`'s accumulated gradient (where `grad_of` finds it)."""
    if hasattr(param, MAIN_GRAD):
        setattr(param, MAIN_GRAD, grad)
    else:
        param.grad = grad


def check_dtype_runs(dtype: torch.dtype, device: torch.device, *, what: str) -> None:
    """A `ValueError` naming `what` if `device` cannot compute in `dtype` (bf16 on a GPU
    before Ampere), or if `dtype` is not a low-precision weight dtype hybridpar trains."""
    if dtype not in {d for d in PARAM_DTYPES.values() if d is not None}:
        raise ValueError(f"{what}: {dtype} weights are not supported; use torch.bfloat16 "
                         "(float16 weights need loss scaling, which hybridpar does not do)")
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"{what}: {torch.cuda.get_device_name(device)} (compute capability "
                         f"{major}.{minor}) has no bf16 arithmetic (it needs 8.0, Ampere or "
                         "later); train in fp32 (train.precision and train.param_dtype "
                         "'fp32')")


@torch.no_grad()
def cast_parameters(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast every floating-point parameter of `module` to `dtype` in place (the same
    Parameter objects, so hooks and ties stay); buffers keep theirs."""
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
