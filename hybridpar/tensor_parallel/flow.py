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
Caveat: a reshape that puts the heads inside the head dim would pass the shape test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["COUNT_ATTRS", "WIDTH_ATTRS", "FullTrace", "Pairing", "TraceFailed",
           "head_attributes", "is_conv1d", "is_linear_like", "linear_sizes", "pair_columns",
           "sample_input", "trace_full"]

# attributes of an attention module that count heads, or hold a width made of heads
COUNT_ATTRS = ("num_heads", "n_head", "n_heads", "num_attention_heads", "num_key_value_heads",
               "num_kv_heads", "n_kv_heads", "n_kv_head")
WIDTH_ATTRS = ("split_size", "embed_dim", "hidden_size", "all_head_size", "inner_dim")

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


class _Abort(Exception):
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


def sample_input(root: nn.Module) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A small meta input for `root`: token ids (2, 3) or features (2, 3, in); None if unknown."""
    if getattr(root, "main_input_name", None) == "input_ids":
        return (torch.zeros(2, 3, dtype=torch.long, device="meta"),), {}
    for m in root.modules():
        if next(m.parameters(recurse=False), None) is None:
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


def _tensors(tree: Any) -> list[Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, Tensor)]


def _op_name(func: Callable[..., Any]) -> str:
    return str(getattr(func, "__name__", func))


def _arg(args: tuple[Any, ...], kwargs: Mapping[str, Any], pos: int, key: str,
         default: Any) -> Any:
    if key in kwargs:
        return kwargs[key]
    return args[pos] if len(args) > pos else default


def _dims(value: Any, ndim: int) -> set[int] | None:
    """Normalized dims of an int / sequence argument (None: all dims)."""
    if value is None:
        return None
    values = [value] if isinstance(value, int) else list(value)
    return {v % ndim for v in values if isinstance(v, int)} if ndim else set()


class _Recorder(TorchFunctionMode):
    def __init__(self, run: _Run) -> None:
        super().__init__()
        self.run = run

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        return self.run.op(func, tuple(args), dict(kwargs or {}))


@dataclass
class _Shard:
    sources: frozenset[str]
    dim: int
    fused: int = 1  # the direct output of a fused column: k parts along `dim`


@dataclass
class FullTrace:
    """The one-device forward: op output shapes, Linear-like calls, fused parts and heads."""

    shapes: list[tuple[str, list[tuple[int, ...]]]] = field(default_factory=list)
    calls: dict[str, int] = field(default_factory=dict)       # layer -> times called
    fused: dict[str, int] = field(default_factory=dict)       # layer -> parts (k > 1)
    heads: dict[str, tuple[int, int]] = field(default_factory=dict)  # layer -> (n, head dim)


@dataclass
class Pairing:
    """What the simulation kept: columns, rows with the columns feeding them, and why not."""

    columns: dict[str, int]                 # layer -> fused parts
    rows: dict[str, set[str]]               # row layer -> the columns feeding it
    reasons: dict[str, str]                 # dropped candidate -> why


class _Run:
    def __init__(self, names: Mapping[int, str], tp: int, full: FullTrace | None,
                 columns: Mapping[str, int], no_rows: Mapping[str, str] | None = None) -> None:
        self.no_rows = no_rows or {}
        self.names = names          # id(module) -> name, the Linear-like layers
        self.tp = tp
        self.full = full            # None: this is the full run
        self.columns = columns
        self.trace = FullTrace()
        self.n = 0
        self.shard: dict[int, _Shard] = {}
        self.direct: dict[int, tuple[str, int | None]] = {}  # full run: layer outputs, parts
        self.keep: list[Tensor] = []  # ids stay unique while the run lives
        self.blame: dict[str, str] = {}
        self.demoted: set[str] = set()
        self.rows: dict[str, set[str]] = {}
        self.roles: dict[str, str] = {}
        self.last_shard_op = ""

    # blame ------------------------------------------------------------------------------------

    def fault(self, sources: set[str] | frozenset[str], why: str) -> None:
        for s in sources:
            self.blame.setdefault(s, why)

    def _sources(self, ts: list[Tensor]) -> list[_Shard]:
        return [self.shard[id(t)] for t in ts if id(t) in self.shard]

    # torch ops --------------------------------------------------------------------------------

    def op(self, func: Callable[..., Any], args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> Any:
        name = _op_name(func)
        ins = _tensors((args, kwargs))
        shards = self._sources(ins) if self.full is not None else []
        sources = frozenset().union(*(s.sources for s in shards)) if shards else frozenset()
        if shards:
            self.last_shard_op = name
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            if shards:
                self.fault(sources, f"{name} fails on the shard ({str(e).splitlines()[0]})")
                raise _Abort from e
            raise
        outs = _tensors(out)
        if not outs:
            return out
        if self.full is None:
            self.trace.shapes.append((name, [tuple(t.shape) for t in outs]))
            self._learn(name, args, kwargs, ins, outs)
            return out
        index, self.n = self.n, self.n + 1
        expected = self.full.shapes[index] if index < len(self.full.shapes) else None
        if expected is None or expected[0] != name or len(expected[1]) != len(outs):
            if shards:
                self.fault(sources, f"the forward takes another path on the shard (at {name})")
                raise _Abort
            raise TraceFailed(f"the forward is not the same twice (at {name})")
        if shards:
            self._check(name, args, kwargs, ins, outs, expected[1], shards, sources)
        return out

    def _learn(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any],
               ins: list[Tensor], outs: list[Tensor]) -> None:
        """Full run: fused outputs (split at once in k equal parts) and heads (first reshape)."""
        if not ins or id(ins[0]) not in self.direct:
            return
        x = ins[0]
        layer, part = self.direct[id(x)]
        last = x.dim() - 1
        if name in _SLICE_OPS and part is None and len(outs) > 1:
            pos, default = _SLICE_OPS[name]
            dim = _arg(args, kwargs, pos, "dim", default)
            if isinstance(dim, int) and dim % x.dim() == last and \
                    len({t.shape[-1] for t in outs}) == 1 and \
                    sum(t.shape[-1] for t in outs) == x.shape[-1]:
                self.trace.fused.setdefault(layer, len(outs))
                for i, t in enumerate(outs):
                    self.direct[id(t)] = (layer, i)
                    self.keep.append(t)
        elif name in ("view", "reshape", "unflatten") and len(outs) == 1:
            y = outs[0]
            if y.dim() == x.dim() + 1 and tuple(y.shape[:last]) == tuple(x.shape[:last]) and \
                    y.shape[-2] * y.shape[-1] == x.shape[-1] and layer not in self.trace.heads:
                self.trace.heads[layer] = (int(y.shape[-2]), int(y.shape[-1]))

    def _check(self, name: str, args: tuple[Any, ...], kwargs: Mapping[str, Any],
               ins: list[Tensor], outs: list[Tensor], full: list[tuple[int, ...]],
               shards: list[_Shard], sources: frozenset[str]) -> None:
        """Simulated run: which outputs are shards, and whether the op may take a shard."""
        tp = self.tp
        x = ins[0]
        x_shard = self.shard.get(id(x))
        dims: list[int | None] = []
        for t, shape in zip(outs, full):
            diff = [i for i, (a, b) in enumerate(zip(shape, t.shape)) if a != b]
            if len(shape) != t.dim() or len(diff) > 1 or \
                    (diff and shape[diff[0]] != t.shape[diff[0]] * tp):
                self.fault(sources, f"{name} changes the shard's shape unevenly")
                raise _Abort
            dims.append(diff[0] if diff else None)
        if all(d is None for d in dims):
            self.fault(sources, f"{name} reduces over the sharded features (each rank would "
                                f"hold a partial result)")
            return
        why = None
        if name in _DIM_OPS and x_shard is not None:
            pos, key, default = _DIM_OPS[name]
            reduced = _dims(_arg(args, kwargs, pos, key, default), x.dim())
            if reduced is None or x_shard.dim in reduced:
                why = f"{name} runs along the sharded features"
        elif name in _NORM_OPS and x_shard is not None:
            if name == "group_norm" or name == "local_response_norm":
                why = f"{name} mixes the sharded channels"
            else:
                shape = _arg(args, kwargs, 1, "normalized_shape", ())
                count = 1 if isinstance(shape, int) else len(shape)
                if x_shard.dim >= x.dim() - count:
                    why = f"{name} normalizes over the sharded features"
        elif name in _SLICE_OPS and x_shard is not None:
            pos, default = _SLICE_OPS[name]
            dim = _arg(args, kwargs, pos, "dim", default)
            if not isinstance(dim, int) or dim % x.dim() == x_shard.dim:
                if x_shard.fused > 1 and len(outs) == x_shard.fused:
                    for t, d in zip(outs, dims):
                        if d is not None:
                            self._mark(t, _Shard(sources, d))
                    return
                why = f"{name} slices the sharded features"
        elif name in _CAT_OPS:
            seq = args[0] if args else kwargs.get("tensors", ())
            n = outs[0].dim() if name == "stack" else ins[0].dim()
            dim = _arg(args, kwargs, 1, "dim", 0)
            if isinstance(dim, int):
                for t in seq if isinstance(seq, (list, tuple)) else ():
                    s = self.shard.get(id(t))
                    if s is not None and name != "stack" and dim % n == s.dim:
                        why = f"{name} joins along the sharded features"
        elif name == "__getitem__" and x_shard is not None and dims[0] is not None:
            if full[0][dims[0]] != self.full_size(x, x_shard):
                why = "indexing slices the sharded features"
        if any(s.fused > 1 for s in shards) and why is None:
            why = f"{name} reads a fused output before it is split into its parts"
        if why is not None:
            self.fault(sources, why)
            return
        for t, d in zip(outs, dims):
            if d is not None:
                self._mark(t, _Shard(sources, d))

    def full_size(self, x: Tensor, s: _Shard) -> int:
        return int(x.shape[s.dim]) * self.tp

    def _mark(self, t: Tensor, s: _Shard) -> None:
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
            return out
        s = self.shard.get(id(x))
        role = "replicate"
        if s is not None:
            role = "row"
            if name in self.no_rows:
                self.fault(s.sources, f"'{name}' reads the shard but cannot be a row layer "
                                      f"({self.no_rows[name]})")
            elif s.dim == x.dim() - 1 and s.fused == 1 and x.shape[-1] * self.tp == n_in:
                self.rows.setdefault(name, set()).update(s.sources)
            else:
                self.fault(s.sources, f"'{name}' reads the shard, but not as its input features")
            if name in self.columns:
                self.demoted.add(name)
            out = torch.empty(*x.shape[:-1], n_out, dtype=dtype, device="meta")
        elif name in self.columns:
            role = "column"
            out = torch.empty(*x.shape[:-1], n_out // self.tp, dtype=dtype, device="meta")
            self._mark(out, _Shard(frozenset({name}), out.dim() - 1, self.columns[name]))
        else:
            out = torch.empty(*x.shape[:-1], n_out, dtype=dtype, device="meta")
        if self.roles.setdefault(name, role) != role:
            self.fault({name} | (s.sources if s is not None else set()),
                       f"'{name}' is called more than once, as {self.roles[name]} and {role}")
        return out

    def leaks(self, output: Any) -> None:
        for t in _tensors(_outputs(output)):
            s = self.shard.get(id(t))
            if s is not None:
                self.fault(s.sources, "its shard reaches the model's output")


def _outputs(output: Any) -> Any:
    if isinstance(output, Mapping):  # HF ModelOutput is an OrderedDict
        return list(output.values())
    return output


@contextlib.contextmanager
def _patched(root: nn.Module, run: _Run) -> Iterator[None]:
    """Linear-like layers call `run.linear`; modules in eval mode; restored after."""
    modes = {m: m.training for m in root.modules()}
    patched = []
    for m in root.modules():
        name = run.names.get(id(m))
        if name is not None:
            m.forward = (lambda x, *a, _n=name, _m=m, **k: run.linear(_n, _m, x))
            patched.append(m)
    root.eval()
    try:
        yield
    finally:
        for m in patched:
            del m.forward
        for m, mode in modes.items():
            m.training = mode


def _forward(root: nn.Module, run: _Run, sample: tuple[tuple[Any, ...], dict[str, Any]]
             ) -> Any:
    meta = {k: torch.empty_like(v, device="meta")
            for k, v in [*root.named_parameters(), *root.named_buffers()]}
    args, kwargs = sample
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
    run = _Run(names, 1, None, {})
    try:
        _forward(root, run, sample)
    except Exception as e:
        raise TraceFailed(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                          ) from e
    return run.trace


def head_attributes(root: nn.Module, columns: Mapping[str, int], full: FullTrace, tp: int
                    ) -> list[tuple[nn.Module, str, str, int, int]]:
    """(module, its name, attribute, value, value / tp) for the attention modules of `columns`.

    A module owning a sharded column with n heads of size d (per fused part) holds n / tp
    heads per rank: its integer attributes named in COUNT_ATTRS equal to such an n, and in
    WIDTH_ATTRS equal to such an n * d, are divided by tp. Nothing else (head_dim, configs).
    """
    counts: dict[str, set[int]] = {}
    widths: dict[str, set[int]] = {}
    for name in columns:
        if name in full.heads:
            parent = name.rpartition(".")[0]
            n, d = full.heads[name]
            counts.setdefault(parent, set()).add(n)
            widths.setdefault(parent, set()).add(n * d)
    changes = []
    for parent, ns in counts.items():
        module = root.get_submodule(parent)
        for attr in (*COUNT_ATTRS, *WIDTH_ATTRS):
            value = vars(module).get(attr)
            if type(value) is not int:
                continue
            pool = ns if attr in COUNT_ATTRS else widths[parent]
            if value in pool and value % tp == 0:
                changes.append((module, parent, attr, value, value // tp))
    return changes


@contextlib.contextmanager
def _attributes(changes: list[tuple[nn.Module, str, str, int, int]]) -> Iterator[None]:
    try:
        for module, _, attr, _, new in changes:
            setattr(module, attr, new)
        yield
    finally:
        for module, _, attr, old, _ in changes:
            setattr(module, attr, old)


def pair_columns(root: nn.Module, names: Mapping[int, str],
                 sample: tuple[tuple[Any, ...], dict[str, Any]], full: FullTrace, tp: int,
                 candidates: Mapping[str, int], no_rows: Mapping[str, str] | None = None
                 ) -> Pairing:
    """Simulate the sharded forward until every candidate's shard obeys the rules.

    `candidates`: layer -> fused parts; `no_rows`: layers that may not be rows, and why.
    """
    columns = dict(candidates)
    reasons: dict[str, str] = {}
    for _ in range(len(candidates) + 2):
        run = _Run(names, tp, full, columns, no_rows)
        try:
            with _attributes(head_attributes(root, columns, full, tp)):
                run.leaks(_forward(root, run, sample))
        except _Abort:
            pass
        except TraceFailed:
            raise
        except Exception as e:
            shards = {s for sh in run.shard.values() for s in sh.sources}
            if not shards:
                raise TraceFailed(f"the simulated forward failed: {e}") from e
            run.fault(shards, f"the forward fails on the shard after {run.last_shard_op} "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
        dropped = {n for n in run.blame if n in columns} | (run.demoted & set(columns))
        if not dropped:
            fed = set().union(*run.rows.values()) if run.rows else set()
            for n in [n for n in columns if n not in fed]:
                reasons[n] = "no row layer reads its output"
                del columns[n]
            rows = {r: c & set(columns) for r, c in run.rows.items() if c & set(columns)}
            return Pairing(columns, rows, reasons)
        for n in dropped:
            if n in run.blame:
                reasons[n] = run.blame[n]
            del columns[n]
    raise TraceFailed("the simulation did not settle")
