"""Sequence parallelism for a Hugging Face decoder (`to_sequential`'s form, tp plan applied).

Between the tensor-parallel regions of each block (its attention, its MLP) the hidden states
are sharded on the sequence, (B, T / tp, D) tagged `SEQUENCE`; the norms and residual adds
run on this rank's tokens (Megatron's sequence parallelism). `sequence_parallel` switches a
model in place, layer by layer:

    layer                     becomes
    embedding, vocab-parallel its parts reduce-scattered along T (not all-reduced)
    embedding, replicated     its output split along T (backward: all-gathered)
    GPT-2's input             its token and position tables each as the embedding above,
                              their sum tagged SEQUENCE, its dropout the one-device mask's
                              slice (`ParallelDropout`)
    DecoderBlock              mask and positions of the full T; in each child holding tp
                              layers (self_attn, mlp) the input all-gathered along T once
                              (backward: reduce-scattered), its column layers taking it as
                              is, its row layers reduce-scattering their output (+ bias, a
                              partial gradient), its dropouts the one-device masks' slices;
                              the other children's parameters (the norms) get partial
                              gradients; output tagged SEQUENCE
    final norm                partial gradients; output keeps the tag
    head, column-parallel     its input all-gathered along T
    head, replicated          its input all-gathered along T (gradient: this rank's slice)

Partial gradients (a replicated parameter that saw 1 / tp of the tokens) are summed over tp
after each step by the pipe (`register_partial_grad`, `pipeline.parameters.partial`). Supported:
every decoder `to_sequential` converts, under "auto" and "hf" (or dict) plans (an `InputLayer`:
its embedding as above, its dropouts sliced; a `LogitsLayer`: its head as above, the glue
elementwise on the shard). Dropout inside the attention core (GPT-2's ``attn_pdrop``)
draws per-rank masks under tp with or without sequence parallelism (docs/tensor-parallel.md,
Limits).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from hybridpar.hf.blocks import DecoderBlock, TokenPositionEmbedding
from hybridpar.hf.glue import InputLayer, LogitsLayer
from hybridpar.sharded.attrs import (
    SEQUENCE,
    get_parallel_dim,
    register_parallel_dim,
    register_partial_grad,
)
from hybridpar.sharded.mappings import (
    gather_from_group,
    gather_grad_scatter,
    scatter_to_group,
)
from hybridpar.tensor_parallel.embedding import ParallelEmbedding, check_sequence_length
from hybridpar.tensor_parallel.layers import ParallelConv1D, ParallelLinear
from hybridpar.tensor_parallel.random import as_parallel_dropout

__all__ = ["sequence_parallel"]

_LINEARS = (ParallelLinear, ParallelConv1D)


def sequence_parallel(model: nn.Sequential, group: ProcessGroup) -> None:
    """Switch `model` (embedding, blocks, norm, head) to sequence parallelism over the tp
    `group`, in place (see the module's table); a `ValueError` for what it cannot place."""
    layers = list(model)
    if any(getattr(m, "sequence_parallel", False) is True for m in model.modules()):
        return                               # built so already (the built-in gpt)
    if len(layers) < 3 or not all(isinstance(b, DecoderBlock) for b in layers[1:-2]):
        raise ValueError("sequence parallelism takes a Hugging Face decoder as to_sequential "
                         "gives it: embedding, decoder blocks, final norm, head")
    embedding, norm, head = layers[0], layers[-2], layers[-1]
    blocks = [b for b in layers[1:-2] if isinstance(b, DecoderBlock)]
    if isinstance(embedding, TokenPositionEmbedding):     # GPT-2: tokens + positions
        _embedding(embedding.wte, group)
        _embedding(embedding.wpe, group)
        _swap_dropouts(embedding, group)
    elif isinstance(embedding, InputLayer):               # the embedding, a dropout, glue
        _embedding(next(embedding.children()), group)
        _swap_dropouts(embedding, group)
    else:
        _embedding(embedding, group)
    for block in blocks:
        _block(block, group)
    for p in norm.parameters():
        register_partial_grad(p)
    norm.register_forward_hook(_keep_tag)
    _head(next(head.children()) if isinstance(head, LogitsLayer) else head, group)


def _embedding(layer: nn.Module, group: ProcessGroup) -> None:
    """The first layer: a vocab-parallel table reduce-scatters, a replicated one splits."""
    if isinstance(layer, ParallelEmbedding) and layer.dim == 0:
        layer.sequence = True
        return
    if any(get_parallel_dim(p) is not None for p in layer.parameters()):
        raise ValueError(f"sequence parallelism cannot place the embedding {type(layer).__name__}"
                         " sharded by features; shard it by vocabulary ('vocab') or replicate it")

    def split(_layer: nn.Module, _args: Any, out: Tensor) -> Tensor:
        check_sequence_length(out, group)                       # before any collective
        shard = scatter_to_group(out, group, dim=-2)            # (B, T / tp, D)
        register_parallel_dim(shard, SEQUENCE)
        return shard

    layer.register_forward_hook(split)


def _block(block: DecoderBlock, group: ProcessGroup) -> None:
    """Gather at each tp region's input, scatter at its row layers, partial norms."""
    block.sequence_parallel = group.size()
    replicated = (nn.Linear, _conv1d())     # a plain one in a tp region is refused below
    for name, child in block.named_children():
        linears = [m for m in child.modules() if isinstance(m, _LINEARS)]
        if not linears:                      # a norm: it sees this rank's tokens
            for p in child.parameters():
                register_partial_grad(p)
            continue
        for m in linears:
            if m.dim in (-1, 1):
                m.sequence = "gathered"
            elif m.dim == 0:
                m.sequence = "scatter"
                if m.bias is not None:       # added to this rank's tokens only
                    register_partial_grad(m.bias)
            else:
                raise ValueError(f"sequence parallelism: '{name}' of a decoder block holds a "
                                 f"replicated linear layer ({type(m).__name__}); its region "
                                 "must be column -> row parallel")
        for other in child.modules():        # a plain Linear / Conv1D beside them: refused
            if isinstance(other, replicated) and not isinstance(other, _LINEARS):
                raise ValueError(f"sequence parallelism: '{name}' of a decoder block holds a "
                                 f"replicated {type(other).__name__}; its region must be "
                                 "column -> row parallel")
        _swap_dropouts(child, group)         # after a row layer: this rank's tokens
        child.register_forward_pre_hook(_Gather(group), with_kwargs=True)


def _conv1d() -> type[nn.Module]:
    """Hugging Face's Conv1D (GPT-2's linear layers, weight stored transposed)."""
    from transformers.pytorch_utils import Conv1D

    return Conv1D


def _swap_dropouts(root: nn.Module, group: ProcessGroup) -> None:
    """Each exact nn.Dropout in `root` as `ParallelDropout`: on a SEQUENCE-tagged input it
    keeps this rank's slice of the one-device mask; on any other input it is plain dropout."""
    for name, m in list(root.named_modules()):
        if type(m) is nn.Dropout:
            owner, _, attr = name.rpartition(".")
            setattr(root.get_submodule(owner), attr, as_parallel_dropout(m, group))


class _Gather:
    """A region's forward pre-hook: its hidden states all-gathered along T."""

    def __init__(self, group: ProcessGroup) -> None:
        self.group = group

    def __call__(self, _module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if "hidden_states" in kwargs:
            kwargs = {**kwargs,
                      "hidden_states": gather_grad_scatter(kwargs["hidden_states"], self.group,
                                                           dim=-2)}
        else:
            args = (gather_grad_scatter(args[0], self.group, dim=-2), *args[1:])
        return args, kwargs


def _keep_tag(_layer: nn.Module, args: tuple[Any, ...], out: Tensor) -> Tensor:
    """The output tagged as the input (a norm between a sequence shard and a boundary)."""
    register_parallel_dim(out, get_parallel_dim(args[0]))
    return out


def _head(layer: nn.Module, group: ProcessGroup) -> None:
    """The head: a column-parallel one gathers its input itself; a replicated one too."""
    if isinstance(layer, _LINEARS) and layer.dim in (-1, 1):
        layer.sequence = "gather"
        return
    if any(get_parallel_dim(p) is not None for p in layer.parameters()):
        raise ValueError(f"sequence parallelism cannot place the head {type(layer).__name__}; "
                         "shard it by columns (vocabulary) or replicate it")

    def gather(_layer: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (gather_from_group(args[0], group, dim=-2), *args[1:])

    layer.register_forward_pre_hook(gather)
