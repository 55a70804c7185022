"""What travels between the layers of a model with experts: the hidden state, the packed
documents' positions, the routing sums (`hybridpar.moe.balance_loss`).

    received by a block         dense model          model with experts
    plain                       x                    (x, stats)
    packed documents            (x, positions)       (x, positions, stats)

`split_carry` reads what a block receives, `join_carry` makes what it hands on (positions
dropped by the last block of a packed model: `keep_positions`); `head_output` is what the
model returns: logits, or in training (logits, coef · the load-balancing loss). `Carried`
and `AuxOutput` are views that let a module of one input (a final norm, a head) take part.
"""

from __future__ import annotations

from torch import Tensor, nn

from hybridpar.moe.balance_loss import balance_loss, z_loss

__all__ = ["AuxOutput", "Carried", "head_output", "join_carry", "split_carry"]


def split_carry(x: Tensor | tuple[Tensor, ...], moe: bool
                ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """What a block receives -> (hidden, positions or None, stats or None) (table above);
    `moe`: the model carries routing sums."""
    if not isinstance(x, tuple):
        return x, None, None
    if moe and len(x) == 2:
        return x[0], None, x[1]
    if moe and len(x) == 3:
        return x[0], x[1], x[2]
    if not moe and len(x) == 2:
        return x[0], x[1], None
    raise TypeError(f"a block got a tuple of {len(x)} tensors; it takes x, (x, positions), "
                    "or with experts (x, stats) / (x, positions, stats)")


def join_carry(h: Tensor, positions: Tensor | None, stats: Tensor | None
               ) -> Tensor | tuple[Tensor, ...]:
    """The inverse of `split_carry`: what a block hands on."""
    rest = tuple(t for t in (positions, stats) if t is not None)
    return (h, *rest) if rest else h


def head_output(logits: Tensor, stats: Tensor | None, coef: float, training: bool, *,
                z_coef: float = 0.0) -> Tensor | tuple[Tensor, Tensor]:
    """The head's output: logits, or in training with experts (logits, coef · balance
    + z_coef · the router z-loss)."""
    if stats is None or not training:
        return logits
    aux = balance_loss(stats) * coef
    if z_coef:
        aux = aux + z_loss(stats) * z_coef
    return logits, aux.reshape(1)


class Carried(nn.Module):
    """A view of `module` (its parameters, buffers and children, so its state-dict names are
    the module's) that runs it on the hidden state and passes what travels with it on:
    ``(x, stats) -> (module(x), stats)``; a bare x as the module does. A Hugging Face model
    with experts: its final norm."""

    inner: nn.Module   # the wrapped module, not registered (a view)

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        _share(self, module)

    def forward(self, x: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        if isinstance(x, tuple):
            return self.inner(x[0]), *x[1:]
        return self.inner(x)


class AuxOutput(nn.Module):
    """A view of the model's last module (as `Carried`) that takes (x, stats) and returns
    what `head_output` makes of them: logits in evaluation, (logits, coef · the
    load-balancing loss) in training. A Hugging Face model with experts: its head."""

    inner: nn.Module   # the wrapped module, not registered (a view)

    def __init__(self, module: nn.Module, *, coef: float) -> None:
        super().__init__()
        _share(self, module)
        self.coef = coef

    def forward(self, x: Tensor | tuple[Tensor, ...]) -> Tensor | tuple[Tensor, Tensor]:
        if isinstance(x, tuple):
            return head_output(self.inner(x[0]), x[-1], self.coef, self.training)
        return self.inner(x)

    def extra_repr(self) -> str:
        return f"{type(self.inner).__name__}, coef={self.coef}"


def _share(view: nn.Module, module: nn.Module) -> None:
    """`view` holds `module`'s tensors and children as its own (the same dicts) and calls it
    as `view.inner` (not registered: its tensors are already the view's)."""
    view._parameters, view._buffers = module._parameters, module._buffers
    view._non_persistent_buffers_set = module._non_persistent_buffers_set
    view._modules = module._modules
    object.__setattr__(view, "inner", module)
    view.train(module.training)
