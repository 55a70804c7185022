"""One forward on meta tensors, op by op: full shapes recorded, or shards followed and checked.

The engine of `flow`. In a simulated run:

    op                                   a shard (sharded on dim d) may pass if
    softmax, cumsum, sort, topk, ...     it does not run along d
    layer_norm, rms_norm                 it normalizes other dims than d
    group_norm, local_response_norm      never (they mix the channels)
    split, chunk, narrow, unbind, ...    it slices another dim, or splits a fused shard into parts
    cat, stack, ...                      it does not join along d
    indexing                             it keeps d whole
    any op                               its outputs differ from the full run's by tp in d only,
                                         and it does not fail

A simulated run also follows the parameters that are not Linear-like layers' (norm weights,
scales, free biases): a tensor computed from parameters alone carries their names, and an op
that takes such a tensor is a *use* of them:

    the op also takes        the use is    the parameter's gradient on a tp rank
    a shard                  partial       its shard's part only: summed over tp, it is whole
    a full activation        whole         whole already
    parameters, constants    -             (the output carries the names on)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from hybridpar.tensor_parallel.fused import Fused, part_count
from hybridpar.tensor_parallel.plans import flow_heads

__all__ = ["Abort", "FullTrace", "Run", "Shard", "TraceFailed", "is_conv1d", "is_linear_like",
           "linear_sizes", "tensors_in"]

_DIM_OPS = {  # op name -> (position of its dim argument, keyword, default)
    "softmax": (1, "dim", None), "log_softmax": (1, "dim", None), "cumsum": (1, "dim", None),
    "cumprod": (1, "dim", None), "logcumsumexp": (1, "dim", None), "sort": (1, "dim", -1),
    "argsort": (1, "dim", -1), "topk": (2, "dim", -1), "normalize": (2, "dim", 1),
    "flip": (1, "dims", None), "roll": (2, "dims", None),
}
_SLICE_OPS = {"split": (2, 0), "split_with_sizes": (2, 0), "chunk": (2, 0),
              "tensor_split": (2, 0), "unbind": (1, 0), "narrow": (1, None)}
_CAT_OPS = {"cat", "concat", "concatenate", "stack", "hstack", "vstack"}
_NORM_OPS = {"layer_norm", "rms_norm", "group_norm", "local_response_norm"}


class TraceFailed(Exception):
    """The forward could not be followed (no sample input, or it failed on meta tensors)."""


class Abort(Exception):
    """Stop a simulated run: a shard broke a rule (the culprits are already blamed)."""


def is_conv1d(m: nn.Module) -> bool:
    """Hugging Face's Conv1D (a transposed Linear: weight (in, out), y = x W + b), by shape."""
    w = getattr(m, "weight", None)
    nf, nx = getattr(m, "nf", None), getattr(m, "nx", None)
    return type(m).__name__ == "Conv1D" and isinstance(nf, int) and isinstance(nx, int) and \
        isinstance(w, Tensor) and tuple(w.shape) == (nx, nf)


def is_linear_like(m: nn.Module) -> bool:
    """Exactly nn.Linear, or HF's Conv1D: the layers "auto" may shard."""
    return type(m) is nn.Linear or is_conv1d(m)


def linear_sizes(m: nn.Module) -> tuple[int, int]:
    """(in features, out features) of a Linear-like layer."""
    if is_conv1d(m):
        return int(m.nx), int(m.nf)  # type: ignore[arg-type]
    return int(m.in_features), int(m.out_features)  # type: ignore[arg-type]


_LEAVES = (int, float, bool, str, type(None), torch.dtype, torch.device, slice)


def tensors_in(tree: Any, out: list[Tensor] | None = None) -> list[Tensor]:
    """The tensors of `tree` in ``tree_flatten``'s order: tuples, lists and dicts walked here
    (pytree's generic walk cost more than the op itself on `meta`), others by pytree."""
    out = [] if out is None else out
    if isinstance(tree, Tensor):
        out.append(tree)
    elif type(tree) in (tuple, list, torch.Size, dict):
        for v in (tree.values() if type(tree) is dict else tree):
            tensors_in(v, out)
    elif not isinstance(tree, _LEAVES):
        out.extend(t for t in tree_flatten(tree)[0] if isinstance(t, Tensor))
    return out


def _op_name(func: Callable[..., Any]) -> str:
    return str(getattr(func, "__name__", func))


def _arg(args: tuple[Any, ...], kwargs: Mapping[str, Any], pos: int, key: str,
         default: Any) -> Any:
    return kwargs[key] if key in kwargs else args[pos] if len(args) > pos else default


