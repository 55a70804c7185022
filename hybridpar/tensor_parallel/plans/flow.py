"""The data flow behind tp_plan="auto": which Linear's shard reaches which Linear, on meta tensors.

Two kinds of forward run on `meta` tensors (the parameters are swapped for meta copies with
`torch.func.functional_call`, nothing real is computed, no random number is drawn; modules
are put in eval mode for the runs and restored):

    run          Linear-like layers (nn.Linear, HF Conv1D)       records per torch op
    full         output (*, out), as the one-device model        output shapes
    simulated    a candidate column: output (*, out / tp);       output shapes, which outputs
                 an input of width in / tp: a row, output full   carry a shard, and from where

An op's output is a shard when its shape differs from the full run's in exactly one dim, by
the factor tp. Every op that takes a shard must give one back (a reduction or contraction over
the sharded dim gives the full shape: refused), must not normalize, sort, split or
concatenate along the sharded dim (refused by name), and must not fail; a shard must not
reach the model's output. The candidates whose shard breaks a rule are dropped (with the op
as the reason) and the simulation runs again, until it passes. What is left: columns, and the
rows that read their shards (several columns may feed one row: q, k, v -> o; gate, up ->
down). Nothing here needs an activation to be a known module: its ops are elementwise.

The full run also finds what a layer's output is made of: split at once into k equal parts
along its features (GPT-2's c_attn: q | k | v) it is *fused* (each part is sharded alike); its
first reshape ``(*, F) -> (*, n, d)`` gives its n heads of size d. The attention module that
owns sharded heads gets its head counts and widths divided by tp (`head_attributes`).
Both runs also follow the replicated parameters (not a Linear's): a use on a shard makes its
gradient partial over tp (`Pairing.partial`; a column whose shard meets a parameter also used
on a full activation is dropped), and an embedding table indexed by sizes alone (an arange,
not the input) is a position table (`FullTrace.positional`).
Caveat: a reshape that puts the heads inside the head dim would pass the shape test. The
rules an op must obey, and the run that checks them, are in `flow_ops`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hybridpar.sharded.attrs import PARALLEL_DIM_ATTR
from hybridpar.tensor_parallel.fused import Fused
from hybridpar.tensor_parallel.plans.flow_heads import finish
from hybridpar.tensor_parallel.plans.flow_ops import (
    Abort,
    FullTrace,
    Run,
    TraceFailed,
    is_conv1d,
    is_linear_like,
    linear_sizes,
    tensors_in,
)

__all__ = ["COUNT_ATTRS", "WIDTH_ATTRS", "FullTrace", "LocalConfig", "Pairing", "TraceFailed",
           "head_attributes", "is_conv1d", "is_linear_like", "linear_sizes", "pair_columns",
           "partial_uses", "sample_input", "set_head_attribute", "trace_full"]

# attributes of an attention module that count heads, or hold a width made of heads
COUNT_ATTRS = ("num_heads", "n_head", "n_heads", "num_attention_heads", "num_key_value_heads",
               "num_kv_heads", "n_kv_heads", "n_kv_head")
WIDTH_ATTRS = ("split_size", "embed_dim", "hidden_size", "all_head_size", "inner_dim")


def sample_input(root: nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A small meta input for `root`: token ids (2, 3) or features (2, 3, in), from the first
    layer holding parameters (a leaf, or a known layer: a parent's own parameters may be
    used later); None if unknown."""
    if getattr(root, "main_input_name", None) == "input_ids":
        return (torch.zeros(2, 3, dtype=torch.long, device="meta"),), {}
    for m in root.modules():
        known = isinstance(m, nn.Embedding) or is_linear_like(m) or \
            type(m).__name__ in ("ParallelEmbedding", "ParallelLinear", "ParallelConv1D")
        if next(m.parameters(recurse=False), None) is None or \
                (not known and next(m.children(), None) is not None):
            continue
        if isinstance(m, nn.Embedding) or type(m).__name__ == "ParallelEmbedding":
            return (torch.zeros(2, 3, dtype=torch.long, device="meta"),), {}
        if is_linear_like(m) or type(m).__name__ in ("ParallelLinear", "ParallelConv1D"):
            width = linear_sizes(m)[0] if is_linear_like(m) else \
                int(m.in_features)  # type: ignore[arg-type]
            dtype = next(m.parameters()).dtype
            return (torch.zeros(2, 3, width, dtype=dtype, device="meta"),), {}
        return None
    return None


