"""Selective recomputation for Hugging Face attention (``checkpoint = "selective"``).

A Hugging Face attention layer computes q, k, v, calls its model's attention function by
name (``config._attn_implementation``: ``"sdpa"``, ``"eager"``, ...) and projects the result.
`route_attention` renames the implementation ``"hybridpar_<name>"``, registered as the same
function wrapped in `hybridpar.recompute.recompute_core`, with the same mask function:

    config._attn_implementation   attention function                 mask
    "sdpa" -> "hybridpar_sdpa"    recompute_core(sdpa_attention_...)  sdpa's
    "eager" -> "hybridpar_eager"  recompute_core(the model's eager)   eager's

Outside ``checkpoint = "selective"`` `recompute_core` calls the function as it is, so the
numbers are the same in every mode; under it the softmax(QKᵀ)V of each layer is recomputed in
backward instead of kept (q, k, v are), where that saves memory: eager attention (it keeps
the (B, h, T, T) probabilities) and sdpa with attention dropout; fused sdpa without dropout
keeps only its output and log-sum-exp, so it runs as it is. The eager function is the
model's own module's (each family defines one). Flash and flex attention keep their names
(Hugging Face's code tests them) and are not recomputed.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from torch import nn

from hybridpar.recompute import recompute_core

__all__ = ["PREFIX", "ROUTED", "route_attention"]

PREFIX = "hybridpar_"
ROUTED = ("sdpa", "eager")   # the implementations wrapped


def route_attention(config: Any) -> None:
    """Point `config` (shared by the model's layers) at the wrapped implementation."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = config._attn_implementation or "eager"
    if impl not in ROUTED or (impl == "eager" and getattr(config, "reorder_and_upcast_attn",
                                                         False)):
        return      # flash / flex kernels keep their names (code paths test them), and so
        #            does GPT-2's upcast eager path: their attention is kept, not recomputed
    name = PREFIX + impl
    if name not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(name, functools.partial(_attention, impl))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    config._attn_implementation = name


def _attention(impl: str, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """`impl`'s attention function (the model's eager one by default), recomputed in
    backward under selective recomputation."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(module).__module__].eager_attention_forward
    inner = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager)
    if impl == "sdpa" and not kwargs.get("dropout"):   # fused: keeps no (B, h, T, T)
        return inner(module, *args, **kwargs)         # probabilities, nothing to gain
    return recompute_core(inner, module, *args, **kwargs)
