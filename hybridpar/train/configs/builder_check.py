"""A user's builder on `meta`: its build recorded, then checked against the keyed resets.

``model.init = "keyed"`` builds a ``"package.module:function"`` model on the meta device and
initializes it as the zoo's (`hybridpar.keyed`: each module that owns tensors is reset by its
``reset_parameters()`` under a seed keyed by its name). That is the builder's model only if
the resets set everything the builder sets. `build_checked` proves it before any training,
with no storage: a `TorchDispatchMode` records every in-place write to a meta tensor (the
``Tensor(a!)`` arguments of each op's schema) by storage, first while the builder runs, then
while every reset runs on the meta model itself. Per parameter and buffer:

    case  the record shows                              the keyed model would
    (a)   the builder raises on meta (.item(),          not build
          .numpy(), .tolist() of a tensor)
    (b)   its module has no reset_parameters()          keep uninitialized memory
    (c)   no reset writes it (a buffer computed in      keep uninitialized memory
          __init__, a reset that skips it)
    (d)   the builder's writes do not end with those    lose the builder's values
          of the last reset that writes it
          (nn.init.zeros_(model[2].bias) or
          model.apply(init) after construction)
    (e)   it is not on meta (torch.from_numpy,          lose the builder's values
          load_state_dict(assign=True))

Each is a `MetaBuildError` naming the builder, the tensors and the reason, with both fixes: a
``reset_parameters()`` that sets every tensor its module owns, or ``model.init = "full"``
(the whole model built on the CPU with the builder's own values). A value given out of place
(``nn.Parameter(torch.full((n,), 0.5))``) leaves no write to compare: there the check trusts
the module's reset.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from hybridpar.keyed import reset_of, reset_order
from hybridpar.models import registry
from hybridpar.tensor_parallel.base import ParallelLayer

__all__ = ["MetaBuildError", "build_checked"]

_L = TypeVar("_L")
Write = tuple[Any, ...]   # (op, (shape, stride, offset) of the view written, its other args)

# nn.init's functions that return at once on a meta tensor (nothing to draw into): no write
# reaches the dispatcher, so while recording each notes its own. trunc_normal_ is caught in
# the helper it calls by its module-level name, whatever name the caller imported it under.
_META_NO_OPS = {"_no_grad_trunc_normal_": "trunc_normal_", "orthogonal_": "orthogonal_",
                "dirac_": "dirac_", "sparse_": "sparse_"}
_SHOWN = 4   # problems named in one error


class MetaBuildError(ValueError):
    """A builder the keyed initialization cannot reproduce on `meta`: what, where, the fixes."""


def _plain(value: Any) -> Any:
    """`value` as comparable data: a tensor by shape and dtype (it has no values on meta)."""
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, list | tuple):
        return tuple(_plain(v) for v in value)
    if value is None or isinstance(value, bool | int | float | complex | str):
        return value
    if isinstance(value, torch.dtype | torch.device | torch.layout | torch.memory_format):
        return str(value)
    return type(value).__name__   # a Generator, ...


def _key(tensor: Tensor) -> int:
    """`tensor`'s storage (shared by its views): its address, while the storage lives."""
    return int(tensor.untyped_storage()._cdata)


class _Writes(TorchDispatchMode):
    """In-place writes to meta tensors: ``log[storage] = [(who, Write), ...]`` in order, `who`
    the name of the module whose reset ran (None: the builder)."""

    def __init__(self) -> None:
        super().__init__()
        self.who: str | None = None
        self.log: dict[int, list[tuple[str | None, Write]]] = {}
        self._held: list[Any] = []   # storages kept alive: an address names one storage

    def note(self, op: str, tensor: Tensor, others: Any) -> None:
        key = _key(tensor)
        if key not in self.log:
            self.log[key] = []
            self._held.append(tensor.untyped_storage())
        view = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        self.log[key].append((self.who, (op, view, _plain(others))))

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema.arguments
        written = {i for i, a in enumerate(schema) if a.alias_info is not None
                   and a.alias_info.is_write}
        if not written:
            return out
        others = ([v for i, v in enumerate(args) if i not in written],
                  sorted((k, v) for k, v in kwargs.items()
                         if k not in {schema[i].name for i in written}))
        for i in written:
            value = args[i] if i < len(args) else kwargs.get(schema[i].name)
            for t in value if isinstance(value, list | tuple) else [value]:
                if isinstance(t, Tensor) and t.is_meta:
                    self.note(str(func), t, others)
        return out


@contextlib.contextmanager
def _no_ops_noted(writes: _Writes) -> Iterator[None]:
    """nn.init's meta no-ops (`_META_NO_OPS`) note a write while the block runs."""
    saved = {attr: getattr(torch.nn.init, attr) for attr in _META_NO_OPS
             if hasattr(torch.nn.init, attr)}

    def noted(attr: str) -> Callable[..., Any]:
        original = saved[attr]

        def fn(tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, Tensor) and tensor.is_meta:
                writes.note(f"nn.init.{_META_NO_OPS[attr]}", tensor, (args, sorted(kwargs.items())))
                return tensor
            return original(tensor, *args, **kwargs)
        return fn

    try:
        for attr in saved:
            setattr(torch.nn.init, attr, noted(attr))
        yield
    finally:
        for attr, original in saved.items():
            setattr(torch.nn.init, attr, original)


