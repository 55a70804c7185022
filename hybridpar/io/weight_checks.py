"""Loaded weights checked: a float tensor's value comes from a float (never an integer or a
bool cast silently), and a parameter loads finite (never a NaN or an inf to train from).

    file dtype                      model tensor      loaded
    float of any width (F8..F64)    float             yes: converted (bf16 file, fp32 model)
    integer, bool                   float             no: `ValueError` naming the tensor
    anything                        integer / bool    yes: a buffer that is legitimately one
                                                      (a step count, a mask)

A check names the tensor and the file it came from, and what to do.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_finite", "check_kind", "is_float_name"]

# safetensors' dtype names (``get_slice(name).get_dtype()``) of floating tensors: F16, F32,
# F64, BF16, F8_E4M3, F8_E5M2, ... (integers are I* / U*, then BOOL and complex C*)
_FLOAT_PREFIXES = ("F", "BF")


def is_float_name(dtype: str) -> bool:
    """Whether a safetensors dtype name (``"F32"``, ``"BF16"``, ``"I32"``) is a float."""
    return dtype.upper().startswith(_FLOAT_PREFIXES)


def check_kind(name: str, source: str, dtype: torch.dtype | str, target: Tensor) -> None:
    """Refuse `name` of `source` (the file) with `dtype` (a torch dtype, or safetensors'
    name of one) into `target` if `target` is floating and `dtype` is not."""
    if not target.is_floating_point():
        return   # an integer or bool buffer takes what the file has (load_state_dict's rule)
    floating = is_float_name(dtype) if isinstance(dtype, str) else dtype.is_floating_point
    if floating:
        return
    shown = str(dtype).removeprefix("torch.")
    raise ValueError(
        f"{name} in {source} is {shown}, but the model's tensor is "
        f"{str(target.dtype).removeprefix('torch.')}: an integer or bool tensor is never "
        "cast into float weights; the file is not the weights of this model (a quantized "
        "or damaged checkpoint, or another tensor saved under this name): give the float "
        "weights it was made from")


_CHUNK = 1 << 22   # elements checked at once: a bool temporary of 4 MiB, whatever the tensor


def _all_finite(value: Tensor) -> bool:
    """``isfinite(value).all()`` in slices along dim 0, so that the check's temporary stays
    small next to a loader that holds one tensor at a time (an embedding of 1 GiB)."""
    if value.dim() == 0 or value.numel() <= _CHUNK:
        return bool(torch.isfinite(value).all())
    rows = max(1, _CHUNK // max(1, value.numel() // value.shape[0]))
    return all(bool(torch.isfinite(part).all()) for part in value.split(rows))


def check_finite(name: str, source: str, value: Tensor) -> None:
    """Refuse `name` of `source` if `value` (a floating tensor, or a tp slice of one) holds
    a NaN or an infinity."""
    if not value.is_floating_point() or _all_finite(value):
        return
    finite = torch.isfinite(value)
    nan = int(torch.isnan(value).sum())
    inf = value.numel() - int(finite.sum()) - nan
    found = ", ".join(f"{n} {what}" for n, what in ((nan, "NaN"), (inf, "inf")) if n)
    raise ValueError(
        f"{name} in {source} holds {found} of its {value.numel()} values (on this rank's "
        "part): training from non-finite weights gives NaN losses from step 1; the "
        "checkpoint was saved after training diverged, or is damaged: start from an "
        "earlier checkpoint or export")