class _Recorder(TorchFunctionMode):
    def __init__(self, run: Run) -> None:
        super().__init__()
        self.run = run

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return self.run.op(func, tuple(args), dict(kwargs or {}))


@dataclass
class Pairing:
    """What the simulation kept: columns, rows with the columns feeding them, and why not;
    the replicated parameters used on the kept shards (their gradients are partial over tp),
    with the columns whose shards they meet."""

    columns: dict[str, Fused]               # layer -> fused parts
    rows: dict[str, set[str]]               # row layer -> the columns feeding it
    reasons: dict[str, str]                 # dropped candidate -> why
    partial: dict[str, set[str]] = field(default_factory=dict)   # parameter -> columns
    sliced: dict[str, int] = field(default_factory=dict)   # per-head parameter -> its dim
    reduced: dict[str, set[str]] = field(default_factory=dict)  # module -> columns (summed)


@contextlib.contextmanager
def _patched(root: nn.Module, run: Run) -> Iterator[None]:
    """Linear-like layers call `run.linear`; modules in eval mode; the run knows the module
    each op runs in (`run.stack`, `run.leaves`); restored after."""
    modes = {m: m.training for m in root.modules()}
    patched = []
    hooks = []

    def leave(*_: Any) -> None:   # a forward hook: returns None (the output stays)
        run.stack.pop()

    for path, m in root.named_modules():
        name = run.names.get(id(m))
        if name is not None:
            m.forward = (lambda x, *a, _n=name, _m=m, **k: run.linear(_n, _m, x))
            patched.append(m)
        if next(m.children(), None) is None and path:
            run.leaves.add(path)
        hooks.append(m.register_forward_pre_hook(lambda _m, _a, _p=path: run.stack.append(_p)))
        hooks.append(m.register_forward_hook(leave, always_call=True))
    root.eval()
    try:
        yield
    finally:
        for m in patched:
            del m.forward
        for hook in hooks:
            hook.remove()
        for m, mode in modes.items():
            m.training = mode


def _forward(root: nn.Module, run: Run, sample: tuple[tuple[Any, ...], dict[str, Any]]
             ) -> Any:
    meta = {k: torch.empty_like(v, device="meta")
            for k, v in [*root.named_parameters(), *root.named_buffers()]}
    args, kwargs = sample
    # replicated parameters (not a tp layer's shard): the run follows their uses
    run.begin({k: meta[k] for k, p in root.named_parameters()
               if getattr(p, PARALLEL_DIM_ATTR, None) is None},
              tensors_in((args, kwargs)))
    state = torch.get_rng_state()
    try:
        with _patched(root, run), torch.no_grad(), _Recorder(run):
            return torch.func.functional_call(root, meta, args, kwargs, tie_weights=True,
                                              strict=False)
    finally:
        torch.set_rng_state(state)


def trace_full(root: nn.Module, names: Mapping[int, str],
               sample: tuple[tuple[Any, ...], dict[str, Any]]) -> FullTrace:
    """Run the one-device forward on meta tensors (raises TraceFailed when it cannot)."""
    run = Run(names, 1, None, {})
    try:
        _forward(root, run, sample)
    except Exception as e:
        raise TraceFailed(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                          ) from e
    finish(run)
    return run.trace


