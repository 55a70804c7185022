"""``model.name = "hf:<family>"``: a Hugging Face causal LM as the config's model.

    family    config class                 default size (a tiny model that trains on bytes)
    llama     LlamaConfig                  4 blocks, width 64, 4 query / 2 key-value heads
    mistral   MistralConfig                the same
    qwen2     Qwen2Config                  the same
    qwen3     Qwen3Config                  the same (head_dim 16)
    gpt2      GPT2Config                   4 blocks, width 64, 4 heads, tied embedding / head
    any other model type of transformers   its config class's defaults (`any_family`)

Every ``[model]`` key but ``pretrained`` and ``verify`` is a field of the family's config
class; ``verify = true`` (the default) runs the parity probe first (`hybridpar.hf.probe`:
the family refused unless converted exactly, its cost logged); the model
is random-init from the run's seed. ``pretrained = "PATH"`` reads a local checkpoint
directory instead (its ``config.json`` gives the architecture, the other keys are not used;
its ``*.safetensors`` the weights, tensor by tensor: `hybridpar.hf.load_hf_shards`). Built
on ``meta`` (what `hybridpar run` does with ``pretrained``) the model stays empty: each rank
then reads only its stage's tp slices into the pipe (`train.trainer.build_pipe`). Built with
`hybridpar.hf.to_sequential`; trained with `next_token_loss` on token ids
(``data.source = "corpus"`` gives bytes: vocab_size >= 256).
Needs ``pip install 'hybridpar[hf]'``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from hybridpar.keyed import keyed_reset_
from hybridpar.models.gpt import gpt_loss

__all__ = ["FAMILIES", "any_family", "expert_count", "gpt2", "hf_config", "llama", "mistral",
           "next_token_loss", "qwen2", "qwen3"]

Built = tuple[nn.Sequential, Callable[[Tensor, Tensor], Tensor]]
log = logging.getLogger(__name__)


def next_token_loss(logits: Tensor, targets: Tensor, *, reduction: str = "mean") -> Tensor:
    """Mean (or summed) cross-entropy of logits (B, T, V), class-sharded or not, against the
    next ids; targets of -100 are not counted."""
    return gpt_loss(logits, targets, reduction=reduction)


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError("model 'hf:...' needs Hugging Face transformers: pip install "
                         "'hybridpar[hf]'") from None
    return transformers


def hf_config(family: str, options: dict[str, Any]) -> Any:
    """The `PretrainedConfig` of `family` (a model type) built from `options` (the
    ``[model]`` keys; ``verify`` is not one of the config's)."""
    transformers = _transformers()
    options = {k: v for k, v in options.items() if k != "verify"}
    pretrained = options.pop("pretrained", None)
    if pretrained is not None:
        config = transformers.AutoConfig.from_pretrained(pretrained)
        if config.model_type != family:
            raise ValueError(f"model.pretrained {pretrained!r} holds a {config.model_type!r} "
                             f"model, not {family!r}: use model.name = "
                             f"'hf:{config.model_type}'")
        return config
    config_class = _config_class(family)
    if family not in FAMILIES:   # any_family's options are the class's defaults where not
        defaults = config_class()   # set: leave those to the class (layer_types follows
        plain = defaults.to_dict()             # num_hidden_layers)
        options = {k: v for k, v in options.items() if k not in plain or plain[k] != v}
    try:
        return config_class(**options)
    except Exception as e:   # transformers' validators (StrictDataclass... errors)
        raise ValueError(f"transformers' {config_class.__name__} refuses the [model] options "
                         f"of 'hf:{family}': {e}") from e


def expert_count(name: str, options: dict[str, Any]) -> int:
    """E of model `name`'s MoE layers (0: none): the built-in gpt's ``n_experts``; an
    ``hf:<family>``'s config (``model.pretrained``'s config.json when given)."""
    if name == "gpt":
        return int(options.get("n_experts", 0))
    if not name.startswith("hf:"):
        return 0
    from hybridpar.hf.structure import config_value

    config = hf_config(name.removeprefix("hf:"),
                       {k: v for k, v in options.items() if k not in ("name", "init")})
    return int(config_value(config, "num_local_experts", "num_experts", default=0) or 0)


def _config_class(family: str) -> Any:
    """The config class of a model type (`ValueError` naming the fix for an unknown one)."""
    _transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family not in CONFIG_MAPPING:
        raise ValueError(f"unknown Hugging Face model type {family!r} in model 'hf:{family}': "
                         "give a model_type of the installed transformers (config.json's "
                         "\"model_type\", e.g. 'hf:llama', 'hf:gemma2', 'hf:phi3')")
    return CONFIG_MAPPING[family]


def any_family(family: str) -> Callable[..., Built]:
    """The builder of ``hf:<family>`` for any model type: its keyword options are the fields of
    the family's config class, with that class's defaults (a full-size model: give the sizes),
    ``pretrained`` and ``verify`` (`hybridpar.hf.probe`)."""
    from hybridpar.hf.structure import structure_of

    defaults = _config_class(family)()
    structure_of(defaults)                 # not a decoder hybridpar.hf converts: said now
    plain = defaults.to_dict()             # JSON's types (a config.json round trip keeps them)
    fields = [k for k in plain if not k.startswith("_") and k not in _NOT_OPTIONS]

    def build(**options: Any) -> Built:
        return _build(family, options)

    keyword = inspect.Parameter.KEYWORD_ONLY
    build.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(k, keyword, default=plain[k]) for k in fields]
        + [inspect.Parameter("pretrained", keyword, default=None),
           inspect.Parameter("verify", keyword, default=True)])
    build.__doc__ = f"A Hugging Face {family!r} causal LM ({type(defaults).__name__}'s fields)."
    # the config's key types, from the defaults' (a table, a list, a number; None: any)
    build.__annotations__ = {k: _KEY_TYPES.get(type(plain[k]), Any) for k in fields}
    build.__annotations__.update(pretrained=str | None, verify=bool)
    return build


