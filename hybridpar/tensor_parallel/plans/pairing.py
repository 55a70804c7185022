"""Links between sharded layers: who reads whose feature shard, the Dropout swap, re-tag hooks.

Shared by `plan` (tp_plan styles) and `strategy` (shard). A *link* joins a layer whose output
is a feature shard to the next layer that reads one as its input features, with
``in_features`` equal to the first's ``out_features``:

    shard out (producer)                       shard in (consumer)
    ParallelLinear(dim=-1 / 1), column         ParallelLinear(dim=0), row
    TPDense(mode="gather" / "scatter")         TPDense(mode="gather" / "scatter")

`link_shards` finds the links under a `LinkRules` and prepares the modules between, so the
shard flows on with its tag (elementwise ops drop it; DESIGN "tags travel"):

    between the two layers          becomes / gets
    nn.Dropout (exactly)            ParallelDropout(parity=True): the one-device masks
    ParallelDropout without group   the links' group
    every module                    a KeepTag forward hook (output tagged like its input);
                                    with ``tag_width`` also a TagNarrowInput pre-hook

The two rule sets:

    rules      chain searched                        may stand between        layers linked
    SIBLINGS   each module's children                anything but another     ParallelLinear
               (tp_plan: the plan chose the pairs)   Linear / Embedding
    RUN_ORDER  children in run order, nested         elementwise modules,     ParallelLinear,
               nn.Sequential flattened (shard; the   RegisterParallelDim      TPDense
               TPDense styles)

`gather_unlinked` all-gathers the output of the given producers that no link carries on, and
`convert_layer` builds the parallel layer holding a slice of a plain one (no random number).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed import ProcessGroup

from hybridpar.tensor_parallel.base import ParallelLayer
from hybridpar.tensor_parallel.embedding import ParallelEmbedding
from hybridpar.tensor_parallel.feature.dense import TPDense
from hybridpar.tensor_parallel.fused import Fused
from hybridpar.tensor_parallel.layers import ParallelConv1D, ParallelLinear, RegisterParallelDim
from hybridpar.tensor_parallel.plans.flow_ops import is_conv1d
from hybridpar.tensor_parallel.plans.hooks import (
    GatherOutput,
    KeepTag,
    TagNarrowInput,
    TagShardedInput,
)
from hybridpar.tensor_parallel.plans.layer_graph import ELEMENTWISE
from hybridpar.tensor_parallel.random import ParallelDropout, as_parallel_dropout

__all__ = ["RUN_ORDER", "SIBLINGS", "Link", "LinkRules", "convert_layer", "gather_unlinked",
           "link_shards", "shard_in", "shard_out"]

_LAYERS = (nn.Linear, nn.Embedding, ParallelLinear, ParallelEmbedding, TPDense)


def shard_out(m: nn.Module) -> int | None:
    """The full width of the feature shard `m` outputs (None: its output is not one)."""
    if isinstance(m, ParallelLinear) and m.dim in (1, -1):
        return m.out_features
    if isinstance(m, TPDense) and m.mode != "none" and not m.skip_communication:
        return m.out_features
    return None


def shard_in(m: nn.Module) -> int | None:
    """The full input width of a layer that reads a feature shard (None: it reads full input)."""
    if isinstance(m, ParallelLinear) and m.dim == 0:
        return m.in_features
    if isinstance(m, TPDense) and m.mode != "none" and not m.skip_communication:
        return m.in_features
    return None


def _not_a_layer(m: nn.Module) -> bool:
    return not isinstance(m, _LAYERS)


def _passes_shard(m: nn.Module) -> bool:
    return isinstance(m, (*ELEMENTWISE, RegisterParallelDim))


@dataclass(frozen=True)
class LinkRules:
    """Where `link_shards` looks for links and what it hooks (see the module's table)."""

    flatten: bool                           # nested nn.Sequential join their parent's chain
    passes: Callable[[nn.Module], bool]     # a module that may stand between linked layers
    tag_width: bool                         # between: also tag an untagged shard-wide input
    layers: tuple[type[nn.Module], ...]     # the layer types whose shards are linked


SIBLINGS = LinkRules(flatten=False, passes=_not_a_layer, tag_width=False,
                     layers=(ParallelLinear,))
RUN_ORDER = LinkRules(flatten=True, passes=_passes_shard, tag_width=True,
                      layers=(ParallelLinear, TPDense))


@dataclass(frozen=True)
class Link:
    """A producer's shard read by a consumer, and the modules it passes through (names)."""

    producer: str
    consumer: str
    between: tuple[str, ...]


def _chain(parent: nn.Module, prefix: str, flatten: bool) -> list[tuple[str, nn.Module]]:
    """`parent`'s children in registration (run) order; nested nn.Sequential flattened."""
    items: list[tuple[str, nn.Module]] = []
    for key, child in parent.named_children():
        if flatten and isinstance(child, nn.Sequential):
            items.extend(_chain(child, f"{prefix}{key}.", flatten))
        else:
            items.append((f"{prefix}{key}", child))
    return items


def _parents(root: nn.Module, flatten: bool) -> list[tuple[str, nn.Module]]:
    """The modules whose chains are searched (a flattened Sequential is in its parent's)."""
    return [(n, m) for n, m in root.named_modules()
            if not isinstance(m, nn.MultiheadAttention) and
            (not n or not flatten or not isinstance(m, nn.Sequential))]


def _pass_on(root: nn.Module, name: str, m: nn.Module, group: ProcessGroup, width: int,
             tag_width: bool) -> None:
    """Let the module `name` (between two linked layers) pass the shard on, tagged."""
    if type(m) is nn.Dropout:  # exactly nn.Dropout: no parameter, no state
        new = as_parallel_dropout(m, group)
        owner, _, attr = name.rpartition(".")
        setattr(root.get_submodule(owner), attr, new)
        m = new
    if isinstance(m, ParallelDropout) and m.group is None:
        m.group = group     # it now sees shards of this group
    if tag_width and not any(isinstance(h, TagNarrowInput)
                             for h in m._forward_pre_hooks.values()):
        m.register_forward_pre_hook(TagNarrowInput(width))
    if not any(isinstance(h, KeepTag) for h in m._forward_hooks.values()):
        m.register_forward_hook(KeepTag())


def link_shards(root: nn.Module, group: ProcessGroup, rules: LinkRules, *,
                only: set[int] | None = None) -> list[Link]:
    """Find the links inside `root` under `rules` and prepare the modules between them.

    `only`: ids of modules of which a link must hold at least one (None: any link).
    Returns the links in the order found (parents in `named_modules` order).
    """
    links: list[Link] = []
    for parent_name, parent in _parents(root, rules.flatten):
        chain = _chain(parent, f"{parent_name}." if parent_name else "", rules.flatten)
        for i, (a_name, a) in enumerate(chain):
            width = shard_out(a) if isinstance(a, rules.layers) else None
            if width is None:
                continue
            j = i + 1
            while j < len(chain) and rules.passes(chain[j][1]):
                j += 1
            b_name, b = chain[j] if j < len(chain) else ("", None)
            if b is None or not isinstance(b, rules.layers) or shard_in(b) != width or \
                    (only is not None and not {id(a), id(b)} & only):
                continue
            shard = width // _tp_size(a)
            for key, m in chain[i + 1:j]:
                _pass_on(root, key, m, group, shard, rules.tag_width)
            links.append(Link(a_name, b_name, tuple(k for k, _ in chain[i + 1:j])))
    return links


def _tp_size(m: nn.Module) -> int:
    return m.tp_size if isinstance(m, ParallelLayer) else 1


def gather_unlinked(root: nn.Module, producers: Iterable[nn.Module], links: Iterable[Link]
                    ) -> list[str]:
    """All-gather the output of each of `producers` that no link carries on; their names."""
    linked = {id(root.get_submodule(link.producer)) for link in links}
    wanted = {id(m) for m in producers}
    gathered = []
    for name, m in root.named_modules():
        if id(m) in wanted and id(m) not in linked and shard_out(m) is not None:
            m.register_forward_hook(GatherOutput())
            gathered.append(name)
    return gathered


def convert_layer(old: Any, kind: str, group: ProcessGroup, *, fused: Fused = 1) -> nn.Module:
    """The parallel layer holding this rank's slice of `old` (values kept, no random number).

    `kind`: "column" / "row" for a Linear-like `old` (nn.Linear, HF Conv1D, a
    ``ParallelLinear(dim=None)``), "vocab" / "feature" for an Embedding. A row layer gets
    the `TagShardedInput` pre-hook.
    """
    if kind in ("vocab", "feature"):
        return ParallelEmbedding.from_module(old, 0 if kind == "vocab" else -1, group=group)
    cls = ParallelConv1D if is_conv1d(old) else ParallelLinear
    new = cls.from_module(old, 0 if kind == "row" else -1, group=group, fused=fused)
    if kind == "row":
        new.register_forward_pre_hook(TagShardedInput())
    return new
