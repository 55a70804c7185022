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
Parameter that requires grad goes through `_SplitLinear`, which takes the weight and bias
detached (the graph of I never reaches their accumulate nodes). Its backward returns dx;
inside `deferring(grads)` it appends (x, dy) to `grads` (a `WeightGrads`) for `grads.run()`
to compute dW, db later, outside it computes them at once; either way they accumulate
through autograd (`torch.autograd.backward` on the Parameters), so gradient hooks (the dp
buckets) fire once per accumulation, when it happens. Recomputation is unaffected: the
recomputed forward runs under `SplitLinear` too, and W needs no randomness.

Under autocast the forward computes in the autocast dtype (as `F.linear` would) and the
backward and W compute in that dtype, then cast each gradient to its tensor's dtype, as
autograd's cast nodes would.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["SplitLinear", "WeightGrads", "deferring", "observing_kept"]


class WeightGrads:
    """The deferred weight-gradient work of one micro-batch on one stage (filled by its I)."""

    def __init__(self) -> None:
        # (input, output gradient, weight, bias or None, compute dtype) per linear call
        self.pending: list[tuple[Tensor, Tensor, Tensor, Tensor | None, torch.dtype]] = []

    def __len__(self) -> int:
        return len(self.pending)

    def run(self) -> None:
        """W: compute every deferred dW (and db) and accumulate it into `.grad`."""
        pending, self.pending = self.pending, []
        for x, dy, weight, bias, dtype in pending:   # bias: None when it needs no gradient
            dy2 = dy.reshape(-1, dy.shape[-1]).to(dtype)                  # (N, out)
            x2 = x.reshape(-1, x.shape[-1]).to(dtype)                     # (N, in)
            leaves = [weight]
            grads = [(dy2.t() @ x2).to(weight.dtype)]                     # (out, in)
            if bias is not None:
                leaves.append(bias)
                grads.append(dy2.sum(0).to(bias.dtype))                  # (out,)
            torch.autograd.backward(leaves, grads)


_DEFERRING: WeightGrads | None = None   # set inside `deferring` (process-wide: autograd may
                                        # run a backward on its device threads)
_KEEPING: Callable[[Tensor], object] | None = None   # set inside `observing_kept`


@contextmanager
def observing_kept(observer: Callable[[Tensor], object]) -> Iterator[None]:
    """Inside: `observer(dy)` for every output gradient an I keeps for its W, as a
    saved-tensors pack hook sees what a forward saves (`hybridpar check` counts both)."""
    global _KEEPING
    outer, _KEEPING = _KEEPING, observer
    try:
        yield
    finally:
        _KEEPING = outer


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
    """`F.linear` whose weight gradient may be deferred (see the module docstring).

    The weight and bias enter detached, the Parameters themselves ride in `leaves`: the graph
    of I has no edge to their accumulate nodes (autograd would run those, and fire their
    hooks, with no gradient), and W accumulates into them through autograd. When the input
    needs no gradient either (a first layer), `anchor`, an empty leaf that requires grad,
    keeps the output in the graph (torchgpipe's phony), so the backward still runs.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None,
                anchor: Tensor | None, leaves: tuple[Tensor, Tensor | None]) -> Tensor:
        out = F.linear(x, weight, bias)              # autocast applies here, as in F.linear
        ctx.dtype, ctx.x_dtype = out.dtype, x.dtype
        ctx.save_for_backward(x.to(out.dtype) if x.dtype != out.dtype else x)
        ctx.leaves = leaves
        return out

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, None, None, None, None]:
        (x,) = ctx.saved_tensors
        weight, bias = ctx.leaves
        dtype = ctx.dtype
        dy = dy.to(dtype)
        dx = (dy @ weight.to(dtype)).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        work = (x, dy, weight, bias if bias is not None and bias.requires_grad else None, dtype)
        if _DEFERRING is not None:
            _DEFERRING.pending.append(work)
            if _KEEPING is not None:
                _KEEPING(dy)
        else:                                        # not split: accumulate now (re-entrant)
            pending = WeightGrads()
            pending.pending.append(work)
            pending.run()
        return dx, None, None, None, None


def _anchor(device: torch.device) -> Tensor:
    """An empty leaf that requires grad (it never gets a gradient)."""
    return torch.empty(0, device=device, requires_grad=True)


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
                return _SplitLinear.apply(x, weight.detach(),
                                          None if bias is None else bias.detach(),
                                          None if x.requires_grad else _anchor(weight.device),
                                          (weight, bias))
        return func(*args, **kwargs)
