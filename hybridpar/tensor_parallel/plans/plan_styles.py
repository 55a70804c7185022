"""A plan's styles: the layers each applies to, sizes tp must divide, a dict resolved to styles.

    style                      layer              becomes
    column, row                nn.Linear,         ParallelLinear / ParallelConv1D (dim -1 / 0)
                               HF Conv1D
    vocab                      nn.Embedding       ParallelEmbedding(dim=0)
    replicate                  any                left as it is
    replicate_sum_grad         any                left as it is; its parameters' gradients
                                                  summed over tp after each step (it is used
                                                  on a shard: each rank's gradient is a part)
    dense_gather(_async)       nn.Linear          TPDense(mode="gather"), features sharded in/out
    dense_scatter(_async)      nn.Linear          TPDense(mode="scatter"), features sharded in/out

Hugging Face's styles map to internal ones (`hf_plan`): "column_gather" (a column whose output
is all-gathered), "column_fused2" (gate | up), "embedding_feature".
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any, cast

from torch import nn

from hybridpar.tensor_parallel.fused import Fused, part_sizes
from hybridpar.tensor_parallel.plans.flow_ops import is_conv1d, linear_sizes
from hybridpar.tensor_parallel.plans.hf_plan import HF_STYLES, NO_OP_HF_STYLES, match_hf_key
from hybridpar.tensor_parallel.plans.layer_graph import Layers

__all__ = ["COLUMNS", "DENSE_MODES", "DENSE_STYLES", "REPLICATED", "STYLES", "STYLE_HELP",
           "indivisible",
           "is_type", "resolve_dict", "resolve_hf", "tie_group"]

STYLES = ("column", "row", "vocab", "replicate", "replicate_sum_grad")
REPLICATED = ("replicate", "replicate_sum_grad")    # styles that leave the layer as it is
# the TPDense styles: style -> (TPDense mode, async_comm)
DENSE_MODES = {"dense_gather": ("gather", False), "dense_scatter": ("scatter", False),
               "dense_gather_async": ("gather", True), "dense_scatter_async": ("scatter", True)}
DENSE_STYLES = tuple(DENSE_MODES)
COLUMNS = ("column", "column_gather", "column_fused2")
_TYPE_OF: dict[str, type[nn.Module]] = {"column": nn.Linear, "row": nn.Linear,
                                        "vocab": nn.Embedding,
                                        **dict.fromkeys(DENSE_STYLES, nn.Linear)}
STYLE_HELP = ("valid styles: 'column' / 'row' (nn.Linear), 'vocab' (nn.Embedding), "
              "'replicate' (any module), 'replicate_sum_grad' (any module used on a shard: "
              "its gradients summed over tp), 'dense_gather' / 'dense_scatter' and their '_async' "
              "forms (nn.Linear to TPDense)")


def is_type(m: nn.Module, style: str) -> bool:
    """Whether `style` applies to `m` (column / row: also HF's Conv1D; dense: nn.Linear only)."""
    wanted = _TYPE_OF[style]
    if style in DENSE_STYLES:
        return isinstance(m, nn.Linear)
    return isinstance(m, wanted) or (wanted is nn.Linear and is_conv1d(m))


def indivisible(m: nn.Module, style: str, tp: int, parts: Fused = 1) -> str | None:
    """Which size of `m` tp does not divide under `style` (None: all divide)."""
    if style in DENSE_STYLES and isinstance(m, nn.Linear):
        for attr in ("in_features", "out_features"):   # both ends are feature shards
            size = getattr(m, attr)
            if size % tp:
                return f"{attr} {size} is not divisible by tp={tp}"
        return None
    if (style in COLUMNS or style == "row") and (isinstance(m, nn.Linear) or is_conv1d(m)):
        n_in, n_out = linear_sizes(m)
        attr, size = ("out_features", n_out) if style != "row" else ("in_features", n_in)
        widths = part_sizes(parts, size) if style != "row" else (size,)
        if any(n % tp for n in widths):
            per = f" (in fused parts {widths})" if len(widths) > 1 else ""
            return f"{attr} {size} is not divisible by tp={tp}{per}"
    return None


def resolve_dict(plan: Mapping[str, Any], layers: Layers) -> dict[str, str]:
    from_glob: dict[str, tuple[str, str]] = {}
    exact: dict[str, str] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not isinstance(style, str):
            raise ValueError(f"tp_plan entries must be 'name pattern': 'style' strings (or "
                             f"'parameter name': (slices per dimension), a strategy), got "
                             f"{pattern!r}: {style!r}; {STYLE_HELP}")
        if style not in STYLES and style not in DENSE_STYLES:
            raise ValueError(f"tp_plan[{pattern!r}] = {style!r} is not a style; {STYLE_HELP}")
        is_glob = any(c in pattern for c in "*?[")
        matched = [n for n in layers.names if fnmatchcase(n, pattern)]
        if not matched:
            close = difflib.get_close_matches(pattern, layers.names, n=3)
            hint = f"; did you mean {close}?" if close else \
                f"; module names look like {layers.names[:4]}"
            raise ValueError(f"tp_plan pattern {pattern!r} matches no module{hint} "
                             f"({STYLE_HELP})")
        wanted = _TYPE_OF.get(style)
        targets = matched if wanted is None else \
            [n for n in matched if is_type(layers.by_name[n], style)]
        wrong = [n for n in matched if n not in targets]
        if wanted is not None and (not targets or (wrong and not is_glob)):
            shown = ", ".join(f"'{n}' ({layers.describe(n)})" for n in wrong[:4])
            raise ValueError(f"tp_plan[{pattern!r}] = {style!r} applies to nn.{wanted.__name__} "
                             f"only, but {pattern!r} matched {shown}; {STYLE_HELP}")
        for n in targets:
            if not is_glob:
                exact[n] = style
            elif n in from_glob and from_glob[n][1] != style:
                other, other_style = from_glob[n]
                raise ValueError(f"layer '{n}' is matched by {other!r} ({other_style!r}) and "
                                 f"{pattern!r} ({style!r}); make the patterns disjoint or "
                                 f"name the layer exactly (an exact name wins)")
            else:
                from_glob[n] = (pattern, style)
    styles = {n: s for n, (_, s) in from_glob.items()}
    styles.update(exact)
    return styles


def resolve_hf(plan: Mapping[str, str], root: nn.Module, layers: Layers) -> dict[str, str]:
    """{layer: internal style} for the Hugging Face entries of a plan (see `hf_plan`)."""
    prefix = getattr(root, "base_model_prefix", "")
    prefix = prefix if isinstance(prefix, str) and prefix and \
        prefix in dict(root.named_children()) else ""
    submodules = dict(root.named_modules())
    modules = [n for n in submodules if n]
    # the names parameters have: a key ending in one of them may name a parameter
    param_names = {p for m in submodules.values() for p, _ in m.named_parameters(recurse=False)}
    styles: dict[str, str] = {}
    for key, style in plan.items():
        if style in NO_OP_HF_STYLES or (key.rpartition(".")[2] in param_names and
                                        _per_head_parameter(key, style, root, modules, prefix)):
            continue
        internal = HF_STYLES.get(style, "")
        for n in match_hf_key(key, style, layers.names, prefix):
            m = layers.by_name[n]
            ok = internal in REPLICATED or (
                is_type(m, "row") if internal in (*COLUMNS, "row") else
                isinstance(m, nn.Embedding))
            if not ok:
                kind = "an nn.Embedding" if "embedding" in style else "an nn.Linear or Conv1D"
                raise ValueError(f"tp_plan[{key!r}] = {style!r} does not apply to '{n}' "
                                 f"({layers.describe(n)}); {style!r} is for {kind}")
            styles[n] = internal
    return styles


def _per_head_parameter(key: str, style: str, root: nn.Module, modules: list[str],
                        prefix: str) -> bool:
    """Whether HF plan `key` names a parameter (``layers.*.self_attn.sinks``), not a module:
    'colwise' there is a per-head parameter, which the data flow cuts by head with the column
    it meets (`flow_heads`), or keeps whole beside a replicated one; ValueError for other
    styles."""
    owner_key, _, param = key.rpartition(".")
    try:
        owners = match_hf_key(owner_key, style, modules, prefix) if owner_key else [""]
    except ValueError:
        return False
    if not any(isinstance(getattr(root.get_submodule(n), param, None), nn.Parameter)
               for n in owners):
        return False
    if style != "colwise":
        raise ValueError(f"tp_plan[{key!r}] = {style!r} names a parameter; hybridpar takes "
                         f"'colwise' there (a per-head parameter, cut by head with its "
                         f"attention's heads) or no entry")
    return True


def tie_group(name: str, styles: Mapping[str, str], layers: Layers, tp: int
               ) -> tuple[str, list[str]] | None:
    """(embedding, [linears]) when `name`'s weight is tied only to layers sharded alike."""
    tied = layers.tied(name)
    if not tied or any(not t.endswith(".weight") for t in tied) or \
            layers.unshardable(name, ignore_ties=True) is not None:
        return None
    group = [name, *[t.rpartition(".")[0] for t in tied]]
    embs = [n for n in group if isinstance(layers.by_name[n], nn.Embedding) and
            styles.get(n) == "vocab"]
    lins = [n for n in group if type(layers.by_name[n]) is nn.Linear and
            styles.get(n) == "column"]
    if len(embs) != 1 or len(embs) + len(lins) != len(group) or \
            cast(nn.Embedding, layers.by_name[embs[0]]).num_embeddings % tp:
        return None
    return embs[0], lins
