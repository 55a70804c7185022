"""`init_fn`: the initializer that materializes a `meta`-built Hugging Face Sequential."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

__all__ = ["init_fn"]

_Init = Callable[[nn.Module], None]


def init_fn(model_or_config: Any) -> _Init:
    """The callable to pass as ``HybridPipe(..., init_fn=)`` for a `to_sequential` model.

    Applied to every module after ``to_empty``, it runs the model's own ``_init_weights``
    (random weights as Hugging Face draws them; RMSNorm / LayerNorm weights 1; GPT-2's scaled
    projections) and recomputes what is not random: the rotary buffers ``inv_freq`` /
    ``original_inv_freq`` of each `DecoderBlock`. Give the Hugging Face model (any device,
    `meta` included) or its config (a `meta` model is then built for its ``_init_weights``).
    Load a checkpoint afterwards for real weights.

    The tp layers a ``tp_plan`` put in (`ParallelLinear`, `ParallelConv1D`,
    `ParallelEmbedding`, `TPDense`) are not layers ``_init_weights`` knows. Each is drawn as
    Hugging Face draws the plain layer it is a shard of, and keeps its slice (`shard_of`):

        tp layer                     drawn full, by _init_weights      keeps
        ParallelLinear, TPDense      nn.Linear(in, out)                its rows / columns
        ParallelConv1D               Conv1D(nf, nx)                    "
        ParallelEmbedding            nn.Embedding(V, D, padding_idx)   its vocab / features

    A Hugging Face module holding a per-head parameter cut by a plan (Cohere's q / k norm
    weights, `plan.shard_per_head`) draws it whole and keeps its slice the same way. And a
    Hugging Face module whose own rule draws a child's weight (GPT-2's attention and MLP
    redraw ``c_proj.weight`` scaled by 1 / sqrt(2 n_layer)) draws it on the full layer too:
    its tp children are swapped for full plain layers while the rule runs, and keep the
    slices of what it drew. So a tp group's shards form one full tensor, drawn as on one
    device, when its ranks share the seed. On the CPU the full layers are stand-ins and each
    draw lands on the slice chunk by chunk (`tensor_parallel.sliced_init`: no full tensor);
    on a GPU, whose generator draws other numbers in chunks, and for a rule that reads
    values, they are real: the full tensors of one layer (or of the tp children of one
    module) at a time, on the device.
    """
    if isinstance(model_or_config, nn.Module):
        model = model_or_config
    else:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_or_config)
    init_weights = model._init_weights
    if not callable(init_weights):
        raise TypeError(f"{type(model).__name__} has no _init_weights; pass a Hugging Face "
                        "model or config")

    from hybridpar.hf.blocks import DecoderBlock
    from hybridpar.tensor_parallel.base import ParallelLayer
    from hybridpar.tensor_parallel.sliced_init import init_from_full

    @torch.no_grad()
    def initialize(module: nn.Module) -> None:
        inner = getattr(module, "inner", None)     # a view (`moe.carry`): its module's tensors
        if isinstance(inner, nn.Module) and module._parameters is inner._parameters:
            module = inner
        if isinstance(module, DecoderBlock):
            module.reset_parameters()      # its rotary buffers; its children come on their own
        elif isinstance(module, ParallelLayer):
            full = _full_layer(module)
            if full is None:               # a tp layer of a kind not listed: its own draw
                module.reset_parameters()
                return
            scale = getattr(module, "init_scale", 1.0)            # TPDense's (xlstm's)

            def init_full(layer: nn.Module) -> None:
                init_weights(layer)
                layer.weight.mul_(scale)

            init_from_full(module, full, init_full, group=getattr(module, "group", None))
        elif type(module).__module__.startswith("transformers."):
            with _whole_own_parameters(module):
                _init_over_full_children(module, init_weights)
        else:
            init_weights(module)

    return initialize


def _full_layer(layer: nn.Module) -> nn.Module | None:
    """The full, plain layer `layer` is a shard of, on `meta` (None: a tp layer of a kind
    not known here)."""
    from hybridpar.tensor_parallel.embedding import ParallelEmbedding
    from hybridpar.tensor_parallel.feature.dense import TPDense
    from hybridpar.tensor_parallel.layers import ParallelConv1D, ParallelLinear

    full: nn.Module
    with torch.device("meta"):
        if isinstance(layer, ParallelConv1D):
            from transformers.pytorch_utils import Conv1D

            full = Conv1D(layer.out_features, layer.in_features)
        elif isinstance(layer, (ParallelLinear, TPDense)):
            full = nn.Linear(layer.in_features, layer.out_features, layer.bias is not None)
        elif isinstance(layer, ParallelEmbedding):
            full = nn.Embedding(layer.num_embeddings, layer.embedding_dim, layer.padding_idx)
        else:
            return None
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    return full.to(dtype=weight.dtype)


def _keep_slices(layer: nn.Module, full: Any, *, drawn_only: bool = False) -> None:
    """Copy this rank's slice of every parameter of `full` (a module, or any object holding
    full tensors by the parameters' names) into `layer`'s (`drawn_only`: of those that hold
    something other than NaN, i.e. that an initializer wrote)."""
    from hybridpar.tensor_parallel.state import shard_of

    group = getattr(layer, "group", None)
    for name, param in layer.named_parameters(recurse=False):
        value = getattr(full, name, None)
        if not isinstance(value, torch.Tensor) or (drawn_only and bool(value.isnan().all())):
            continue
        param.copy_(shard_of(value, param, group))


def _init_over_full_children(module: nn.Module, init_weights: _Init) -> None:
    """``init_weights(module)`` with its tp children swapped for full plain layers, each
    child then holding the slices of what the rule drew on its full layer.

    The full layers are stand-ins (`init_shards`: each draw lands on the child's slice)
    when the rule's ops allow it and the children share one tp group; else they are real
    tensors (NaN, so that what the rule left alone is not copied), one module at a time.
    """
    from hybridpar.tensor_parallel.base import ParallelLayer
    from hybridpar.tensor_parallel.sliced_init import init_shards

    swapped: dict[str, tuple[nn.Module, nn.Module]] = {}
    for name, child in module.named_children():
        if isinstance(child, ParallelLayer):
            full = _full_layer(child)
            if full is not None:
                swapped[name] = (child, full)
    if not swapped:
        init_weights(module)
        return
    groups = {id(getattr(child, "group", None)) for child, _ in swapped.values()}
    pairs: dict[torch.Tensor, tuple[nn.Module, str]] = {
        param: (full, pname) for child, full in swapped.values()
             for pname, param in child.named_parameters(recurse=False)
             if isinstance(full._parameters.get(pname), torch.Tensor)}
    with _swapped(module, {name: full for name, (_, full) in swapped.items()}):
        group = getattr(next(iter(swapped.values()))[0], "group", None)
        if len(groups) == 1 and pairs and init_shards(module, init_weights, pairs,
                                                      group=group):
            return
        device = next(iter(pairs)).device if pairs else torch.device("cpu")
        for _, full in swapped.values():
            full.to_empty(device=device)
            for t in full.parameters():
                t.fill_(float("nan"))
        init_weights(module)
    for child, full in swapped.values():
        _keep_slices(child, full, drawn_only=True)


@contextmanager
def _whole_own_parameters(module: nn.Module) -> Iterator[None]:
    """`module` with its own sharded parameters (per-head ones `plan.shard_per_head` cut:
    Cohere's q / k norms; an ep rank's slice of the experts) whole for the block's duration,
    NaN first; each then keeps this rank's slice of what the rule drew (left alone if the
    rule drew nothing). So an ep rank's experts are those of the one-device model."""
    from hybridpar.sharded.attrs import expert_slice, tensor_shard_dim
    from hybridpar.tensor_parallel.state import full_shape

    group = getattr(module, "group", None)
    cut = {name: p for name, p in module.named_parameters(recurse=False)
           if tensor_shard_dim(p) is not None}
    experts = {name: p for name, p in module.named_parameters(recurse=False)
               if expert_slice(p) is not None}
    for name, p in {**cut, **experts}.items():
        slice_ = expert_slice(p)
        shape = (slice_[1], *p.shape[1:]) if slice_ is not None else full_shape(p, group)
        module._parameters[name] = nn.Parameter(
            torch.full(shape, float("nan"), dtype=p.dtype, device=p.device),
            requires_grad=False)
    try:
        yield
    finally:
        wholes = {name: module._parameters[name] for name in {**cut, **experts}}
        module._parameters.update({**cut, **experts})
    _keep_slices(module, SimpleNamespace(**{n: wholes[n] for n in cut}), drawn_only=True)
    for name, p in experts.items():          # an ep rank's experts [a, b) of the whole layer
        first = expert_slice(p)[0]           # type: ignore[index]
        whole = wholes[name]
        assert whole is not None
        drawn = whole.narrow(0, first, p.shape[0])
        p.copy_(torch.where(drawn.isnan(), p, drawn))   # (no host read: a GPU keeps going)


@contextmanager
def _swapped(module: nn.Module, children: dict[str, nn.Module]) -> Iterator[None]:
    """`module` with the named children replaced for the block's duration."""
    saved = {name: module._modules[name] for name in children}
    module._modules.update(children)
    try:
        yield
    finally:
        module._modules.update(saved)