def _raised_by(error: BaseException, fn: Callable[..., Any]) -> bool:
    """Whether `error` was raised in `fn`'s own code (not in something it called)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code is getattr(fn, "__code__", None)


def build_checked(builder: str, build: Callable[[], tuple[nn.Sequential, _L]]
                  ) -> tuple[nn.Sequential, _L]:
    """``build()``, the user's builder `builder` with its options, on the meta device: a
    `MetaBuildError` (cases (a) to (e) above) unless the keyed resets set every parameter
    and buffer as the builder does. Costs no storage: the resets run on the meta model."""
    writes = _Writes()
    with _no_ops_noted(writes):
        try:
            with torch.device("meta"), writes:
                model, loss = build()
        except (ValueError, OSError):   # the builder's own word on its options and files
            raise
        except Exception as e:
            if _raised_by(e, registry.build):   # not (nn.Sequential, loss): says so itself
                raise
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise MetaBuildError(
                f"model {builder!r} cannot be built on the meta device (model.init = "
                f"\"keyed\"): it raised {type(e).__name__}: {first}. A builder that runs there "
                "must not read tensor values (.item(), .tolist(), .numpy(), bool(t)): make it "
                "so, or set model.init = \"full\" to build the whole model on the CPU with its "
                "own initialization") from e
        problems, classes = _problems(model, writes)
    if problems:
        more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise MetaBuildError(
            f"model {builder!r} built on the meta device (model.init = \"keyed\") would not "
            f"start from the builder's values: {'; '.join(problems[:_SHOWN])}{more}. Give "
            f"{' and '.join(sorted(classes))} a reset_parameters() that sets every tensor it "
            "owns (as the builder wants it), or set model.init = \"full\" to build the whole "
            "model on the CPU with the builder's own initialization")
    return model, loss


def _problems(model: nn.Module, writes: _Writes) -> tuple[list[str], set[str]]:
    """What the keyed resets of meta-built `model` would not reproduce: one line per problem,
    and the classes of the modules that own the tensors named."""
    owners: dict[int, list[tuple[str, nn.Module]]] = {}   # storage -> (tensor name, owner)
    problems: list[str] = []
    classes: set[str] = set()
    for prefix, sub in model.named_modules(remove_duplicate=False):
        for attr, t in [*sub._parameters.items(), *sub._buffers.items()]:
            if t is None:
                continue
            name = f"{prefix}.{attr}" if prefix else attr
            if not t.is_meta:   # (e)
                problems.append(f"'{name}' ({type(sub).__name__}) is on {t.device.type}, not "
                                "meta (made from data: torch.from_numpy, torch.load, "
                                "load_state_dict(assign=True)): its values would be lost")
                classes.add(type(sub).__name__)
                continue
            owners.setdefault(_key(t), []).append((name, sub))
    order = reset_order(model)   # children first, as keyed_reset_ goes
    bare = {id(sub) for _, sub in order if reset_of(sub) is None}
    for name, sub in reversed(order):   # (b), in the model's order
        if id(sub) in bare:
            own = [a for a, t in [*sub._parameters.items(), *sub._buffers.items()]
                   if t is not None]
            problems.append(f"'{name}' ({type(sub).__name__}) owns {', '.join(own)} but has no "
                            "reset_parameters(): they would keep uninitialized memory")
            classes.add(type(sub).__name__)
    for name, sub in order:   # every reset, on the meta model: what keyed_reset_ will write
        reset = reset_of(sub)
        if reset is None:
            continue
        writes.who = name
        try:
            with torch.device("meta"), torch.no_grad(), writes:
                reset()
        except Exception as e:
            problems.append(f"'{name}' ({type(sub).__name__}).{reset.__name__}() fails on the "
                            f"meta device ({type(e).__name__}: {e})")
            classes.add(type(sub).__name__)
        if isinstance(sub, ParallelLayer):   # ours draw the full layer, and skip meta tensors:
            for t in [*sub._parameters.values(), *sub._buffers.values()]:   # trusted, noted
                if t is not None and t.is_meta and not any(
                        who == name for who, _ in writes.log.get(_key(t), [])):
                    writes.note(f"{type(sub).__name__}.reset_parameters", t, ())
    for key, held in owners.items():
        name, owner = held[0]
        if all(id(sub) in bare for _, sub in held):
            continue   # named by (b)
        log = writes.log.get(key, [])
        built = [w for who, w in log if who is None]
        resets = [(who, w) for who, w in log if who is not None]
        if not resets:   # (c)
            problems.append(f"'{name}' ({type(owner).__name__}) is written by no reset (its "
                            "reset_parameters() skips it or returns early on meta, or "
                            "__init__ computes it): it would keep uninitialized memory")
            classes.add(type(owner).__name__)
            continue
        # (d) what a tensor holds is made by its last writes: the last reset that writes it
        # (a parent's rule, as nn.MultiheadAttention's zeroed out_proj.bias, or a tie's first
        # holder) must write it last in the build too. A build that writes it in place at all
        # must end with those writes; anything after them is the builder's own, lost.
        last = resets[-1][0]
        final = [w for who, w in resets if who == last]
        if built and built[-len(final):] != final:
            problems.append(f"'{name}' ({type(owner).__name__}) is written by the builder after "
                            f"its reset (last {built[-1][0]}; the reset of '{last}' ends with "
                            f"{final[-1][0]}): the builder's values would be lost")
            classes.add(type(owner).__name__)
    return problems, classes
