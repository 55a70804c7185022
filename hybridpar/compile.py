"""Regional compilation: each repeated block of a stage compiled once with `torch.compile`.

A stage is an `nn.Sequential` of layers; most of its time goes to the blocks a model repeats
(a GPT's `Block` × n_layer). `compile_blocks` compiles those in place, as
``nn.Module.compile()`` does (the layer's ``_compiled_call_impl``, here guarded by a fallback),
and leaves the rest eager:

    layer of the stage                              compiled   why
    a class holding parameters, ≥ 2 in the model    yes        the repeated compute (gpt's
      (gpt's Block, mlp's MLPBlock, unet's Down)               Block): compiled once, reused
    a class that occurs once (Embeddings, Head,     no         one layer: little to fuse, a
      the final LayerNorm)                                     compile of its own
    a layer without parameters (ReLU, a skip)       no         nothing worth a compile

One compile per class, not per layer: dynamo keys its cache on the code of ``forward`` and
inlines the layer's own modules, its parameters are graph inputs (not constants), so every
`Block` of a stage, and every micro-batch and step, runs the same compiled code. Frames
compiled on a rank (`torch._dynamo.utils.counters`; tests/test_compile.py asserts them):

    gpt's Blocks on a stage (tp = 1)                frames
    train_step, checkpoint "never"                  1, for every Block of the stage
    checkpoint "always" / "except_last"             2: the no_grad forward, the recompute
    a micro-batch with fewer rows (uneven split)    +1 (that dim made dynamic, once)
    later micro-batches and steps                   +0

``dynamic=None`` (torch's default) compiles static shapes first and marks a dim dynamic only
when a second size arrives: the rows of an uneven last micro-batch.

Where a block's graph breaks (dynamo runs that call eager and compiles the code around it,
in one frame per piece: ``nested_graph_breaks`` while a block runs):

    inside a block                 why it breaks                   what is compiled
    tp collectives                 `sharded.mappings`      the code between the
    (`copy_to_group`, ...)         counts each collective on the   collectives (a gpt Block
                                   host (`hybridpar.comm_stats`)   at tp=2: 6 frames)
    split linears (ZB-H1, ZBV)     `pipeline.activations.          norms, attention, GELU,
                                   split_backward` defers weight   residuals; each linear
                                   gradients from its backward,    runs eager, split as before
                                   a host list
    tp dropout's first call        `ParallelDropout` fills its     once: one recompile of a
                                   layout cache (an all-reduce)    graph guarded on the cache

hybridpar's own autograd Functions run eager at such breaks, the frames they call included
(`_run_eager_at_graph_breaks`): compiled alone they fuse nothing and cost guards per call.

Dropout draws from the default generator as eager does (inductor's ``fallback_random``): the
same masks, so parity with eager, tp's one-device masks and the checkpoint's RNG replay hold.

A block that cannot compile (dynamo or the backend raise, e.g. ``fullgraph=True`` meeting a
graph break, or no C++ compiler for inductor on CPU) runs eager from then on, with every
layer of its class, after a `BlockCompileWarning` naming the layer and the reason; errors of
the block's own code (a `ValueError` of a shape check) are raised as they are.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
import torch._dynamo.config
import torch._functorch.config
from torch import nn
from torch._dynamo.exc import TorchDynamoException

__all__ = ["BlockCompileWarning", "block_classes", "compile_blocks"]

# inductor options unless given: random ops as eager draws them (same masks, same RNG use)
_INDUCTOR_OPTIONS: dict[str, Any] = {"fallback_random": True}


class BlockCompileWarning(UserWarning):
    """A block could not compile: it (and its class) runs eager."""


def block_classes(model: nn.Sequential) -> set[type[nn.Module]]:
    """The classes of `model`'s layers that are blocks: holding parameters, ≥ 2 layers."""
    counts = Counter(type(layer) for layer in model.children())
    return {cls for cls, n in counts.items() if n >= 2 and any(
        next(layer.parameters(), None) is not None
        for layer in model.children() if type(layer) is cls)}


def _patch(config: Any, key: str) -> contextlib.AbstractContextManager[Any]:
    """`config.key` True inside (re-entrant), where this torch has the key."""
    return config.patch(**{key: True}) if hasattr(config, key) else contextlib.nullcontext()