def head_attributes(root: nn.Module, columns: Mapping[str, Fused], full: FullTrace, tp: int
                    ) -> list[tuple[nn.Module, str, str, int, int]]:
    """(module, its name, attribute, value, value / tp) for the attention modules of `columns`.

    A module owning a sharded column whose parts hold n heads of size d (q: n, k and v: the
    kv heads) holds n / tp of them per rank: its integer attributes named in COUNT_ATTRS equal
    to such an n, and in WIDTH_ATTRS equal to such an n * d, are divided by tp; so are the
    COUNT_ATTRS of its ``config`` (``config.num_attention_heads``: Phi-3 cuts its fused q | k
    | v by them), in a view of its own (`LocalConfig`). Nothing else (head_dim).
    """
    counts: dict[str, set[int]] = {}
    widths: dict[str, set[int]] = {}
    for name in columns:
        if name in full.heads:
            parent = name.rpartition(".")[0]
            d = full.heads[name][1]
            ns = full.counts.get(name, {full.heads[name][0]})
            counts.setdefault(parent, set()).update(ns)
            widths.setdefault(parent, set()).update(n * d for n in ns)
    changes = []
    for parent, ns in counts.items():
        module = root.get_submodule(parent)
        config = vars(module).get("config")
        for attr in (*COUNT_ATTRS, *WIDTH_ATTRS, *(f"config.{a}" for a in COUNT_ATTRS)):
            value = vars(module).get(attr) if not attr.startswith("config.") else \
                vars(config).get(attr[7:]) if config is not None else None
            if type(value) is not int:
                continue
            pool = ns if attr.rpartition(".")[2] in COUNT_ATTRS else widths[parent]
            if value in pool and value % tp == 0:
                changes.append((module, parent, attr, value, value // tp))
    return changes


class LocalConfig:
    """One module's view of the model's shared config with some values of its own (this
    rank's head counts): reads those first, everything else from the shared config, to which
    every write goes; `isinstance` sees the config's class."""

    def __init__(self, shared: Any, own: Mapping[str, Any]) -> None:
        object.__setattr__(self, "_shared", shared)
        object.__setattr__(self, "_own", dict(own))

    def __getattr__(self, name: str) -> Any:
        if name in ("_shared", "_own"):
            raise AttributeError(name)
        return self._own[name] if name in self._own else getattr(self._shared, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._shared, name, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return LocalConfig, (self._shared, self._own)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return type(self._shared)


def set_head_attribute(module: nn.Module, attr: str, value: int) -> None:
    """`module.attr = value`; ``config.<name>``: in the module's own view of its config
    (`LocalConfig`), dropped again when it equals the shared value."""
    if not attr.startswith("config."):
        setattr(module, attr, value)
        return
    key, config = attr[7:], vars(module)["config"]
    shared = config._shared if type(config) is LocalConfig else config
    own = dict(config._own) if type(config) is LocalConfig else {}
    own[key] = value
    own = {k: v for k, v in own.items() if v != getattr(shared, k)}
    vars(module)["config"] = LocalConfig(shared, own) if own else shared


@contextlib.contextmanager
def _attributes(changes: list[tuple[nn.Module, str, str, int, int]]) -> Iterator[None]:
    try:
        for module, _, attr, _, new in changes:
            set_head_attribute(module, attr, new)
        yield
    finally:
        for module, _, attr, old, _ in changes:
            set_head_attribute(module, attr, old)


def _simulate(root: nn.Module, names: Mapping[int, str],
              sample: tuple[tuple[Any, ...], dict[str, Any]], full: FullTrace, tp: int,
              columns: Mapping[str, Fused], no_rows: Mapping[str, str] | None) -> Run:
    """One simulated sharded forward with `columns`; its faults are in `run.blame`."""
    run = Run(names, tp, full, columns, no_rows)
    try:
        with _attributes(head_attributes(root, columns, full, tp)):
            run.leaks(_forward(root, run, sample))
    except Abort:
        pass
    except TraceFailed:
        raise
    except Exception as e:
        shards = {s for sh in run.shard.values() for s in sh.sources}
        if not shards:
            raise TraceFailed(f"the simulated forward failed: {e}") from e
        run.fault(shards, f"the forward fails on the shard after {run.last_shard_op} "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    return run


def pair_columns(root: nn.Module, names: Mapping[int, str],
                 sample: tuple[tuple[Any, ...], dict[str, Any]], full: FullTrace, tp: int,
                 candidates: Mapping[str, Fused], no_rows: Mapping[str, str] | None = None
                 ) -> Pairing:
    """Simulate the sharded forward until every candidate's shard obeys the rules.

    `candidates`: layer -> fused parts; `no_rows`: layers that may not be rows, and why.
    A column no row reads is dropped, and so are the columns whose shard meets a parameter
    that is also used on a full activation (its gradient would be part partial, part whole:
    no sum over tp makes it right); the run is repeated without them, so the parameter uses
    found are those of the columns kept.
    """
    columns = dict(candidates)
    reasons: dict[str, str] = {}
    for _ in range(2 * len(candidates) + 2):
        run = _simulate(root, names, sample, full, tp, columns, no_rows)
        for p, cols in run.mixed().items():
            run.fault(cols, f"its shard meets '{p}', which is also used on full activations "
                            f"(its gradient would be partly a shard's, partly whole)")
        for p, (_, cols) in run.sliced.items():
            if p in run.whole:
                run.fault(cols, f"its shard meets '{p}' split by head, which is also used "
                                f"whole on full activations")
        for m in run.reduced.keys() & run.whole_reduced:
            run.fault(run.reduced[m], f"'{m}' reduces over the features of its shard and of "
                                      f"full activations (only the first sum over tp)")
        dropped = {n for n in run.blame if n in columns} | (run.demoted & set(columns))
        if not dropped:
            fed = set().union(*run.rows.values()) if run.rows else set()
            unfed = [n for n in columns if n not in fed]
            for n in unfed:
                reasons[n] = "no row layer reads its output"
                del columns[n]
            if unfed:
                continue
            rows = {r: c & set(columns) for r, c in run.rows.items() if c & set(columns)}
            return Pairing(columns, rows, reasons, dict(run.partial), _sliced(run, columns),
                           _reduced(run, columns))
        for n in dropped:
            if n in run.blame:
                reasons[n] = run.blame[n]
            del columns[n]
    raise TraceFailed("the simulation did not settle")


def _sliced(run: Run, columns: Mapping[str, Fused]) -> dict[str, int]:
    """The per-head parameters the shards of `columns` meet: {parameter: its dim}."""
    return {p: dim for p, (dim, cols) in run.sliced.items() if cols & set(columns)}


def _reduced(run: Run, columns: Mapping[str, Fused]) -> dict[str, set[str]]:
    """The modules whose reductions over the features of `columns`' shards are summed over
    tp (`tensor_parallel.reduction`): {module: the columns}."""
    return {m: cols & set(columns) for m, cols in run.reduced.items() if cols & set(columns)}


def partial_uses(root: nn.Module, names: Mapping[int, str],
                 sample: tuple[tuple[Any, ...], dict[str, Any]], full: FullTrace, tp: int,
                 columns: Mapping[str, Fused]
                 ) -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, int],
                            dict[str, set[str]]]:
    """A dict plan's columns as given: ({parameter: columns} of the replicated parameters
    used on their shards, those of them also used on full activations, {per-head parameter:
    its dim}, {module: columns} whose reductions are summed over tp)."""
    run = _simulate(root, names, sample, full, tp, columns, None)
    mixed = run.mixed()
    mixed.update({p: cols for p, (_, cols) in run.sliced.items() if p in run.whole})
    mixed.update({f"{m} (its reductions)": run.reduced[m]
                  for m in run.reduced.keys() & run.whole_reduced})
    return dict(run.partial), mixed, _sliced(run, columns), _reduced(run, columns)
