"""The Hugging Face causal LM families `to_sequential` supports, and where their parts live."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["SUPPORTED", "Family", "attention_type", "config_value", "family_of", "num_layers"]


@dataclass(frozen=True)
class Family:
    """Where a family keeps its parts, as attribute names (HF's state-dict names follow them).

    `base` is the decoder inside the causal LM (``model.model`` / ``model.transformer``);
    `embedding` the token embedding in it, or ``None`` for GPT-2, whose input layer is the sum
    of the token (``wte``) and learned position (``wpe``) embeddings; `rotary` whether the
    blocks take rotary ``position_embeddings``. `ignored` are checkpoint keys that hold no
    weight (regular expressions), dropped on load as Hugging Face drops them.
    """

    model_type: str
    classes: tuple[str, ...]
    base: str
    embedding: str | None
    layers: str
    norm: str
    rotary: bool
    ignored: tuple[str, ...] = ()


def _decoder(model_type: str, cls: str) -> Family:
    """A Llama-style family: ``model.embed_tokens``, ``model.layers``, ``model.norm``, rotary."""
    return Family(model_type, (cls,), base="model", embedding="embed_tokens", layers="layers",
                  norm="norm", rotary=True, ignored=(r"(^|\.)rotary_emb\.inv_freq$",))


SUPPORTED: dict[str, Family] = {
    "llama": _decoder("llama", "LlamaForCausalLM"),
    "mistral": _decoder("mistral", "MistralForCausalLM"),
    "qwen2": _decoder("qwen2", "Qwen2ForCausalLM"),
    "qwen3": _decoder("qwen3", "Qwen3ForCausalLM"),
    "gpt2": Family("gpt2", ("GPT2LMHeadModel",), base="transformer", embedding=None,
                   layers="h", norm="ln_f", rotary=False,
                   ignored=(r"(^|\.)attn\.(masked_)?bias$", r"(^|\.)crossattention\.bias$")),
}


def config_value(config: Any, *names: str, default: Any = None) -> Any:
    """The first of `names` set on `config` (a `PretrainedConfig`, a model, a config.json dict)."""
    config = getattr(config, "config", config)   # a model: its config
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if value is not None:
            return value
    return default


def family_of(config: Any, *, what: str = "model") -> Family:
    """The family of a config (or model), or a `ValueError` listing the supported ones."""
    model_type = config_value(config, "model_type")
    family = SUPPORTED.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        supported = ", ".join(f"{f.model_type} ({', '.join(f.classes)})"
                              for f in SUPPORTED.values())
        raise ValueError(
            f"hybridpar.hf supports the causal LMs of the model types {supported}; got a "
            f"{what} of model_type {model_type!r}. Other families need their own adapter "
            "(embedding, decoder blocks, final norm, head)")
    return family


def num_layers(config: Any) -> int:
    """The number of decoder blocks: ``num_hidden_layers`` (GPT-2's config.json: ``n_layer``)."""
    count = config_value(config, "num_hidden_layers", "n_layer")
    if not isinstance(count, int):
        raise ValueError("the config gives no num_hidden_layers (or n_layer)")
    return count


def attention_type(config: Any, index: int) -> str:
    """``"full_attention"`` or ``"sliding_attention"``: the causal mask block `index` uses."""
    layer_types = config_value(config, "layer_types")
    if layer_types is not None:                     # Qwen2 / Qwen3: one type per layer
        return str(layer_types[index])
    if (config_value(config, "model_type") == "mistral"
            and config_value(config, "sliding_window") is not None):
        return "sliding_attention"                  # Mistral: every layer, when set
    return "full_attention"
