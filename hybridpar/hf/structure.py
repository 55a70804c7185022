"""Where a Hugging Face causal LM keeps its parts, read from the model's own plans.

A decoder's class says how it is built: ``base_model_prefix`` names its trunk, the config's
``base_model_pp_plan`` lists the trunk's modules in run order, the causal LM's ``_pp_plan``
names its head. No family table: any class that says so is cut the same way.

    source                                   Llama                     GPT-NeoX
    CausalLM.base_model_prefix               model                     gpt_neox
    base_model_pp_plan, before the blocks    embed_tokens              embed_in, emb_dropout
    base_model_pp_plan, the blocks           layers                    layers
    base_model_pp_plan, after the blocks     norm                      final_layer_norm
    CausalLM._pp_plan                        lm_head                   lm_head

A class without a pp plan is inspected (its meta build with one layer): the trunk's children
in order must be an embedding (GPT-2's token and position tables: ``wte``, ``wpe``, its
dropout), a ``ModuleList`` of blocks and one norm; anything else is refused, naming it.
Checkpoint renames (GPT-NeoX's ``embed_out.`` is ``lm_head.`` in the model) are transformers'
own conversion mapping; a checkpoint that needs merged tensors (a converter, not a rename) is
refused when it is read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

__all__ = ["UNSUPPORTED", "Structure", "attention_type", "config_value", "num_layers",
           "structure_of"]

# features no adapter here takes, by what a config or class shows (issue: clear refusals)
UNSUPPORTED = {
    "ForConditionalGeneration": "a multi-modal model (vision / audio towers)",
    "kv_lora_rank": "multi-head latent attention",
    "n_routed_experts": "a mixture of experts with routed and shared experts (DeepSeek)",
    "hidden_size_per_layer_input": "per-layer inputs (Gemma 3n)",
    "linear_num_key_heads": "linear-attention layers",
    "mamba_n_heads": "state-space (Mamba) layers",
}


@dataclass(frozen=True)
class Structure:
    """A causal LM's parts as attribute names; Hugging Face's state-dict names follow them.

    `inputs` are the trunk's modules before the blocks, in run order (the first is the token
    embedding); `learned_positions`: they are GPT-2's ``wte``, ``wpe``, ``drop``. `renames`
    are (pattern, replacement) pairs taking checkpoint names to the model's; `ignored` are
    checkpoint keys that hold no weight (regular expressions), dropped as HF drops them.
    """

    model_type: str
    causal_lm: str
    base: str
    inputs: tuple[str, ...]
    layers: str
    norm: str
    head: str
    learned_positions: bool = False
    renames: tuple[tuple[str, str], ...] = ()
    ignored: tuple[str, ...] = ()

    @property
    def embedding(self) -> str:
        """The token embedding's attribute in the trunk."""
        return self.inputs[0]


def config_value(config: Any, *names: str, default: Any = None) -> Any:
    """The first of `names` set on `config` (a `PretrainedConfig`, a model, a config.json dict)."""
    config = getattr(config, "config", config)   # a model: its config
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    return default


def num_layers(config: Any) -> int:
    """The number of decoder blocks: ``num_hidden_layers`` (GPT-2's config.json: ``n_layer``)."""
    count = config_value(config, "num_hidden_layers", "n_layer")
    if not isinstance(count, int):
        raise ValueError("the config gives no num_hidden_layers (or n_layer)")
    return count


def attention_type(config: Any, index: int) -> str:
    """The causal mask block `index` uses: ``config.layer_types[index]`` where the config has
    them (``"full_attention"``, ``"sliding_attention"``, ...), else a sliding window whenever
    ``config.sliding_window`` is set (Mistral, StarCoder2, Phi-3), else full attention."""
    layer_types = config_value(config, "layer_types")
    if layer_types is not None:
        return str(layer_types[index])
    if config_value(config, "sliding_window") is not None:
        return "sliding_attention"
    return "full_attention"


def structure_of(config: Any) -> Structure:
    """The `Structure` of a config's causal LM (`config`: a config, a model or a config.json
    dict), or a `ValueError` naming what is not a decoder this adapter takes."""
    model_type = config_value(config, "model_type")
    if not isinstance(model_type, str):
        raise ValueError("the config names no model_type: give a Hugging Face config")
    return _structure(model_type)


