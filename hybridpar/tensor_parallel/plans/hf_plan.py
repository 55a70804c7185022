"""Hugging Face tp plans (``config.base_model_tp_plan``, ``model._tp_plan``) as hybridpar styles.

    HF style                               hybridpar                      layer
    colwise                                column (output sharded)        Linear / Conv1D
    rowwise, rowwise_rep,                  row (a sharded input is        Linear / Conv1D
      rowwise_split_input                    used, a full one split)
    colwise_rep, colwise_gather_output     column, output all-gathered    Linear / Conv1D
    packed_colwise                         column, fused=2 (gate | up)    Linear / Conv1D
    embedding_rowwise                      vocab                          Embedding
    embedding_colwise                      feature-sharded Embedding      Embedding
    replicate                              replicate
    replicated_with_grad_allreduce         replicate_sum_grad (replicated, used on a shard:
                                           its gradient summed over tp, e.g. Qwen3's q_norm)
    sequence_parallel                      replicate (a norm's weights; the activations'
                                           sharding is parallel.sequence_parallel's)

    colwise on a parameter                 sharded by head, as the        a per-head parameter
      (``layers.*.self_attn.sinks``)         column it meets (`flow_heads`)  (attention sinks)
    local_params                           nothing to do: HF keeps the module's parameters
                                           plain tensors, as hybridpar does every parameter

Other styles (packed_rowwise, all_reduce, moe_*, mla_kv_a_proj) raise ValueError. A key is
a module name in which ``*`` stands for one layer index (``layers.*.self_attn.q_proj``), or a
parameter's (module name, then the parameter); a ``base_model_tp_plan`` key is relative to
the base model, so a key matching nothing from the root is tried under
``model.base_model_prefix``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["HF_STYLES", "NO_OP_HF_STYLES", "UNSUPPORTED_HF_STYLES", "is_hf_style",
           "match_hf_key", "split_plan"]

HF_STYLES = {
    "colwise": "column", "rowwise": "row", "rowwise_rep": "row", "rowwise_split_input": "row",
    "colwise_rep": "column_gather", "colwise_gather_output": "column_gather",
    "packed_colwise": "column_fused2", "embedding_rowwise": "vocab",
    "embedding_colwise": "embedding_feature", "replicate": "replicate",
    "replicated_with_grad_allreduce": "replicate_sum_grad",
    # a norm over sequence-sharded activations: its weights replicated here; the activations'
    # sharding is parallel.sequence_parallel's (`hf.sequence`), on or off
    "sequence_parallel": "replicate",
}
NO_OP_HF_STYLES = ("local_params",)
UNSUPPORTED_HF_STYLES = ("packed_rowwise", "all_reduce", "moe_tp_experts",
                         "moe_identity_expert", "mla_kv_a_proj", "local_colwise",
                         "local_rowwise", "local_packed_rowwise", "local", "gather",
                         "isolate", "ep_router", "grouped_gemm")


def is_hf_style(style: object) -> bool:
    """Whether `style` is a Hugging Face style name (supported or not), not a hybridpar one."""
    return isinstance(style, str) and style != "replicate" and (
        style in HF_STYLES or style in NO_OP_HF_STYLES or style in UNSUPPORTED_HF_STYLES)


def match_hf_key(key: str, style: str, names: list[str], prefix: str) -> list[str]:
    """The module names an HF plan `key` names (``*``: one index); ValueError if none."""
    if style in UNSUPPORTED_HF_STYLES:
        raise ValueError(
            f"tp_plan[{key!r}] = {style!r} is a Hugging Face style hybridpar does not "
            f"support; supported: {', '.join(sorted(HF_STYLES))} (or hybridpar's 'column', "
            f"'row', 'vocab', 'replicate'); mark the layer 'replicate' or leave it out")
    pattern = re.compile("".join(r"\d+" if c == "*" else re.escape(c) for c in key) + "$")
    found = [n for n in names if pattern.match(n)]
    if not found and prefix:
        under = re.compile(re.escape(prefix + ".") + pattern.pattern)
        found = [n for n in names if under.match(n)]
    if not found:
        raise ValueError(
            f"tp_plan key {key!r} ({style!r}, a Hugging Face style: '*' is one layer index) "
            f"matches no module" + (f", also not under the base model '{prefix}'" if prefix
                                    else "") + f"; module names look like {names[:4]}")
    return found


def split_plan(plan: Mapping[object, object]) -> tuple[dict[object, object], dict[str, str]]:
    """(the hybridpar entries, the HF entries) of a plan."""
    ours = {k: v for k, v in plan.items() if not is_hf_style(v)}
    hf = {k: v for k, v in plan.items() if isinstance(k, str) and isinstance(v, str) and
          is_hf_style(v)}
    return ours, hf
