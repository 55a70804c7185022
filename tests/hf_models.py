"""Tiny Hugging Face causal LMs built from their config classes (no download), for the tests."""

from __future__ import annotations

import torch


def tiny(kind: str, *, seed: int = 0, dtype: torch.dtype = torch.float64):
    """A tiny causal LM of `kind` (llama: GQA 4 q / 2 kv heads), in eval-free train mode."""
    import transformers as tf

    decoder = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    configs = {
        "llama": lambda: tf.LlamaConfig(**decoder),
        "qwen2": lambda: tf.Qwen2Config(**decoder),
        "qwen3": lambda: tf.Qwen3Config(**decoder, head_dim=8),
        "mistral": lambda: tf.MistralConfig(**decoder, sliding_window=4),
        "gpt2": lambda: tf.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2,
                                      n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=0, eos_token_id=0),
    }
    ids = dict(pad_token_id=0, bos_token_id=0, eos_token_id=1)
    window = dict(sliding_window=4)
    extra = {   # the families any decoder covers (`hf.structure`), each with what it adds
        "gemma": dict(head_dim=8),
        "gemma2": dict(head_dim=8, **window, final_logit_softcapping=3.0,
                       attn_logit_softcapping=5.0, query_pre_attn_scalar=8),
        "gemma3_text": dict(head_dim=8, **window, query_pre_attn_scalar=8,
                            layer_types=["sliding_attention", "full_attention"]),
        "phi3": dict(**window),
        "phi": dict(partial_rotary_factor=0.5, qk_layernorm=True),
        "olmo2": {},
        "granite": dict(embedding_multiplier=3.0, logits_scaling=4.0, residual_multiplier=0.5,
                        attention_multiplier=0.25),
        "cohere": dict(logit_scale=0.5, use_qk_norm=True),
        "glm4": dict(partial_rotary_factor=0.5),
        "starcoder2": dict(**window, embedding_dropout=0.0, residual_dropout=0.0),
        "gpt_neox": dict(rotary_pct=0.5, use_parallel_residual=True, hidden_dropout=0.0,
                         attention_dropout=0.0),
        "smollm3": dict(no_rope_layers=[1, 0], use_sliding_window=False),
        "granite_swa": dict(**window, layer_types=["sliding_attention", "full_attention"],
                            attention_multiplier=0.25),
    }
    if kind in extra:
        options = {**decoder, **ids, **extra[kind], "tie_word_embeddings": kind != "phi3"}
        configs[kind] = lambda: tf.AutoConfig.for_model(kind, **options)
    config = configs[kind]()
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config).to(dtype)
    for m in model.modules():   # attention sinks start at 0: a value per head tells them apart
        if isinstance(getattr(m, "sinks", None), torch.nn.Parameter) and \
                m.sinks.device.type != "meta":
            with torch.no_grad():
                m.sinks.copy_(torch.linspace(-1.0, 1.0, m.sinks.numel(), dtype=dtype))
    return model


def token_batches(steps: int, batch: int, seq: int, vocab: int = 64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(steps)]