_KEY_TYPES: dict[type, Any] = {dict: dict[str, Any], list: list[Any], bool: bool, int: int,
                               float: float, str: str}


# config.to_dict() keys that are not model options
_NOT_OPTIONS = ("model_type", "transformers_version", "architectures", "dtype", "torch_dtype",
                "return_dict", "output_hidden_states", "output_attentions", "use_cache",
                "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
                "problem_type", "tokenizer_class", "task_specific_params")


def _build(family: str, options: dict[str, Any]) -> Built:
    """The family's model from `options`, as an nn.Sequential, with `next_token_loss`.

    Random-init (no ``pretrained``), every module is drawn again as Hugging Face draws it,
    under a seed keyed by its name (`hybridpar.keyed`): ``torch.manual_seed(s)`` then this
    gives the values a meta build draws for seed s in any layout (`train.trainer.build_pipe`).
    """
    from hybridpar.hf import init_fn, load_hf_shards, to_sequential
    from hybridpar.hf.probe import probe
    from hybridpar.hf.structure import structure_of

    transformers = _transformers()
    config = hf_config(family, options)
    if options.get("verify", True):
        with torch.device("cpu"):
            checked = probe(config)
        log.info("model.verify: %s converts exactly (its %d-layer float64 copy, max "
                 "difference %.1e; %.2f s)", structure_of(config).causal_lm, checked.layers,
                 checked.max_difference, checked.seconds)
    causal_lm = structure_of(config).causal_lm
    try:
        model = getattr(transformers, causal_lm)(config)
    except (AssertionError, ValueError, TypeError) as e:   # transformers' own checks
        raise ValueError(f"transformers' {causal_lm} refuses the [model] options of "
                         f"'hf:{family}': {e} (the config's fields keep their defaults "
                         "unless set: pad_token_id, for one, must be < vocab_size)") from e
    sequential = to_sequential(model)
    pretrained = options.get("pretrained")
    on_meta = any(p.is_meta for p in sequential.parameters())
    if pretrained is not None and not on_meta:   # on meta: the caller loads (`build_pipe`)
        load_hf_shards(sequential, pretrained, config=config)
    elif pretrained is None and not on_meta:
        keyed_reset_(sequential, torch.initial_seed(), init=init_fn(model))
    return sequential, next_token_loss


def llama(*, vocab_size: int = 256, hidden_size: int = 64, intermediate_size: int = 176,
          num_hidden_layers: int = 4, num_attention_heads: int = 4, num_key_value_heads: int = 2,
          max_position_embeddings: int = 1024, rope_theta: float = 10000.0,
          rms_norm_eps: float = 1e-6, tie_word_embeddings: bool = False,
          pretrained: str | None = None,
          verify: bool = True) -> Built:
    """A Llama causal LM (rotary positions, grouped-query attention, RMSNorm, SwiGLU)."""
    return _build("llama", _options(locals()))


def mistral(*, vocab_size: int = 256, hidden_size: int = 64, intermediate_size: int = 176,
            num_hidden_layers: int = 4, num_attention_heads: int = 4,
            num_key_value_heads: int = 2, max_position_embeddings: int = 1024,
            rope_theta: float = 10000.0, rms_norm_eps: float = 1e-6,
            tie_word_embeddings: bool = False, pretrained: str | None = None,
          verify: bool = True) -> Built:
    """A Mistral causal LM (Llama's architecture; no sliding window at these lengths)."""
    return _build("mistral", _options(locals()))


def qwen2(*, vocab_size: int = 256, hidden_size: int = 64, intermediate_size: int = 176,
          num_hidden_layers: int = 4, num_attention_heads: int = 4, num_key_value_heads: int = 2,
          max_position_embeddings: int = 1024, rope_theta: float = 10000.0,
          rms_norm_eps: float = 1e-6, tie_word_embeddings: bool = False,
          pretrained: str | None = None,
          verify: bool = True) -> Built:
    """A Qwen2 causal LM (Llama's architecture with biases on q, k, v)."""
    return _build("qwen2", _options(locals()))


def qwen3(*, vocab_size: int = 256, hidden_size: int = 64, intermediate_size: int = 176,
          num_hidden_layers: int = 4, num_attention_heads: int = 4, num_key_value_heads: int = 2,
          head_dim: int = 16, max_position_embeddings: int = 1024, rope_theta: float = 10000.0,
          rms_norm_eps: float = 1e-6, tie_word_embeddings: bool = False,
          pretrained: str | None = None,
          verify: bool = True) -> Built:
    """A Qwen3 causal LM (q / k RMSNorm per head)."""
    return _build("qwen3", _options(locals()))


def gpt2(*, vocab_size: int = 256, n_embd: int = 64, n_layer: int = 4, n_head: int = 4,
         n_positions: int = 1024, resid_pdrop: float = 0.0, embd_pdrop: float = 0.0,
         attn_pdrop: float = 0.0, tie_word_embeddings: bool = True,
         pretrained: str | None = None,
          verify: bool = True) -> Built:
    """GPT-2 (learned positions, Conv1D layers, fused q|k|v, tied embedding and head)."""
    return _build("gpt2", _options(locals()))


def _options(arguments: dict[str, Any]) -> dict[str, Any]:
    """A builder's keyword arguments (its locals at entry) as the config's fields."""
    return {k: v for k, v in arguments.items() if not k.startswith("_")}


FAMILIES: dict[str, Callable[..., Built]] = {
    "llama": llama, "mistral": mistral, "qwen2": qwen2, "qwen3": qwen3, "gpt2": gpt2}
