"""Split backward: input gradients now (I), the weight gradients of linear layers later (W).

Zero-bubble schedules (Qi et al., ICLR 2024) split a stage's backward of a micro-batch in two:
I computes the gradient of the stage's input (the peer upstream waits for it), W the
gradients of the weights (nobody waits for them; the schedule runs W where a rank would idle).
For `F.linear` (nn.Linear, hybridpar's parallel layers, TPDense) the split is exact and
costs nothing extra:

    y = x Wᵀ + b           I: dx = dy W                 (sent upstream at once)
                           W: dW = dyᵀ x, db = Σ dy     (x saved by the forward, dy kept)

Everything else (norms, embeddings, convolutions, custom Functions) computes its weight
gradients during I, as a plain backward does: the generic fallback, exact as well.

How: while a stage's forward runs under `SplitLinear`, each `F.linear` whose weight is a
leaf that requires grad goes through `_SplitLinear`. Its backward always returns dx; the
weight gradients it either returns (a plain backward: nothing deferred) or, inside
`deferring(grads)`, appends to `grads` (a `WeightGrads`) as (x, dy) for `grads.run()` to
compute and accumulate later, through autograd (`torch.autograd.backward` on the leaf), so
gradient hooks (the dp buckets) fire as they would. Recomputation is unaffected: the
recomputed forward runs under `SplitLinear` too, and W needs no randomness.

Under autocast the forward computes in the autocast dtype (as `F.linear` would) and the
backward and W compute in that dtype, then cast each gradient to its tensor's dtype, as
autograd's cast nodes would.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["SplitLinear", "WeightGrads", "deferring"]


class WeightGrads:
    """The deferred weight-gradient work of one micro-batch on one stage (filled by its I)."""

    def __init__(self) -> None:
        self.pending: list[tuple[Tensor, Tensor, Tensor, Tensor | None, torch.dtype]] = []

    def __len__(self) -> int:
        return len(self.pending)

    def run(self) -> None:
        """W: compute every deferred dW (and db) and accumulate it into `.grad`."""
        pending, self.pending = self.pending, []
        for x, dy, weight, bias, dtype in pending:
            dy2 = dy.reshape(-1, dy.shape[-1]).to(dtype)                  # (N, out)
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)                     # (N, in)
            leaves = [weight]
            grads = [(dy2.t() @ x2).to(weight.dtype)]                     # (out, in)
            if bias is not None and bias.requires_grad:
                leaves.append(bias)
                grads.append(dy2.sum(0).to(bias.dtype))                  # (out,)
            torch.autograd.backward(leaves, grads)


_DEFERRING: WeightGrads | None = None   # set inside `deferring` (process-wide: autograd may
                                        # run a backward on its device threads)


@contextmanager
def deferring(grads: WeightGrads) -> Iterator[WeightGrads]:
    """Inside: split linears append their weight gradients to `grads` instead of returning
    them (run the micro-batch's I here, `grads.run()` at its W)."""
    global _DEFERRING
    outer, _DEFERRING = _DEFERRING, grads
    try:
        yield grads
    finally:
        _DEFERRING = outer


class _SplitLinear(torch.autograd.Function):
    """`F.linear` whose weight gradient may be deferred (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        out = F.linear(x, weight, bias)              # autocast applies here, as in F.linear
        ctx.dtype, ctx.x_dtype = out.dtype, x.dtype
        ctx.save_for_backward(x.to(out.dtype) if x.dtype != out.dtype else x)
        ctx.weight, ctx.bias = weight, bias          # leaves: the W pass accumulates into them
        return out

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        (x,) = ctx.saved_tensors
        weight, bias, dtype = ctx.weight, ctx.bias, ctx.dtype
        dy = dy.to(dtype)
        dx = (dy @ weight.to(dtype)).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        wants_w, wants_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        if not (wants_w or wants_b):
            return dx, None, None
        if _DEFERRING is not None and wants_w:
            _DEFERRING.pending.append((x, dy, weight, bias if wants_b else None, dtype))
            return dx, None, None
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dw = (dy2.t() @ x2).to(weight.dtype) if wants_w else None
        db = dy2.sum(0).to(bias.dtype) if wants_b else None
        return dx, dw, db


class SplitLinear(TorchFunctionMode):
    """While active (a stage's forward under a zero-bubble schedule), `F.linear` with a leaf
    weight that requires grad records a backward whose weight gradient can be deferred."""

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(weight, torch.nn.Parameter) and weight.requires_grad and \
                    weight.is_leaf and x.dim() >= 1:
                return _SplitLinear.apply(x, weight, bias)
        return func(*args, **kwargs)
