"""What Hugging Face applies outside the modules: input scales, embedding dropout, logit post-ops.

A causal LM's forward does a few things that no module does: they live in the ``forward`` of
the trunk or of the causal LM, keyed by config attributes. `to_sequential` keeps them in two
small layers, `InputLayer` (after the embedding) and `LogitsLayer` (after the head), from this
registry: an entry applies when its attribute is set on the config.

    attribute                 where    op                          families
    embedding_multiplier      input    x * m                       Granite
    embedding_dropout         input    dropout(x, p)               StarCoder2
    final_logit_softcapping   logits   c * tanh(x / c)             Gemma 2, Gemma 3
    logits_scaling            logits   x / s                       Granite
    logit_scale               logits   x * s                       Cohere, Cohere 2

What lives in a module is not glue: Gemma's ``sqrt(D)`` scale is its embedding subclass's
(``embed_scale``), Phi's and GPT-NeoX's dropouts are trunk modules their pp plans name. A
family whose glue is missing here is not silently different: the parity probe
(`hf.probe`) compares `to_sequential` with the model's own forward and refuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from hybridpar.hf.structure import config_value
from hybridpar.sharded.attrs import get_parallel_dim, register_parallel_dim

__all__ = ["GLUE", "Glue", "InputLayer", "LogitsLayer", "glue_of"]


@dataclass(frozen=True)
class Glue:
    """One operation of Hugging Face's forward outside its modules, set by a config attribute."""

    attribute: str
    where: str                                           # "input" or "logits"
    op: Callable[[Tensor, float, bool], Tensor]          # (x, the attribute's value, training)


def _softcap(x: Tensor, cap: float, training: bool) -> Tensor:
    return torch.tanh(x / cap) * cap


GLUE: tuple[Glue, ...] = (
    Glue("embedding_multiplier", "input", lambda x, m, training: x * m),
    Glue("embedding_dropout", "input",
         lambda x, p, training: nn.functional.dropout(x, p, training=training)),
    Glue("final_logit_softcapping", "logits", _softcap),
    Glue("logits_scaling", "logits", lambda x, s, training: x / s),
    Glue("logit_scale", "logits", lambda x, s, training: x * s),
)


def glue_of(config: Any, where: str, *, glue: Sequence[Glue] = GLUE) -> list[tuple[Glue, float]]:
    """The entries of `glue` at `where` that `config` sets, with their values."""
    found = []
    for entry in glue:
        value = config_value(config, entry.attribute)
        if entry.where == where and value is not None:
            found.append((entry, float(value)))
    return found


class _GlueLayer(nn.Module):
    """Modules run in order, then the glue; the output keeps a tp shard's tag."""

    def __init__(self, modules: dict[str, nn.Module], glue: list[tuple[Glue, float]]) -> None:
        super().__init__()
        for name, module in modules.items():
            self.add_module(name, module)
        self.glue = glue

    def forward(self, x: Tensor) -> Tensor:
        for module in self.children():
            x = module(x)
        dim = get_parallel_dim(x)          # elementwise: a vocab / sequence shard stays one
        for entry, value in self.glue:
            x = entry.op(x, value, self.training)
        if dim is not None and get_parallel_dim(x) != dim:
            register_parallel_dim(x, dim)
        return x

    def extra_repr(self) -> str:
        return ", ".join(f"{e.attribute}={v}" for e, v in self.glue)


class InputLayer(_GlueLayer):
    """The trunk's modules before the blocks (the embedding, Phi's dropout), then the input
    glue: ``(B, T)`` ids -> ``(B, T, D)``; children keep their Hugging Face names."""


class LogitsLayer(_GlueLayer):
    """The head, then the logit glue (soft-capping, a scale): ``(B, T, D)`` -> ``(B, T, V)``."""