def _dims(value: Any, ndim: int) -> set[int] | None:
    """Normalized dims of an int / sequence argument (None: all dims)."""
    if value is None:
        return None
    values = [value] if isinstance(value, int) else list(value)
    return {v % ndim for v in values if isinstance(v, int)} if ndim else set()


@dataclass
class Shard:
    sources: frozenset[str]
    dim: int
    fused: Fused = 1  # the direct output of a fused column: its parts along `dim`


@dataclass
class FullTrace:
    """The one-device forward: op output shapes, Linear-like calls, fused parts and heads."""

    shapes: list[tuple[str, list[tuple[int, ...]]]] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)       # layer -> times called
    fused: dict[str, Fused] = field(default_factory=dict)     # layer -> parts (flow_heads)
    heads: dict[str, tuple[int, int]] = field(default_factory=dict)  # layer -> (n, head dim)
    counts: dict[str, set[int]] = field(default_factory=dict)  # layer -> n of each part
    positional: set[str] = field(default_factory=set)  # embedding tables not indexed by input


class Run:
    """One run: the full one (`full` is None) records shapes; a simulated one follows shards."""

    def __init__(self, names: Mapping[int, str], tp: int, full: FullTrace | None,
                 columns: Mapping[str, Fused], no_rows: Mapping[str, str] | None = None
                 ) -> None:
        self.no_rows = no_rows or {}
        self.names = names          # id(module) -> name, the Linear-like layers
        self.tp = tp
        self.full = full            # None: this is the full run
        self.columns = columns
        self.trace = FullTrace()
        self.n = 0
        self.shard: dict[int, Shard] = {}
        self.direct: dict[int, tuple[str, int | None]] = {}  # full run: layer outputs, parts
        self.keep: list[Tensor] = []  # ids stay unique while the run lives
        self.blame: dict[str, str] = {}
        self.demoted: set[str] = set()
        self.rows: dict[str, set[str]] = {}
        self.roles: dict[str, str] = {}
        self.last_shard_op = ""
        self.derived: dict[int, frozenset[str]] = {}   # computed from these parameters alone
        self.data: set[int] = set()                     # full activations (from the input)
        self.partial: dict[str, set[str]] = {}          # parameter -> columns whose shard it met
        self.whole: set[str] = set()                    # parameters used on full activations
        self.param_shapes: dict[str, tuple[int, ...]] = {}
        self.sliced: dict[str, tuple[int, set[str]]] = {}   # per-head parameters (flow_heads)
        self.cuts: dict[str, dict[tuple[int, int], int]] = {}  # full run (flow_heads.learn)
        self.stack: list[str] = []     # the modules an op runs in (innermost last) and the
        self.leaves: set[str] = set()  # modules without children; `flow_heads`' norms:
        self.reduced: dict[str, set[str]] = {}   # module -> columns, modules reducing full
        self.whole_reduced: set[str] = set()     # tensors' features

    def begin(self, params: Mapping[str, Tensor], inputs: list[Tensor]) -> None:
        """Before the forward: the (meta) parameters by name, the input activations."""
        for name, p in params.items():
            self.derived[id(p)] = frozenset({name})
            self.param_shapes[name] = tuple(p.shape)
        self.data.update(id(t) for t in inputs)

    # blame ------------------------------------------------------------------------------------

    def fault(self, sources: set[str] | frozenset[str], why: str) -> None:
        for s in sources:
            self.blame.setdefault(s, why)

    def _sources(self, ts: list[Tensor]) -> list[Shard]:
        return [self.shard[id(t)] for t in ts if id(t) in self.shard]

    # torch ops --------------------------------------------------------------------------------

    def op(self, func: Callable[..., Any], args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> Any:
        name = _op_name(func)
        ins = tensors_in((args, kwargs))
        shards = self._sources(ins) if self.full is not None else []
        sources = frozenset().union(*(s.sources for s in shards)) if shards else frozenset()
        if shards:
            self.last_shard_op = name
            cut_args, cut_kwargs = flow_heads.cut_per_head(self, name, args, kwargs, ins)
            if cut_args is not args:   # a per-head parameter's slice came in: its tensors
                args, kwargs, ins = cut_args, cut_kwargs, tensors_in((cut_args, cut_kwargs))
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            if shards:
                self.fault(sources, f"{name} fails on the shard ({str(e).splitlines()[0]})")
                raise Abort from e
            raise
        outs = tensors_in(out)
        if not outs:
            return out
        if self.full is None:
            self.trace.shapes.append((name, [tuple(t.shape) for t in outs]))
            self._learn(name, args, kwargs, ins, outs)
            if name == "embedding" and len(ins) >= 2 and id(ins[0]) not in self.data:
                # indices made from sizes alone (arange): a position table, not a vocabulary
                self.trace.positional.update(self.derived.get(id(ins[1]), ()))
            self._follow_params(ins, outs, frozenset())
            return out
        index, self.n = self.n, self.n + 1
        expected = self.full.shapes[index] if index < len(self.full.shapes) else None
        if expected is None or expected[0] != name or len(expected[1]) != len(outs):
            if shards:
                self.fault(sources, f"the forward takes another path on the shard (at {name})")
                raise Abort
            raise TraceFailed(f"the forward is not the same twice (at {name})")
        if shards:
            self._check(name, args, kwargs, ins, outs, expected[1], shards, sources)
        flow_heads.note_reduction(self, name, args, kwargs, ins, shards)
        self._follow_params(ins, outs, sources)
        return out

    def _follow_params(self, ins: list[Tensor], outs: list[Tensor],
                       sources: frozenset[str]) -> None:
        """Simulated run: the parameter uses of one op (module docstring) and what its
        outputs are (computed from parameters, or activations)."""
        owners = frozenset().union(*(self.derived.get(id(t), ()) for t in ins))
        sharded = bool(sources)
        active = sharded or any(id(t) in self.data for t in ins)
        if owners and sharded:
            for p in owners:
                self.partial.setdefault(p, set()).update(sources)
        elif owners and active:
            self.whole.update(owners)
        for t in outs:
            if active:
                self.data.add(id(t))
            elif owners:
                self.derived[id(t)] = owners
            else:
                continue
            self.keep.append(t)

    def mixed(self) -> dict[str, set[str]]:
        """Parameters used both on a shard and on a full activation: {name: columns}."""
        return {p: cols for p, cols in self.partial.items() if p in self.whole}

    def _learn(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any],
               ins: list[Tensor], outs: list[Tensor]) -> None:
        """Full run: fused outputs and heads (`flow_heads.learn`)."""
        if ins and id(ins[0]) in self.direct:
            pos, default = _SLICE_OPS.get(name, (None, None))
            dim = None if pos is None else _arg(args, kwargs, pos, "dim", default)
            flow_heads.learn(self, name, args, ins[0], outs, dim)

    def _check(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any],
               ins: list[Tensor], outs: list[Tensor], full: list[tuple[int, ...]],
               shards: list[Shard], sources: frozenset[str]) -> None:
        """Simulated run: which outputs are shards, and whether the op may take a shard."""
        dims: list[int | None] = []
        for t, shape in zip(outs, full):
            diff = [i for i, (a, b) in enumerate(zip(shape, t.shape)) if a != b]
            if len(shape) != t.dim() or len(diff) > 1 or \
                    (diff and shape[diff[0]] != t.shape[diff[0]] * self.tp):
                self.fault(sources, f"{name} changes the shard's shape unevenly")
                raise Abort
            dims.append(diff[0] if diff else None)
        if all(d is None for d in dims):
            if not flow_heads.reduction_over_shard(self, name, args, kwargs, ins[0]):
                self.fault(sources, f"{name} reduces over the sharded features (each rank "
                                    f"would hold a partial result)")
            return
        if not self._splits_parts(name, args, kwargs, ins[0], outs):
            why = self._refusal(name, args, kwargs, ins, outs, full, dims)
            if why is None and any(part_count(s.fused) > 1 for s in shards):
                why = f"{name} reads a fused output before it is split into its parts"
            if why is not None:
                self.fault(sources, why)
                return
        for t, d in zip(outs, dims):
            if d is not None:
                self._mark(t, Shard(sources, d))

    def _slice_dim(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                   x: Tensor, s: Shard) -> bool:
        """Whether the slicing op `name` slices along the shard's dim (or an unknown one)."""
        pos, default = _SLICE_OPS[name]
        dim = _arg(args, kwargs, pos, "dim", default)
        return not isinstance(dim, int) or dim % x.dim() == s.dim

    def _splits_parts(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                      x: Tensor, outs: list[Tensor]) -> bool:
        """Whether the op splits a fused shard into its parts (q | k | v): each a shard."""
        s = self.shard.get(id(x))
        if s is None or part_count(s.fused) < 2:
            return False
        if name == "__getitem__":
            return s.dim == x.dim() - 1 and len(args) > 1 and \
                flow_heads.takes_a_part(s.fused, args[1], x, self.tp)
        return name in _SLICE_OPS and len(outs) == part_count(s.fused) and \
            self._slice_dim(name, args, kwargs, x, s)

    def _refusal(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any],
                 ins: list[Tensor], outs: list[Tensor], full: list[tuple[int, ...]],
                 dims: list[int | None]) -> str | None:
        """Why the op may not take its shard (None: it may): it works along the features."""
        x = ins[0]
        x_shard = self.shard.get(id(x))
        if name in _DIM_OPS and x_shard is not None:
            pos, key, default = _DIM_OPS[name]
            reduced = _dims(_arg(args, kwargs, pos, key, default), x.dim())
            if reduced is None or x_shard.dim in reduced:
                return f"{name} runs along the sharded features"
        elif name in _NORM_OPS and x_shard is not None:
            if name == "group_norm" or name == "local_response_norm":
                return f"{name} mixes the sharded channels"
            shape = _arg(args, kwargs, 1, "normalized_shape", ())
            count = 1 if isinstance(shape, int) else len(shape)
            if x_shard.dim >= x.dim() - count:
                return f"{name} normalizes over the sharded features"
        elif name in _SLICE_OPS and x_shard is not None:
            if self._slice_dim(name, args, kwargs, x, x_shard):
                return f"{name} slices the sharded features"
        elif name in _CAT_OPS:
            seq = args[0] if args else kwargs.get("tensors", ())
            n = outs[0].dim() if name == "stack" else ins[0].dim()
            dim = _arg(args, kwargs, 1, "dim", 0)
            if isinstance(dim, int):
                for t in seq if isinstance(seq, (list, tuple)) else ():
                    s = self.shard.get(id(t))
                    if s is not None and name != "stack" and dim % n == s.dim:
                        return f"{name} joins along the sharded features"
        elif name == "__getitem__" and x_shard is not None and dims[0] is not None:
            if full[0][dims[0]] != self.full_size(x, x_shard):
                return "indexing slices the sharded features"
        return None

    def full_size(self, x: Tensor, s: Shard) -> int:
        return int(x.shape[s.dim]) * self.tp

    def _mark(self, t: Tensor, s: Shard) -> None:
        self.shard[id(t)] = s
        self.keep.append(t)

    # Linear-like layers -----------------------------------------------------------------------

    def linear(self, name: str, module: nn.Module, x: Tensor) -> Tensor:
        n_in, n_out = linear_sizes(module)
        dtype = x.dtype if x.is_floating_point() else torch.float32
        if self.full is None:
            self.trace.calls[name] = self.trace.calls.get(name, 0) + 1
            out = torch.empty(*x.shape[:-1], n_out, dtype=dtype, device="meta")
            self.direct[id(out)] = (name, None)
            self.keep.append(out)
            self.data.add(id(out))
            return out
        s = self.shard.get(id(x))
        role = "replicate"
        if s is not None:
            role = "row"
            if name in self.no_rows:
                self.fault(s.sources, f"'{name}' reads the shard but cannot be a row layer "
                                      f"({self.no_rows[name]})")
            elif s.dim == x.dim() - 1 and part_count(s.fused) == 1 and \
                    x.shape[-1] * self.tp == n_in:
                self.rows.setdefault(name, set()).update(s.sources)
            else:
                self.fault(s.sources, f"'{name}' reads the shard, but not as its input features")
            if name in self.columns:
                self.demoted.add(name)
            out = torch.empty(*x.shape[:-1], n_out, dtype=dtype, device="meta")
        elif name in self.columns:
            role = "column"
            out = torch.empty(*x.shape[:-1], n_out // self.tp, dtype=dtype, device="meta")
            self._mark(out, Shard(frozenset({name}), out.dim() - 1, self.columns[name]))
        else:
            out = torch.empty(*x.shape[:-1], n_out, dtype=dtype, device="meta")
        if id(out) not in self.shard:
            self.data.add(id(out))
            self.keep.append(out)
        if self.roles.setdefault(name, role) != role:
            self.fault({name} | (s.sources if s is not None else set()),
                       f"'{name}' is called more than once, as {self.roles[name]} and {role}")
        return out

    def leaks(self, output: Any) -> None:
        for t in tensors_in(_outputs(output)):
            s = self.shard.get(id(t))
            if s is not None:
                self.fault(s.sources, "its shard reaches the model's output")


def _outputs(output: Any) -> Any:
    if isinstance(output, Mapping):  # HF ModelOutput is an OrderedDict
        return list(output.values())
    return output