# While a block runs (and compiles): a graph break inside a nested call (a tp collective, a
# split linear) splits the block's graph there, not every frame above it; the backward is
# compiled with the forward, inside the call, so a backward that fails falls back too.
_CONFIG = (_patch(torch._dynamo.config, "nested_graph_breaks"),
           _patch(torch._functorch.config, "force_non_lazy_backward_lowering"))


class _ClassState:
    """What the layers of one compiled class share: whether it failed (then all run eager)."""

    def __init__(self) -> None:
        self.failed = False


class _GuardedCall:
    """A layer's ``_compiled_call_impl``: the compiled call, or eager after a failure."""

    def __init__(self, layer: nn.Module, name: str, state: _ClassState,
                 compile_fn: Callable[..., Callable[..., Any]]) -> None:
        self._layer, self._name, self._state = layer, name, state
        self._compiled = compile_fn(layer._call_impl)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        layer = self._layer
        if not self._state.failed:
            try:
                with _CONFIG[0], _CONFIG[1]:
                    return self._compiled(*args, **kwargs)
            except TorchDynamoException as e:   # dynamo or the backend: not the layer's code
                self._state.failed = True
                reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                warnings.warn(
                    f"layer {self._name!r} ({type(layer).__name__}) could not be compiled "
                    f"({type(e).__name__}: {reason}); it and every {type(layer).__name__} "
                    "run eager", BlockCompileWarning, stacklevel=2)
        return layer._call_impl(*args, **kwargs)


def _hybridpar_functions() -> list[Callable[..., Any]]:
    """The forward and backward of hybridpar's autograd Functions (tp collectives, the split
    linear, ...), and the split linear's torch-function hook."""
    from hybridpar.pipeline.activations.split_backward import SplitLinear

    found: list[Callable[..., Any]] = [SplitLinear.__torch_function__]
    todo = list(torch.autograd.Function.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.startswith("hybridpar."):
            found += [getattr(f, "__func__", f) for f in (cls.__dict__.get("forward"),
                                                          cls.__dict__.get("backward")) if f]
    return found


def _run_eager_at_graph_breaks() -> None:
    """Have dynamo run hybridpar's autograd Functions eager, frames they call included.

    Their host-side work (collectives counted in `hybridpar.comm_stats`, deferred weight
    gradients) breaks a block's graph around them; dynamo would then compile their own frames
    one by one (a forward that is one all-reduce, its helpers): compile time, guards on every
    call, nothing fused. Where this torch lacks the (private) hook, nothing changes.
    """
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except ImportError:
        return
    for fn in _hybridpar_functions():
        set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP,
                                                              FrameAction.SKIP))


def compile_blocks(stage: nn.Sequential, *, classes: Collection[type[nn.Module]] | None = None,
                   backend: str | Callable[..., Any] = "inductor", dynamic: bool | None = None,
                   fullgraph: bool = False, mode: str | None = None,
                   options: Mapping[str, Any] | None = None) -> list[str]:
    """Compile in place each layer of `stage` whose class is in `classes` (default:
    `block_classes` of `stage`); returns the names of the layers compiled.

    In place: the layers stay the same objects (as with ``nn.Module.compile``), so parameter
    identity and state-dict keys are unchanged. `backend`, `dynamic`, `fullgraph`, `mode` are
    `torch.compile`'s; `options` its inductor options (default: ``fallback_random``;
    with `mode` none: dropout then draws inductor's own masks, not eager's).
    """
    if mode is not None and options is not None:
        raise ValueError(f"compile_blocks got mode={mode!r} and options; torch.compile takes "
                         "one of them: drop mode, or put its settings in options")
    blocks = block_classes(stage) if classes is None else set(classes)
    if options is None and mode is None and backend == "inductor":
        options = _INDUCTOR_OPTIONS

    def compile_fn(fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=fullgraph,
                             mode=mode, options=None if options is None else dict(options))

    _run_eager_at_graph_breaks()
    states: dict[type[nn.Module], _ClassState] = {}
    compiled = []
    for name, layer in stage.named_children():
        if type(layer) not in blocks:
            continue
        state = states.setdefault(type(layer), _ClassState())
        layer._compiled_call_impl = _GuardedCall(layer, name, state, compile_fn)
        compiled.append(name)
    return compiled
