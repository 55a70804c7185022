"""A Hugging Face model's own tensor-parallel plan, in the names of its `to_sequential` layout.

    HF (LlamaForCausalLM._tp_plan)              Sequential (L blocks)    style
    model.embed_tokens (where a plan names it)  0                        embedding_rowwise
    model.layers.*.self_attn.q_proj             1.self_attn.q_proj ...   colwise
    model.layers.*.mlp.down_proj                1.mlp.down_proj ...      rowwise
    (model.norm: not in the plan)               L + 1                    -
    lm_head                                     L + 2                    colwise_gather_output
    lm_head tied to model.embed_tokens          L + 2 and 0              colwise and
                                                                         embedding_rowwise

Each ``*`` (one layer index) is expanded over the blocks and mapped with `key_map`, so the
result is a dict of exact names that ``HybridPipe(..., tp_plan=...)`` takes as it is (the
styles are Hugging Face's: `tensor_parallel.plans.hf_plan`); ``HybridPipe(..., tp_plan="hf")``
calls it. A model without a plan (GPT-2 has none) gives a `ValueError`: use
``tp_plan="auto"``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hybridpar.hf.keys import KeyMap, key_map
from hybridpar.hf.structure import num_layers
from hybridpar.moe.hf_blocks import HFMoE

__all__ = ["config_of", "tp_plan"]


def config_of(model: nn.Module) -> Any:
    """The Hugging Face config of an HF model or of a `to_sequential` Sequential."""
    config = getattr(model, "config", None)
    if config is None and isinstance(model, nn.Sequential):
        config = next((getattr(m, "config", None) for m in model.children()
                       if getattr(m, "config", None) is not None), None)
    if config is None:
        raise ValueError(f"{type(model).__name__} holds no Hugging Face config: give the HF "
                         "model or the nn.Sequential that hybridpar.hf.to_sequential made")
    return config


def tp_plan(model: nn.Module) -> dict[str, str]:
    """``{sequential layer name: HF style}`` from the model's ``_tp_plan`` (or its config's
    ``base_model_tp_plan``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = config_of(model)
    if any(isinstance(m, HFMoE) for m in model.modules()):
        raise ValueError(f"{type(config).__name__}'s own tensor-parallel plan shards experts "
                         "(its moe_* styles), which hybridpar does not take yet: use "
                         "tp_plan='auto' (experts replicated over tp, the rest sharded)")
    # the class's plan, never the object's: transformers 5 fills a model object's _tp_plan in
    # with more (model.embed_tokens: embedding_rowwise), which a to_sequential Sequential
    # (tp_plan="hf") no longer has; one plan for both
    plan = dict(getattr(type(model), "_tp_plan", None) or {})
    if not plan and type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:   # a Sequential: its class's
        plan = dict(getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], "_tp_plan", None) or {})
    base = dict(getattr(config, "base_model_tp_plan", None) or {})
    names = key_map(config)
    plan.update({names.base + k: v for k, v in base.items() if names.base + k not in plan})
    if not plan:
        raise ValueError(f"{type(config).__name__} has no tensor-parallel plan "
                         "(base_model_tp_plan); use tp_plan='auto'")
    out: dict[str, str] = {}
    for key, style in plan.items():
        keys = [key.replace("*", str(i)) for i in range(num_layers(config))] \
            if "*" in key else [key]
        for hf_name in keys:
            out[_layer(names, hf_name + ".weight")] = style
    if names.tied is not None and _layer(names, names.tied[0]) in out:
        # a tied head is one Parameter with the embedding: both sharded on the vocab, the
        # logits left class-sharded for the vocab-parallel loss (not gathered)
        out[_layer(names, names.tied[0])] = "colwise"
        out[_layer(names, names.tied[1])] = "embedding_rowwise"
    return out


def _layer(names: KeyMap, hf_weight: str) -> str:
    """The Sequential layer holding the HF parameter `hf_weight`."""
    return names.from_hf(hf_weight).removesuffix(".weight")