@functools.cache
def _structure(model_type: str) -> Structure:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model_type {model_type!r} is not a causal LM of the installed "
                         "transformers (AutoModelForCausalLM has no class for it)")
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    if name.endswith("ForConditionalGeneration"):
        raise ValueError(f"{name} ({model_type!r}) is {UNSUPPORTED['ForConditionalGeneration']}"
                         "; hybridpar.hf converts text decoders (use its text model type)")
    import transformers

    causal_lm = getattr(transformers, name)
    config_class = CONFIG_MAPPING[model_type]
    try:
        defaults = config_class()
    except Exception as e:          # a config that cannot stand alone (a composite's part)
        raise ValueError(f"{name}: its config class {config_class.__name__} does not build "
                         f"with its defaults ({type(e).__name__}: {e}); hybridpar.hf converts "
                         "decoders whose config does") from e
    for key, feature in UNSUPPORTED.items():
        if getattr(defaults, key, None):
            raise ValueError(f"{name} has {feature} ({key} in its config): hybridpar.hf does "
                             "not convert it yet")
    base = causal_lm.base_model_prefix
    head = next(iter(getattr(causal_lm, "_pp_plan", None) or {"lm_head": None}))
    plan = getattr(config_class, "base_model_pp_plan", None)
    ignored = (r"(^|\.)rotary_emb\.\w*inv_freq$", r"(^|\.)attn\.masked_bias$",
               *(rf"(^|\.){p}$" for p in getattr(causal_lm, "_keys_to_ignore_on_load_unexpected",
                                                 None) or ()))
    common = dict(model_type=model_type, causal_lm=name, base=base, head=head,
                  renames=_renames(name, model_type), ignored=ignored)
    if plan:
        names = list(plan)
        blocks = [n for n, (ins, _) in plan.items() if "attention_mask" in ins]
        if len(blocks) != 1 or names.index(blocks[0]) == 0 or names[-1] == blocks[0] \
                or len(names) - names.index(blocks[0]) != 2:
            raise ValueError(f"{name}'s base_model_pp_plan {names} is not embedding -> blocks "
                             "-> one norm: hybridpar.hf cannot cut it")
        at = names.index(blocks[0])
        return Structure(inputs=tuple(names[:at]), layers=blocks[0], norm=names[-1], **common)
    return _inspected(causal_lm, defaults, common)


def _inspected(causal_lm: Any, config: Any, common: dict[str, Any]) -> Structure:
    """The structure of a class without a pp plan, from its children (a meta build, 1 block)."""
    import copy

    import torch
    from torch import nn

    config = copy.deepcopy(config)
    for key in ("num_hidden_layers", "n_layer"):
        if hasattr(config, key):
            setattr(config, key, 1)
    with torch.device("meta"):
        model = causal_lm(config)
    trunk = getattr(model, common["base"], None)
    what = f"{common['causal_lm']} (model_type {common['model_type']!r}, no base_model_pp_plan)"
    if trunk is None or not isinstance(getattr(model, common["head"], None), nn.Module):
        raise ValueError(f"{what} has no '{common['base']}' trunk and '{common['head']}' head")
    children = [(n, m) for n, m in trunk.named_children() if n != "rotary_emb"]
    lists = [i for i, (_, m) in enumerate(children) if isinstance(m, nn.ModuleList)]
    inputs, after = children[:lists[0]] if lists else [], children[lists[0] + 1:] if lists else []
    shape = [n for n, _ in children]
    gpt2 = [n for n, _ in inputs] == ["wte", "wpe", "drop"]
    llama = len(inputs) == 1 and isinstance(inputs[0][1], nn.Embedding)
    if len(lists) != 1 or len(after) != 1 or not (gpt2 or llama):
        raise ValueError(f"{what} is not embedding -> blocks -> one norm (its trunk holds "
                         f"{shape}): hybridpar.hf cannot cut it")
    return Structure(inputs=tuple(n for n, _ in inputs), layers=children[lists[0]][0],
                     norm=after[0][0], learned_positions=gpt2, **common)


def _renames(class_name: str, model_type: str) -> tuple[tuple[str, str], ...]:
    """transformers' checkpoint renames of the class (or its model type): (pattern, target)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    found = get_checkpoint_conversion_mapping(class_name) \
        or get_checkpoint_conversion_mapping(model_type) or []
    return tuple((t.source_patterns[0], t.target_patterns[0]) for t in found
                 if isinstance(t, WeightRenaming) and type(t) is WeightRenaming)
