"""Layout-invariant initialization: each layer's values drawn from a seed keyed by its name.

A model built whole draws every layer from one random stream, so a layer's values depend on
every layer drawn before it; a rank that materializes only its stage (a `meta` build) would
draw other values. Keyed, each module that holds tensors of its own is reset with the random
generators seeded by (seed, its name in the model) and then put back as they were:

    module name (layout-free)     seed of its draw
    "0.tok"                       module_seed(seed, "0.tok")
    "3.attn.q"                    module_seed(seed, "3.attn.q")

so its values are the same whatever pp, tp, dp, balance, schedule or virtual stages, whether
the model was built whole on one device or only this rank's stage was materialized: a tp
layer's reset gets the slice of its full tensor's draw (`tensor_parallel.sliced_init`: on the
CPU without the full tensor, on a GPU one full layer at a time). The global
random state is the same afterwards as before, so dropout does not depend on what was drawn.
On a GPU the draws come from its generator: the same values in every GPU layout (a CPU build
of the same seed draws others).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

_M = TypeVar("_M", bound=nn.Module)

__all__ = ["KeyedInit", "keyed", "keyed_reset_", "module_seed", "reset_of", "reset_order"]


def module_seed(seed: int, name: str) -> int:
    """The seed of module `name`'s draw: 63 bits of sha256 of (seed, name)."""
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def reset_of(module: nn.Module) -> Callable[[], None] | None:
    """`module`'s own initializer: ``reset_parameters``, else ``_reset_parameters`` (the name
    `nn.MultiheadAttention` gives its own); None if it has neither."""
    for attr in ("reset_parameters", "_reset_parameters"):
        reset = getattr(module, attr, None)
        if callable(reset):
            return reset
    return None


def _default_reset(module: nn.Module) -> None:
    reset = reset_of(module)
    if reset is not None:
        reset()


def reset_order(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The submodules of `module` that own tensors, in the order `keyed_reset_` resets them:
    children before their parents (``module.apply``'s order)."""
    return [(name, sub) for name, sub in reversed(list(module.named_modules()))
            if [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]]


def keyed_reset_(module: nn.Module, seed: int, *,
                 init: Callable[[nn.Module], None] | None = None) -> None:
    """Reset every submodule of `module` that owns tensors (``init(m)``, default its own
    reset: `reset_of`), each under the seed keyed by its name. A `meta` module is left alone
    (nothing to draw).

    Children come before their parents, as ``module.apply`` has them: a parent's rule over
    its children (GPT-2's scaled projections, `nn.MultiheadAttention`'s reset) has the last
    word. A Parameter held by several modules (a tie) ends with the draw of its first holder
    in ``named_modules`` order, the tie's canonical owner (`pipeline.parameters.tied`).
    """
    reset = init if init is not None else _default_reset
    for name, sub in reset_order(module):
        tensors = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
        if all(t.is_meta for t in tensors):
            continue
        devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            _seed(module_seed(seed, name), gpu=bool(devices))
            reset(sub)


def _seed(seed: int, *, gpu: bool) -> None:
    """``torch.manual_seed(seed)`` for the generators a module's draw can use.

    On the CPU alone that is the CPU's generator. ``torch.manual_seed`` would also queue the
    seed for every accelerator not started yet (CUDA, XPU, MTIA), formatting the caller's
    stack for each, about 1 ms a call: a tenth of a small model's build, and a seed that
    `fork_rng` does not put back.
    """
    if gpu:
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def keyed(seed: int, module: _M) -> _M:
    """`module`, reset by `keyed_reset_` (a builder's last step: ``torch.manual_seed(s);
    gpt()`` gives the values every layout's meta build draws for seed s)."""
    keyed_reset_(module, seed)
    return module


class KeyedInit:
    """An ``init_fn`` for `HybridPipe` / `materialize` that resets keyed by (seed, name).

    `materialize` calls `initialize(stage)` (it needs the names, not one module at a time);
    `init`: the per-module initializer (default its own reset, `reset_of`), e.g. a Hugging Face
    model's ``_init_weights`` (`hybridpar.hf.init_fn`).
    """

    def __init__(self, seed: int, init: Callable[[nn.Module], None] | None = None) -> None:
        self.seed = int(seed)
        self.init = init

    def initialize(self, stage: nn.Module) -> None:
        keyed_reset_(stage, self.seed, init=self.init)

    def __call__(self, module: nn.Module) -> None:   # an init_fn by itself: unkeyed use
        (self.init or _default_reset)(module)
