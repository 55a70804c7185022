"""The overlapped linear maps of `TPDense(async_comm=True)`: explicit autograd Functions.

Both keep activations sharded on features; n is the tp size, rank r, ``I = in / n``,
``O = out / n``, B the flattened batch:

    function             weight (local)      forward                    backward
    async_gather_linear  W[O_r, :] (O, in)   ring-gather x, one matmul  ring scatter-sum of dx
                                             per piece as it lands      (dW per block on the way)
    async_scatter_linear W[:, I_r] (out, I)  one partial per dest,      ring-gather dy, dx and
                                             summed along the ring       dW per piece as it lands

The backward of the overlapped gather is an overlapped scatter-sum and vice versa. Numbers
equal the synchronous layer's up to the order of floating-point sums.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.distributed import ProcessGroup

from hybridpar.sharded.mappings import group_size
from hybridpar.tensor_parallel.feature.ring import (
    gather_chains,
    ring_pass,
    ring_reduce,
    scatter_chains,
)

__all__ = ["async_gather_linear", "async_scatter_linear"]


def _gather_variant(bidirectional: bool) -> str:
    return "bidirectional" if bidirectional else "unidirectional"


class _AsyncGatherLinear(torch.autograd.Function):
    """y_r = Σ_s x_s W[O_r, I_s]ᵀ + b_r, each term computed as x_s lands (ring all-gather)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None,
                group: ProcessGroup | None, bidirectional: bool) -> Tensor:
        n, width = group_size(group), x.shape[-1]                     # width = I
        x2 = x.reshape(-1, width)                                     # (B, I)
        pieces: list[Tensor] = [x2] * n
        y = x2.new_zeros(x2.shape[0], weight.shape[0])                # (B, O)
        chains = gather_chains(x2, n, variant=_gather_variant(bidirectional), shift_up=True)
        for a in ring_pass(chains, group, op="TPDense(mode='gather', async_comm=True)"):
            if a.hop == 0 and a.chain > 0:
                continue  # the local input again, at the head of the second chain
            pieces[a.source] = a.tensor
            y.addmm_(a.tensor, weight[:, a.source * width:(a.source + 1) * width].t())
        if bias is not None:
            y.add_(bias)
        ctx.group, ctx.bidirectional, ctx.has_bias = group, bidirectional, bias is not None
        ctx.save_for_backward(weight, *pieces)                        # (O, in), n × (B, I)
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], weight.shape[0])              # (*, O)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        weight, *pieces = ctx.saved_tensors
        group = ctx.group
        n, width = group_size(group), ctx.x_shape[-1]
        g = grad.reshape(-1, weight.shape[0])                         # (B, O)
        grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None

        def block(s: int) -> slice:
            return slice(s * width, (s + 1) * width)

        def weight_grad(s: int) -> None:
            if grad_w is not None:
                grad_w[:, block(s)] = g.t() @ pieces[s]                 # (O, I)

        grad_x = None
        if ctx.needs_input_grad[0]:
            # dx_s = Σ_ranks dy_r W[O_r, I_s]: a scatter-sum, dW blocks computed on the way
            def part(dest: int, a: int, b: int) -> Tensor:
                return g @ weight[:, dest * width + a:dest * width + b]
            chains = scatter_chains(width, bidirectional=ctx.bidirectional, shift_up=False)
            sums = ring_reduce(part, chains, group,
                               side_work=[partial(weight_grad, s) for s in range(n)],
                               op="TPDense(mode='gather', async_comm=True) backward")
            grad_x = torch.cat(sums, dim=-1).reshape(ctx.x_shape)
        else:
            for s in range(n):
                weight_grad(s)
        return grad_x, grad_w, grad_b, None, None


class _AsyncScatterLinear(torch.autograd.Function):
    """y_r = Σ_s x_s W[O_r, I_s]ᵀ + b_r, each rank's partial for r summed along the ring."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None,
                group: ProcessGroup | None, bidirectional: bool) -> Tensor:
        n = group_size(group)
        out = weight.shape[0] // n                                    # O
        x2 = x.reshape(-1, x.shape[-1])                               # (B, I)

        def part(dest: int, a: int, b: int) -> Tensor:                # (B, b - a)
            return x2 @ weight[dest * out + a:dest * out + b].t()

        chains = scatter_chains(out, bidirectional=bidirectional, shift_up=True)
        sums = ring_reduce(part, chains, group, op="TPDense(mode='scatter', async_comm=True)")
        y = torch.cat(sums, dim=-1) if len(sums) > 1 else sums[0]     # (B, O)
        if bias is not None:
            y.add_(bias)
        ctx.group, ctx.bidirectional, ctx.has_bias = group, bidirectional, bias is not None
        ctx.save_for_backward(x2, weight)
        ctx.x_shape = x.shape
        return y.reshape(*x.shape[:-1], out)                          # (*, O)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        group = ctx.group
        n = group_size(group)
        out = weight.shape[0] // n
        g = grad.reshape(-1, out)                                     # (B, O)
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if not (need_x or need_w):
            return None, None, grad_b, None, None
        grad_x = torch.zeros_like(x2) if need_x else None             # (B, I)
        grad_w = torch.empty_like(weight) if need_w else None         # (out, I)
        # every rank's dy_s arrives in turn: dx += dy_s W[O_s, I_r], dW[O_s, I_r] = dy_sᵀ x
        chains = gather_chains(g, n, variant=_gather_variant(ctx.bidirectional),
                               shift_up=False)
        for a in ring_pass(chains, group, op="TPDense(mode='scatter', async_comm=True) "
                                             "backward"):
            if a.hop == 0 and a.chain > 0:
                continue
            rows = slice(a.source * out, (a.source + 1) * out)
            if grad_x is not None:
                grad_x.addmm_(a.tensor, weight[rows])
            if grad_w is not None:
                grad_w[rows] = a.tensor.t() @ x2                      # (O, I)
        grad_x = grad_x.reshape(ctx.x_shape) if grad_x is not None else None
        return grad_x, grad_w, grad_b, None, None


def async_gather_linear(x: Tensor, weight: Tensor, bias: Tensor | None,
                        group: ProcessGroup | None, *, bidirectional: bool = True) -> Tensor:
    """(*, in / n) → (*, out / n) with the weight's rows W[O_r, :]; gather overlapped."""
    return _AsyncGatherLinear.apply(x, weight, bias, group, bidirectional)


def async_scatter_linear(x: Tensor, weight: Tensor, bias: Tensor | None,
                         group: ProcessGroup | None, *, bidirectional: bool = True) -> Tensor:
    """(*, in / n) → (*, out / n) with the weight's columns W[:, I_r]; scatter overlapped."""
    return _AsyncScatterLinear.apply(x, weight, bias, group, bidirectional)

